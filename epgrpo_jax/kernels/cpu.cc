// CPU kernels for the sampler, as XLA FFI handlers: decode attention (EpgrpoDecodeAttention)
// and the top-k / top-p thresholds (EpgrpoLargestThreshold, at the end of this file).
//
// Decode attention: one query token per row over a KV cache.
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
#include <limits>
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

// Runs body(begin, end) over `chunks` consecutive pieces of [0, n) on the calling thread and
// the pool's: pieces are claimed from a counter, so the call finishes even if no pool thread
// ever picks a task up.
template <typename Body>
void ParallelChunks(ffi::ThreadPool& pool, int64_t n, Body body) {
  struct Counters {
    std::atomic<int64_t> next{0}, done{0};
  };
  const int64_t helpers = std::max<int64_t>(0, pool.num_threads() - 1);
  const int64_t chunks = std::min<int64_t>(n, 4 * (helpers + 1));
  auto counters = std::make_shared<Counters>();
  auto run = [counters, n, chunks, body] {
    for (int64_t c; (c = counters->next.fetch_add(1)) < chunks; counters->done.fetch_add(1))
      body(n * c / chunks, n * (c + 1) / chunks);
  };
  for (int64_t i = 0; i < helpers && i + 1 < chunks; ++i) pool.Schedule([run] { run(); });
  run();
  while (counters->done.load() < chunks) std::this_thread::yield();
}

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
  const Shape s{qd[0], qd[1], qd[2], qd[3], kd[3], std::clamp<int64_t>(*limit.typed_data(), 0, kd[3]),
                share_rows, std::clamp<int64_t>(shared_slots, 0, kd[3])};
  const float *qp = q.typed_data(), *kp = keys.typed_data(), *vp = values.typed_data();
  const bool* ap = allowed.typed_data();
  float* op = out->typed_data();
  const int64_t K = s.kv_heads, per_q = s.groups * s.head_dim, per_kv = s.head_dim * s.slots;
  if (s.rows * K == 0) return ffi::Error::Success();
  // A chunk of consecutive rows holding whole row groups reads each group's shared slots
  // from memory once.
  ParallelChunks(pool, s.rows, [=](int64_t begin, int64_t end) {
    std::vector<float> scores(s.groups * s.limit), inv_total(s.groups);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t leader = b - b % s.share_rows;
      for (int64_t k = 0; k < K; ++k) {
        const int64_t u = b * K + k, lu = leader * K + k;
        AttendOne(s, qp + u * per_q, kp + u * per_kv, vp + u * per_kv, kp + lu * per_kv,
                  vp + lu * per_kv, ap + b * s.slots, op + u * per_q, scores.data(),
                  inv_total.data());
      }
    }
  });
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------
// Top-k / top-p thresholds, as sampling.largest_threshold: per row of values [B, V] with
// weights [B, V] and target [B], the largest value t among the row's values with
// sum(weights[values >= t]) >= target; the row's smallest value if none reaches it. The same
// bisection over the float bits (as ordered integer keys) whose bracket snaps to values in
// the row, each pass one vectorised sweep; masses are summed in double. Output [B].
// Values must not be NaN.

// Integer keys ordered like the floats, -0.0 mapped like 0.0 (they compare equal, and a
// bracket end at the key of -0.0 would never move past a sweep at 0.0).
inline int64_t OrderedKey(float v) {
  if (v == 0.0f) return 0;
  int32_t i;
  std::memcpy(&i, &v, sizeof i);
  return i < 0 ? (i ^ 0x7fffffff) : i;
}

inline float FromOrderedKey(int64_t key) {
  int32_t i = static_cast<int32_t>(key);
  if (i < 0) i ^= 0x7fffffff;
  float v;
  std::memcpy(&v, &i, sizeof v);
  return v;
}

using v8i = int32_t __attribute__((vector_size(32)));
using v8d = double __attribute__((vector_size(64)));

struct Sweep {
  double mass;         // the sum of w where v >= t
  float above, below;  // the smallest v >= t, the largest v < t (+-inf if none)
  float largest;       // the largest v
};

// One pass over a row, eight lanes at a time (with -march=native, GCC did not vectorise the
// same loop written with `omp simd` reductions).
inline Sweep SweepRow(const float* v, const float* w, int64_t n, float t) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const v8 inf = v8{} + kInf, tv = v8{} + t;
  v8d mass8 = {};
  v8 above8 = inf, below8 = -inf, largest8 = -inf;
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const v8 x = Load(v + j);
    const v8i in = x >= tv;
    mass8 += __builtin_convertvector(in ? Load(w + j) : v8{}, v8d);
    const v8 a = in ? x : inf, b = in ? -inf : x;
    above8 = a < above8 ? a : above8;
    below8 = b > below8 ? b : below8;
    largest8 = x > largest8 ? x : largest8;
  }
  Sweep s{0.0, kInf, -kInf, -kInf};
  for (int i = 0; i < 8; ++i) {
    s.mass += mass8[i];
    s.above = std::min(s.above, above8[i]);
    s.below = std::max(s.below, below8[i]);
    s.largest = std::max(s.largest, largest8[i]);
  }
  for (; j < n; ++j) {
    s.largest = std::max(s.largest, v[j]);
    if (v[j] >= t) {
      s.mass += w[j];
      s.above = std::min(s.above, v[j]);
    } else {
      s.below = std::max(s.below, v[j]);
    }
  }
  return s;
}

float LargestThreshold(const float* v, const float* w, int64_t n, float target) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const Sweep all = SweepRow(v, w, n, -kInf);
  int64_t lo = OrderedKey(all.above);  // the smallest value
  int64_t hi = OrderedKey(all.largest) + 1;  // mass(hi) < target; hi - 1 is the largest value
  while (hi - lo > 1) {
    const Sweep s = SweepRow(v, w, n, FromOrderedKey(lo + (hi - lo + 1) / 2));
    if (s.mass >= target) {
      lo = OrderedKey(s.above);
    } else {
      hi = OrderedKey(s.below) + 1;
    }
  }
  return FromOrderedKey(lo);
}

ffi::Error LargestThresholdImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> values,
                                ffi::Buffer<ffi::F32> weights, ffi::Buffer<ffi::F32> target,
                                ffi::ResultBuffer<ffi::F32> out) {
  const auto vd = values.dimensions(), wd = weights.dimensions(), td = target.dimensions();
  if (vd.size() != 2 || wd.size() != 2 || td.size() != 1 || wd[0] != vd[0] ||
      wd[1] != vd[1] || td[0] != vd[0]) {
    return ffi::Error::InvalidArgument(
        "largest threshold: expected values [B, V], weights [B, V], target [B]");
  }
  const int64_t V = vd[1];
  const float *vp = values.typed_data(), *wp = weights.typed_data(), *tp = target.typed_data();
  float* op = out->typed_data();
  if (V == 0) return ffi::Error::InvalidArgument("largest threshold: empty rows");
  ParallelChunks(pool, vd[0], [=](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) op[b] = LargestThreshold(vp + b * V, wp + b * V, V, tp[b]);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EpgrpoLargestThreshold, LargestThresholdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

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
