// Decode attention on the CPU: one query token per row over a KV cache, as an XLA FFI handler.
//
// Inputs (float32 unless noted): q [B, K, G, Hd], keys [B, K, Hd, S], values [B, K, S, Hd],
// allowed [B, S] (pred), limit [] (int32: only slots [0, limit) are read).
// Attributes: share_rows, shared_slots: rows come in groups of share_rows consecutive rows
// whose keys and values in slots [0, shared_slots) are identical (the sampler's G copies of
// a prompt's cache); those slots are read from each group's first row only.
// Output: [B, K, G, Hd] = softmax(q . keys / sqrt(Hd), over allowed slots < limit) . values.
// A row with no allowed slot gets the mean of all S values, as the XLA path's finite mask
// gives. Both products keep blocks of 32 outputs per query in vector registers (GCC/Clang
// vector extensions), and the (row, KV head) pairs are shared out over XLA's intra-op
// thread pool: the loop is bound by memory, and one thread alone reached about half the
// bandwidth of two.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Shape {
  int64_t rows, kv_heads, groups, head_dim, slots, limit;
  int64_t share_rows, shared_slots;  // rows come in groups of share_rows sharing those slots
};

// exp(x) for x <= 0: Cephes' polynomial after a range reduction by ln 2, branch-free so
// that the loops calling it vectorize. Relative error about 2e-7; x below -87 gives about
// 1e-38 instead of 0 (masked slots are multiplied by 0 anyway).
inline float ExpNonPositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

using v8 = float __attribute__((vector_size(32)));

inline v8 Load(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void Store(float* p, v8 v) { std::memcpy(p, &v, sizeof v); }

// c[g, :cols] (+)= a[g, :rows] @ b[:rows, :cols] for NG rows of a (lda, ldb, ldc: row
// strides). Blocks of 32 (then 8) columns of c stay in vector registers over all of `rows`,
// so b is streamed once and c is written once.
template <int NG>
void MatMul(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t rows,
            int64_t cols, float* c, int64_t ldc, bool accumulate) {
  auto put = [&](float* out, v8 value) { Store(out, accumulate ? Load(out) + value : value); };
  int64_t j = 0;
  for (; j + 32 <= cols; j += 32) {
    v8 acc[NG][4] = {};
    for (int64_t r = 0; r < rows; ++r) {
      const float* row = b + r * ldb + j;
      const v8 b0 = Load(row), b1 = Load(row + 8), b2 = Load(row + 16), b3 = Load(row + 24);
      for (int g = 0; g < NG; ++g) {
        const float x = a[g * lda + r];
        acc[g][0] += x * b0;
        acc[g][1] += x * b1;
        acc[g][2] += x * b2;
        acc[g][3] += x * b3;
      }
    }
    for (int g = 0; g < NG; ++g)
      for (int i = 0; i < 4; ++i) put(c + g * ldc + j + 8 * i, acc[g][i]);
  }
  for (; j + 8 <= cols; j += 8) {
    v8 acc[NG] = {};
    for (int64_t r = 0; r < rows; ++r) {
      const v8 bj = Load(b + r * ldb + j);
      for (int g = 0; g < NG; ++g) acc[g] += a[g * lda + r] * bj;
    }
    for (int g = 0; g < NG; ++g) put(c + g * ldc + j, acc[g]);
  }
  for (; j < cols; ++j) {
    for (int g = 0; g < NG; ++g) {
      float acc = 0.0f;
      for (int64_t r = 0; r < rows; ++r) acc += a[g * lda + r] * b[r * ldb + j];
      c[g * ldc + j] = accumulate ? c[g * ldc + j] + acc : acc;
    }
  }
}

// MatMul for all G queries, two at a time.
void MatMulAll(int64_t G, const float* a, int64_t lda, const float* b, int64_t ldb, int64_t rows,
               int64_t cols, float* c, int64_t ldc, bool accumulate) {
  int64_t g = 0;
  for (; g + 2 <= G; g += 2)
    MatMul<2>(a + g * lda, lda, b, ldb, rows, cols, c + g * ldc, ldc, accumulate);
  for (; g < G; ++g) MatMul<1>(a + g * lda, lda, b, ldb, rows, cols, c + g * ldc, ldc, accumulate);
}

// scores[:, j0:j1] = q @ keys[:, j0:j1] (keys [Hd, S]; scores G x limit).
void Scores(const Shape& s, const float* q, const float* keys, int64_t j0, int64_t j1,
            float* scores) {
  if (j1 > j0)
    MatMulAll(s.groups, q, s.head_dim, keys + j0, s.slots, s.head_dim, j1 - j0, scores + j0,
              s.limit, false);
}

// out += weights[:, j0:j1] @ values[j0:j1] (values [S, Hd]; out G x Hd).
void Weighted(const Shape& s, const float* weights, const float* values, int64_t j0, int64_t j1,
              float* out) {
  if (j1 > j0)
    MatMulAll(s.groups, weights + j0, s.limit, values + j0 * s.head_dim, s.head_dim, j1 - j0,
              s.head_dim, out, s.head_dim, true);
}

// One (row, KV head). Slots below `shared` are read from `shared_keys` / `shared_values`
// (the first row of the row's group, identical there), the rest from the row's own cache.
// scores: G x limit scratch; inv_total: G scratch.
void AttendOne(const Shape& s, const float* q, const float* keys, const float* values,
               const float* shared_keys, const float* shared_values, const bool* allowed,
               float* out, float* scores, float* inv_total) {
  const int64_t G = s.groups, H = s.head_dim, S = s.slots, L = s.limit;
  const int64_t shared = std::min(s.shared_slots, L);
  std::fill(out, out + G * H, 0.0f);
  int64_t count = 0;
  for (int64_t j = 0; j < L; ++j) count += allowed[j];
  if (count == 0) {
    for (int64_t j = 0; j < S; ++j)
      for (int64_t h = 0; h < H; ++h) out[h] += values[j * H + h];
    for (int64_t h = 0; h < H; ++h) out[h] /= static_cast<float>(S);
    for (int64_t g = 1; g < G; ++g) std::copy(out, out + H, out + g * H);
    return;
  }
  Scores(s, q, shared_keys, 0, shared, scores);
  Scores(s, q, keys, shared, L, scores);
  const float root = std::sqrt(static_cast<float>(H));
  for (int64_t g = 0; g < G; ++g) {
    float* sc = scores + g * L;
    float m = -3.0e38f;
#pragma omp simd reduction(max : m)
    for (int64_t j = 0; j < L; ++j) {
      sc[j] /= root;
      m = std::max(m, allowed[j] ? sc[j] : -3.0e38f);
    }
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t j = 0; j < L; ++j) {
      sc[j] = ExpNonPositive(sc[j] - m) * static_cast<float>(allowed[j]);
      total += sc[j];
    }
    inv_total[g] = 1.0f / total;
  }
  Weighted(s, scores, shared_values, 0, shared, out);
  Weighted(s, scores, values, shared, L, out);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t h = 0; h < H; ++h) out[g * H + h] *= inv_total[g];
}

// Work shared by the calling thread and the pool's: chunks of consecutive rows are claimed
// from a counter, so the call finishes even if no pool thread ever picks a task up. When a
// chunk holds whole row groups, each group's shared slots come from memory once.
struct Work {
  Shape s;
  const float *q, *keys, *values;
  const bool* allowed;
  float* out;
  int64_t chunks;
  std::atomic<int64_t> next{0}, done{0};

  void Run() {
    std::vector<float> scores(s.groups * s.limit), inv_total(s.groups);
    const int64_t K = s.kv_heads, per_q = s.groups * s.head_dim, per_kv = s.head_dim * s.slots;
    for (int64_t c; (c = next.fetch_add(1)) < chunks; done.fetch_add(1)) {
      for (int64_t b = s.rows * c / chunks; b < s.rows * (c + 1) / chunks; ++b) {
        const int64_t leader = b - b % s.share_rows;
        for (int64_t k = 0; k < K; ++k) {
          const int64_t u = b * K + k, lu = leader * K + k;
          AttendOne(s, q + u * per_q, keys + u * per_kv, values + u * per_kv, keys + lu * per_kv,
                    values + lu * per_kv, allowed + b * s.slots, out + u * per_q, scores.data(),
                    inv_total.data());
        }
      }
    }
  }
};

ffi::Error DecodeAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                               ffi::Buffer<ffi::F32> keys, ffi::Buffer<ffi::F32> values,
                               ffi::Buffer<ffi::PRED> allowed, ffi::Buffer<ffi::S32> limit,
                               ffi::ResultBuffer<ffi::F32> out, int64_t share_rows,
                               int64_t shared_slots) {
  const auto qd = q.dimensions(), kd = keys.dimensions(), vd = values.dimensions(),
             ad = allowed.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || ad.size() != 2 ||
      kd[0] != qd[0] || kd[1] != qd[1] || kd[2] != qd[3] || vd[0] != qd[0] ||
      vd[1] != qd[1] || vd[2] != kd[3] || vd[3] != qd[3] || ad[0] != qd[0] || ad[1] != kd[3]) {
    return ffi::Error::InvalidArgument(
        "decode attention: expected q [B, K, G, Hd], keys [B, K, Hd, S], values [B, K, S, Hd], "
        "allowed [B, S]");
  }
  if (share_rows < 1 || qd[0] % share_rows != 0)
    return ffi::Error::InvalidArgument("decode attention: share_rows must divide the rows");
  auto work = std::make_shared<Work>();
  work->s = Shape{qd[0], qd[1], qd[2], qd[3], kd[3], 0, share_rows,
                  std::clamp<int64_t>(shared_slots, 0, kd[3])};
  work->s.limit = std::clamp<int64_t>(*limit.typed_data(), 0, work->s.slots);
  work->q = q.typed_data();
  work->keys = keys.typed_data();
  work->values = values.typed_data();
  work->allowed = allowed.typed_data();
  work->out = out->typed_data();
  if (work->s.rows * work->s.kv_heads == 0) return ffi::Error::Success();
  const int64_t helpers = std::max<int64_t>(0, pool.num_threads() - 1);
  work->chunks = std::min<int64_t>(work->s.rows, 4 * (helpers + 1));
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->Run(); });
  work->Run();
  while (work->done.load() < work->chunks) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EpgrpoDecodeAttention, DecodeAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("share_rows")
                                  .Attr<int64_t>("shared_slots"));
