// CPU kernels as XLA FFI handlers: for the sampler, decode attention (EpgrpoDecodeAttention),
// the top-k / top-p thresholds (EpgrpoLargestThreshold) and the whole top-p draw
// (EpgrpoNucleusDraw); for the sampler and bf16
// training, a bf16 matmul on AMX tiles (EpgrpoPackedMatmul); for the float32 sampler, a
// float32 matmul on AVX-512 (EpgrpoPanelMatmul); for the bf16 sampler without AMX, a bf16
// matmul on AVX512-BF16 (EpgrpoPairMatmul). The matmuls are at the end of this file.
//
// Decode attention: one query token per row over a KV cache.
// Inputs: q [B, K, G, Hd] float32, keys [B, K, Hd, S] and values [B, K, S, Hd] both float32
// (EpgrpoDecodeAttention) or both bfloat16 (EpgrpoDecodeAttentionBf16: widened to float32
// as they are read; all arithmetic is float32), allowed [B, S] (pred), limit [] (int32:
// only slots [0, limit) are read).
// Attributes: share_rows, shared_slots: rows come in groups of share_rows consecutive rows
// whose keys and values in slots [0, shared_slots) are identical (the sampler's G copies of
// a prompt's cache); those slots are read from each group's first row only.
// Output: [B, K, G, Hd] = softmax(q . keys / sqrt(Hd), over allowed slots < limit) . values.
// A row with no allowed slot gets the mean of all S values, as the XLA path's finite mask
// gives. Both products keep blocks of 32 outputs per query in vector registers (GCC/Clang
// vector extensions), and the (row, KV head) pairs are shared out over XLA's intra-op
// thread pool: the loop is bound by memory, and one thread alone reached about half the
// bandwidth of two.

#include <limits>
#include <type_traits>
#include <vector>

#include "common.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

#if defined(__AVX512BF16__)
// 16 float32 sums of a matmul stored as they are, or rounded once to bf16 (nearest even).
inline void Put(float* out, __m512 c) { _mm512_storeu_ps(out, c); }
inline void Put(uint16_t* out, __m512 c) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                      reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(c)));
}
#endif

struct Shape {
  int64_t rows, kv_heads, groups, head_dim, slots, limit;
  int64_t share_rows, shared_slots;  // rows come in groups of share_rows sharing those slots
};

// scores[:, j0:j1] = q @ keys[:, j0:j1] (keys [Hd, S]; scores G x limit).
template <typename T>
void Scores(const Shape& s, const float* q, const T* keys, int64_t j0, int64_t j1,
            float* scores) {
  if (j1 > j0)
    MatMulAll(s.groups, q, s.head_dim, keys + j0, s.slots, s.head_dim, j1 - j0, scores + j0,
              s.limit, false);
}

// out += weights[:, j0:j1] @ values[j0:j1] (values [S, Hd]; out G x Hd).
template <typename T>
void Weighted(const Shape& s, const float* weights, const T* values, int64_t j0, int64_t j1,
              float* out) {
  if (j1 > j0)
    MatMulAll(s.groups, weights + j0, s.limit, values + j0 * s.head_dim, s.head_dim, j1 - j0,
              s.head_dim, out, s.head_dim, true);
}

// One (row, KV head). Slots below `shared` are read from `shared_keys` / `shared_values`
// (the first row of the row's group, identical there), the rest from the row's own cache.
// scores: G x limit scratch; inv_total: G scratch.
template <typename T>
void AttendOne(const Shape& s, const float* q, const T* keys, const T* values,
               const T* shared_keys, const T* shared_values, const bool* allowed,
               float* out, float* scores, float* inv_total) {
  const int64_t G = s.groups, H = s.head_dim, S = s.slots, L = s.limit;
  const int64_t shared = std::min(s.shared_slots, L);
  std::fill(out, out + G * H, 0.0f);
  int64_t count = 0;
  for (int64_t j = 0; j < L; ++j) count += allowed[j];
  if (count == 0) {
    for (int64_t j = 0; j < S; ++j)
      for (int64_t h = 0; h < H; ++h) out[h] += Widen(values[j * H + h]);
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


template <ffi::DataType KV>
ffi::Error DecodeAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                               ffi::Buffer<KV> keys, ffi::Buffer<KV> values,
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
  const float* qp = q.typed_data();
  const auto *kp = keys.typed_data(), *vp = values.typed_data();
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
// the row, each pass one vectorised sweep of the values still inside the bracket; masses are
// summed in double. Output [B].
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

// The values of v (and their weights) in [low, high], moved to the front of cv / cw (which
// may be v / w themselves); returns their count. Branch-free: every value is written, the
// end advances only past those kept.
inline int64_t Keep(const float* v, const float* w, int64_t n, float low, float high, float* cv,
                    float* cw) {
  int64_t m = 0;
  for (int64_t j = 0; j < n; ++j) {
    const float x = v[j], y = w[j];
    cv[m] = x;
    cw[m] = y;
    m += (x >= low) & (x <= high);
  }
  return m;
}

// The bisection keeps, besides the bracket [lo, hi) of keys, the values inside it (the
// candidates) and the mass of the values at or above hi: each pass sweeps only the
// candidates, which the bracket thins out, instead of the whole row. cv / cw: scratch of n.
// `first`, if finite, is the first pass's split instead of the bracket's middle (any value
// gives the same result; one near the answer thins the candidates out at once).
float LargestThreshold(const float* v, const float* w, int64_t n, float target, float* cv,
                       float* cw, float first = std::numeric_limits<float>::infinity()) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const Sweep all = SweepRow(v, w, n, -kInf);
  int64_t lo = OrderedKey(all.above);  // the smallest value
  int64_t hi = OrderedKey(all.largest) + 1;  // mass(hi) < target; hi - 1 is the largest value
  double above = 0.0;  // the mass of the values with keys >= hi
  const float *pv = v, *pw = w;
  int64_t m = n;
  bool guided = std::isfinite(first);
  while (hi - lo > 1) {
    int64_t split = lo + (hi - lo + 1) / 2;
    if (guided) split = std::clamp(OrderedKey(first), lo + 1, hi - 1);
    guided = false;
    const Sweep s = SweepRow(pv, pw, m, FromOrderedKey(split));
    if (above + s.mass >= target) {
      lo = OrderedKey(s.above);
    } else {
      hi = OrderedKey(s.below) + 1;
      above += s.mass;
    }
    m = Keep(pv, pw, m, FromOrderedKey(lo), FromOrderedKey(hi - 1), cv, cw);
    pv = cv;
    pw = cw;
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
    const std::unique_ptr<float[]> scratch(new float[2 * V]);  // written before it is read
    for (int64_t b = begin; b < end; ++b)
      op[b] = LargestThreshold(vp + b * V, wp + b * V, V, tp[b], scratch.get(), scratch.get() + V);
  });
  return ffi::Error::Success();
}


// ---------------------------------------------------------------------------------------
// Nucleus draw (EpgrpoNucleusDraw): `strategies.sample_step` with top-k off, one row of
// logits [B, V] float32 at a time, with u [B] uniform in [0, 1) and attributes temperature
// (> 0) and top_p. Per row: x = logits / temperature; lse = max + log(sum exp(x - max));
// p = exp(x - lse); entropy = -sum p (x - lse); tau = LargestThreshold(p, p, top_p) if top_p
// < 1, else 0; the token: the first j with p_j >= tau and p_j > 0 at which the running sum
// of those p exceeds u times their total (the last such j if none). Outputs: tokens [B]
// int32, log p(token) = x - lse and the entropy [B] float32. Five passes over a row in
// place of XLA's dozen single-threaded ones over the batch.
void NucleusRow(const float* logits, int64_t V, float temperature, float top_p, float u,
                float* x, float* p, float* cv, float* cw, int32_t* token, float* logp,
                float* entropy) {
  float top = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : top)
  for (int64_t j = 0; j < V; ++j) {
    x[j] = logits[j] / temperature;
    top = std::max(top, x[j]);
  }
  // Eight lanes of float32 sums over blocks of 1,024, the blocks' sums in float64.
  const int64_t vectors = V - V % 8;
  double total = 0.0, h = 0.0;
  for (int64_t j0 = 0; j0 < vectors; j0 += 1024) {
    v8 block = {};
    for (int64_t j = j0; j < std::min(vectors, j0 + 1024); j += 8)
      block += ExpNonPositive(Load(x + j) - top);
    for (int i = 0; i < 8; ++i) total += block[i];
  }
  for (int64_t j = vectors; j < V; ++j) total += ExpNonPositive(x[j] - top);
  const float lse = top + static_cast<float>(std::log(total));
  const v8 zero = {};
  for (int64_t j0 = 0; j0 < vectors; j0 += 1024) {
    v8 block = {};
    for (int64_t j = j0; j < std::min(vectors, j0 + 1024); j += 8) {
      v8 d = Load(x + j) - lse;
      d = d < zero ? d : zero;
      const v8 e = ExpNonPositive(d);
      Store(p + j, e);
      block -= e * d;
    }
    for (int i = 0; i < 8; ++i) h += block[i];
  }
  for (int64_t j = vectors; j < V; ++j) {
    const float d = std::min(x[j] - lse, 0.0f);
    p[j] = ExpNonPositive(d);
    h -= p[j] * d;
  }
  // Tokens below (1 - top_p) / V hold less than 1 - top_p of the mass together, so tau is at
  // least that (half of it, for rounding): the first split, past most of a peaked row.
  const float first = 0.5f * (1.0f - top_p) / static_cast<float>(V);
  const float tau = top_p < 1.0f ? LargestThreshold(p, p, V, top_p, cv, cw, first) : 0.0f;
  const double target = static_cast<double>(u) * SweepRow(p, p, V, tau).mass;
  double sum = 0.0;
  int64_t chosen = -1, last = -1;
  for (int64_t j = 0; j < V; ++j) {
    if (p[j] >= tau && p[j] > 0.0f) {
      sum += p[j];
      last = j;
      if (sum > target) {
        chosen = j;
        break;
      }
    }
  }
  if (chosen < 0) chosen = std::max<int64_t>(last, 0);
  *token = static_cast<int32_t>(chosen);
  *logp = x[chosen] - lse;
  *entropy = static_cast<float>(h);
}

ffi::Error NucleusDrawImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits,
                           ffi::Buffer<ffi::F32> uniform, ffi::ResultBuffer<ffi::S32> tokens,
                           ffi::ResultBuffer<ffi::F32> logp, ffi::ResultBuffer<ffi::F32> entropy,
                           float temperature, float top_p) {
  const auto ld = logits.dimensions(), ud = uniform.dimensions();
  if (ld.size() != 2 || ud.size() != 1 || ud[0] != ld[0] || ld[1] == 0 ||
      !(temperature > 0.0f)) {
    return ffi::Error::InvalidArgument(
        "nucleus draw: expected logits [B, V] (V > 0), uniform [B], temperature > 0");
  }
  const int64_t V = ld[1];
  const float *lp = logits.typed_data(), *up = uniform.typed_data();
  int32_t* tp = tokens->typed_data();
  float *gp = logp->typed_data(), *hp = entropy->typed_data();
  ParallelChunks(pool, ld[0], [=](int64_t begin, int64_t end) {
    const std::unique_ptr<float[]> scratch(new float[4 * V]);  // written before it is read
    float* s = scratch.get();
    for (int64_t b = begin; b < end; ++b)
      NucleusRow(lp + b * V, V, temperature, top_p, up[b], s, s + V, s + 2 * V, s + 3 * V,
                 tp + b, gp + b, hp + b);
  });
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------
// bf16 matmul on AMX (EpgrpoPackedMatmul, bf16 output, and EpgrpoPackedMatmulF32): x [M, K]
// bf16, M a multiple of 16, times a weight packed by `cpu.pack_bf16` into 16 x 32 bf16
// tiles [N/16, K/32, 16, 32]: row r of tile (n, c) holds, for each of the 16 columns
// 16n..16n+15, the pair w[32c + 2r], w[32c + 2r + 1] (the layout AMX's bf16 product reads).
// Output [M, N]: float32 accumulation, kept or rounded once to bf16 (nearest even). Blocks
// of 32 x 32 outputs; a pair of 16-column blocks' weights (K x 32) is read from memory once
// per task and stays in L2 across the task's rows.

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)

bool AmxReady() {  // the kernel must ask Linux for the tile registers' state, once
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                 18 /* XFEATURE_XTILEDATA */) == 0;
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t bytes_per_row[16];
  uint8_t rows[16];
};

// out[m0 : m0 + 16 * mt, 16 * n0 : 16 * (n0 + nt)] for mt, nt in {1, 2}. Tiles 0-3 hold
// the (row block, column block) sums, 4-5 the row blocks of x, 6-7 the weight blocks.
template <typename Out>
void PackedBlock(const uint16_t* x, const uint16_t* w, int64_t K, int64_t N, int64_t m0, int mt,
                 int64_t n0, int nt, Out* out) {
  const int64_t chunks = K / 32, stride = K * 2;
  const uint16_t *a0 = x + m0 * K, *a1 = a0 + 16 * K;
  const uint16_t *b0 = w + n0 * chunks * 512, *b1 = b0 + chunks * 512;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t c = 0; c < chunks; ++c) {
    _tile_loadd(4, a0 + 32 * c, stride);
    _tile_loadd(6, b0 + 512 * c, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (nt == 2) {
      _tile_loadd(7, b1 + 512 * c, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if (mt == 2) {
      _tile_loadd(5, a1 + 32 * c, stride);
      _tile_dpbf16ps(2, 5, 6);
      if (nt == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  alignas(64) float sums[4][256];
  _tile_stored(0, sums[0], 64);
  _tile_stored(1, sums[1], 64);
  _tile_stored(2, sums[2], 64);
  _tile_stored(3, sums[3], 64);
  for (int i = 0; i < mt; ++i)
    for (int j = 0; j < nt; ++j)
      for (int r = 0; r < 16; ++r)
        Put(out + (m0 + 16 * i + r) * N + 16 * (n0 + j), _mm512_loadu_ps(sums[2 * i + j] + 16 * r));
}

template <ffi::DataType OUT>
ffi::Error PackedMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x,
                            ffi::Buffer<ffi::BF16> w, ffi::ResultBuffer<OUT> out) {
  const auto xd = x.dimensions(), wd = w.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || wd.size() != 4 || od.size() != 2 || wd[2] != 16 || wd[3] != 32 ||
      xd[1] != 32 * wd[1] || xd[0] % 16 != 0 || od[0] != xd[0] || od[1] != 16 * wd[0]) {
    return ffi::Error::InvalidArgument(
        "packed matmul: expected x [M, K] (M a multiple of 16), w [N/16, K/32, 16, 32], "
        "out [M, N]");
  }
  if (!AmxReady()) return ffi::Error::Internal("packed matmul: no AMX tile state from Linux");
  const int64_t M = xd[0], K = xd[1], blocks = wd[0], N = 16 * blocks;
  const uint16_t *xp = x.typed_data(), *wp = w.typed_data();
  auto* op = out->typed_data();
  if (M == 0 || N == 0) return ffi::Error::Success();
  if (K == 0) {
    std::fill(op, op + M * N, 0);
    return ffi::Error::Success();
  }
  // Column pairs [p0, p1) times row pairs [r0, r1), in spans of `span` column pairs: each
  // span's weights (K x 32 span bf16) sweep the rows, then the next span.
  auto run = [=](int64_t p0, int64_t p1, int64_t r0, int64_t r1, int64_t span) {
    TileConfig config = {};
    config.palette = 1;
    for (int t = 0; t < 8; ++t) {
      config.bytes_per_row[t] = 64;
      config.rows[t] = 16;
    }
    _tile_loadconfig(&config);
    for (int64_t first = p0; first < p1; first += span)
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t pair = first; pair < std::min(first + span, p1); ++pair)
          PackedBlock(xp, wp, K, N, 32 * r, M - 32 * r >= 32 ? 2 : 1, 2 * pair,
                      std::min<int64_t>(2, blocks - 2 * pair), op);
    _tile_release();
  };
  const int64_t pairs = (blocks + 1) / 2, row_pairs = (M + 31) / 32;
  // Few rows (decoding): tasks split the columns, each reading its weights once. Many rows
  // (training): tasks split the rows (ParallelChunks makes 4 per thread) and sweep them
  // with spans of weights that fit in half of L2 (512 KiB).
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  if (row_pairs >= 16 * threads) {
    const int64_t span = std::max<int64_t>(1, (int64_t{1} << 19) / (K * 64));
    ParallelChunks(pool, row_pairs,
                   [=](int64_t r0, int64_t r1) { run(0, pairs, r0, r1, span); });
  } else {
    ParallelChunks(pool, pairs,
                   [=](int64_t p0, int64_t p1) { run(p0, p1, 0, row_pairs, 1); });
  }
  return ffi::Error::Success();
}

#else  // no AMX: the handlers exist and refuse

bool AmxReady() { return false; }

template <ffi::DataType OUT>
ffi::Error PackedMatmulImpl(ffi::ThreadPool, ffi::Buffer<ffi::BF16>, ffi::Buffer<ffi::BF16>,
                            ffi::ResultBuffer<OUT>) {
  return ffi::Error::Internal("packed matmul: built without AMX (see cpu.amx_available)");
}

#endif

// ---------------------------------------------------------------------------------------
// float32 matmul on AVX-512 (EpgrpoPanelMatmul): x [M, K] float32 times a weight packed by
// `cpu.pack_panels` into panels of 32 columns [N/32, K, 32] (panel p, row k holds
// w[k, 32p .. 32p + 31], contiguous, so a panel streams from memory in one sweep). Output
// [M, N] float32, each sum accumulated over k in order. Blocks of 8 rows x 32 columns live
// in 16 vector registers; a panel (K x 128 bytes) stays in L2 while the rows sweep it.

#if defined(__AVX512F__)

// Rows [m0, m1) times panels [p0, p1), in blocks of up to 8 rows: `block.Run<R>(m, p)`
// computes rows [m, m + R) times panel p.
template <class Block>
void SweepPanels(const Block& block, int64_t m0, int64_t m1, int64_t p0, int64_t p1) {
  for (int64_t p = p0; p < p1; ++p) {
    int64_t m = m0;
    for (; m + 8 <= m1; m += 8) block.template Run<8>(m, p);
    switch (m1 - m) {
      case 7: block.template Run<7>(m, p); break;
      case 6: block.template Run<6>(m, p); break;
      case 5: block.template Run<5>(m, p); break;
      case 4: block.template Run<4>(m, p); break;
      case 3: block.template Run<3>(m, p); break;
      case 2: block.template Run<2>(m, p); break;
      case 1: block.template Run<1>(m, p); break;
      default: break;
    }
  }
}

// Few rows (decoding): tasks split the panels, each read from memory once. Many rows: tasks
// split the rows in blocks of 8 and sweep spans of panels that fit in 512 KiB.
template <class Block>
void SharePanels(ffi::ThreadPool& pool, int64_t M, int64_t panels, int64_t panel_bytes,
                 Block block) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads()), row_blocks = (M + 7) / 8;
  if (row_blocks >= 16 * threads) {
    const int64_t span = std::max<int64_t>(1, (int64_t{1} << 19) / std::max<int64_t>(1, panel_bytes));
    ParallelChunks(pool, row_blocks, [=](int64_t r0, int64_t r1) {
      for (int64_t p = 0; p < panels; p += span)
        SweepPanels(block, 8 * r0, std::min(M, 8 * r1), p, std::min(panels, p + span));
    });
  } else {
    ParallelChunks(pool, panels, [=](int64_t p0, int64_t p1) { SweepPanels(block, 0, M, p0, p1); });
  }
}

struct PanelBlock {
  const float *x, *w;
  int64_t K, N;
  float* out;

  template <int R>
  void Run(int64_t m, int64_t p) const {
    const float *panel = w + p * K * 32, *xr = x + m * K;
    __m512 lo[R], hi[R];
    for (int i = 0; i < R; ++i) lo[i] = hi[i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; ++k) {
      const __m512 b0 = _mm512_loadu_ps(panel + 32 * k), b1 = _mm512_loadu_ps(panel + 32 * k + 16);
      for (int i = 0; i < R; ++i) {
        const __m512 a = _mm512_set1_ps(xr[i * K + k]);
        lo[i] = _mm512_fmadd_ps(a, b0, lo[i]);
        hi[i] = _mm512_fmadd_ps(a, b1, hi[i]);
      }
    }
    float* o = out + m * N + 32 * p;
    for (int i = 0; i < R; ++i) {
      _mm512_storeu_ps(o + i * N, lo[i]);
      _mm512_storeu_ps(o + i * N + 16, hi[i]);
    }
  }
};

ffi::Error PanelMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                           ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions(), wd = w.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || od.size() != 2 || wd[2] != 32 || xd[1] != wd[1] ||
      od[0] != xd[0] || od[1] != 32 * wd[0]) {
    return ffi::Error::InvalidArgument(
        "panel matmul: expected x [M, K], w [N/32, K, 32], out [M, N]");
  }
  const int64_t M = xd[0], K = xd[1], panels = wd[0], N = 32 * panels;
  SharePanels(pool, M, panels, K * 128, PanelBlock{x.typed_data(), w.typed_data(), K, N,
                                                   out->typed_data()});
  return ffi::Error::Success();
}

// EpgrpoPackPanels: the weights [K, N_i] of a projection group, concatenated over columns
// (N = sum N_i, a multiple of 32) and packed as above, [N / 32, K, 32], in one pass. Tasks
// take blocks of 16 panels and copy them row by row: each row of a block is up to 2 KiB
// read in order from the weights, written to 16 panels.
ffi::Error PackPanelsImpl(ffi::ThreadPool pool, ffi::RemainingArgs weights,
                          ffi::ResultBuffer<ffi::F32> out) {
  const auto od = out->dimensions();
  const auto invalid = ffi::Error::InvalidArgument(
      "pack panels: expected weights [K, N_i] and out [sum N_i / 32, K, 32]");
  if (od.size() != 3 || od[2] != 32) return invalid;
  struct Part { const float* data; int64_t columns, first; };  // first: its first column
  std::vector<Part> parts;
  int64_t columns = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    auto w = weights.get<ffi::Buffer<ffi::F32>>(i);
    if (w.has_error()) return invalid;
    const auto wd = w->dimensions();
    if (wd.size() != 2 || wd[0] != od[1]) return invalid;
    parts.push_back({w->typed_data(), wd[1], columns});
    columns += wd[1];
  }
  if (columns != 32 * od[0]) return invalid;
  const int64_t K = od[1], panels = od[0];
  float* op = out->typed_data();
  ParallelChunks(pool, (panels + 15) / 16, [=, &parts](int64_t b0, int64_t b1) {
    for (int64_t p0 = 16 * b0; p0 < std::min(panels, 16 * b1); p0 += 16) {
      const int64_t p1 = std::min(panels, p0 + 16);
      for (const Part& part : parts) {
        // This part's columns within the block's, [c0, c1), copied panel by panel.
        const int64_t c0 = std::max(32 * p0, part.first);
        const int64_t c1 = std::min(32 * p1, part.first + part.columns);
        for (int64_t k = 0; k < K; ++k)
          for (int64_t c = c0; c < c1;) {
            const int64_t p = c / 32, n = std::min(c1, 32 * (p + 1)) - c;
            std::memcpy(op + (p * K + k) * 32 + c % 32,
                        part.data + k * part.columns + (c - part.first), n * sizeof(float));
            c += n;
          }
      }
    }
  });
  return ffi::Error::Success();
}

#else  // no AVX-512: the handler exists and refuses

ffi::Error PanelMatmulImpl(ffi::ThreadPool, ffi::Buffer<ffi::F32>, ffi::Buffer<ffi::F32>,
                           ffi::ResultBuffer<ffi::F32>) {
  return ffi::Error::Internal("panel matmul: built without AVX-512 (see cpu.panels_available)");
}

ffi::Error PackPanelsImpl(ffi::ThreadPool, ffi::RemainingArgs, ffi::ResultBuffer<ffi::F32>) {
  return ffi::Error::Internal("pack panels: built without AVX-512 (see cpu.panels_available)");
}

#endif

// ---------------------------------------------------------------------------------------
// bf16 matmul on AVX512-BF16 (EpgrpoPairMatmul, bf16 output, and EpgrpoPairMatmulF32), for
// CPUs without AMX: the operands of EpgrpoPackedMatmul (x [M, K] bf16, a weight packed by
// `cpu.pack_bf16`), any M. In that layout a block of 16 columns holds, for each pair of
// rows (2j, 2j + 1), the 16 columns' pairs in 64 contiguous bytes: one operand of
// vdpbf16ps, which adds x[2j] w[2j] + x[2j + 1] w[2j + 1] to 16 float32 sums. Blocks of 8
// rows x 32 columns (two column blocks, a panel) live in 16 vector registers; output kept
// or rounded once to bf16. Rows and panels are shared out as in EpgrpoPanelMatmul.

#if defined(__AVX512BF16__)

template <typename Out>
struct PairBlock {
  const uint16_t *x, *w;
  int64_t K, N, blocks;
  Out* out;

  template <int R>
  void Run(int64_t m, int64_t p) const {
    if (2 * p + 1 < blocks) {
      Columns<R, 2>(m, p);
    } else {
      Columns<R, 1>(m, p);
    }
  }

  // Rows [m, m + R) times column blocks 2p .. 2p + C - 1 (block n at n K 16 in w).
  template <int R, int C>
  void Columns(int64_t m, int64_t p) const {
    const uint16_t *b = w + 2 * p * K * 16, *xr = x + m * K;
    __m512 acc[R][C];
    for (int i = 0; i < R; ++i)
      for (int c = 0; c < C; ++c) acc[i][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < K / 2; ++j) {
      __m512bh bj[C];
      for (int c = 0; c < C; ++c)
        bj[c] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b + c * K * 16 + 32 * j));
      for (int i = 0; i < R; ++i) {
        uint32_t pair;  // x[m + i, 2j] and x[m + i, 2j + 1]
        std::memcpy(&pair, xr + i * K + 2 * j, sizeof pair);
        const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(pair)));
        for (int c = 0; c < C; ++c) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], a, bj[c]);
      }
    }
    for (int i = 0; i < R; ++i)
      for (int c = 0; c < C; ++c) Put(out + (m + i) * N + 16 * (2 * p + c), acc[i][c]);
  }
};

template <ffi::DataType OUT>
ffi::Error PairMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x,
                          ffi::Buffer<ffi::BF16> w, ffi::ResultBuffer<OUT> out) {
  const auto xd = x.dimensions(), wd = w.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || wd.size() != 4 || od.size() != 2 || wd[2] != 16 || wd[3] != 32 ||
      xd[1] != 32 * wd[1] || od[0] != xd[0] || od[1] != 16 * wd[0]) {
    return ffi::Error::InvalidArgument(
        "pair matmul: expected x [M, K], w [N/16, K/32, 16, 32], out [M, N]");
  }
  const int64_t M = xd[0], K = xd[1], blocks = wd[0];
  auto* op = out->typed_data();
  using Out = std::remove_pointer_t<decltype(op)>;
  SharePanels(pool, M, (blocks + 1) / 2, K * 64,
              PairBlock<Out>{x.typed_data(), w.typed_data(), K, 16 * blocks, blocks, op});
  return ffi::Error::Success();
}

#else  // no AVX512-BF16: the handlers exist and refuse

template <ffi::DataType OUT>
ffi::Error PairMatmulImpl(ffi::ThreadPool, ffi::Buffer<ffi::BF16>, ffi::Buffer<ffi::BF16>,
                          ffi::ResultBuffer<OUT>) {
  return ffi::Error::Internal("pair matmul: built without AVX512-BF16 (see cpu.pairs_available)");
}

#endif

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EpgrpoLargestThreshold, LargestThresholdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(EpgrpoNucleusDraw, NucleusDrawImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("temperature")
                                  .Attr<float>("top_p"));

#define EPGRPO_DECODE_ATTENTION(NAME, KV)                              \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(NAME, DecodeAttentionImpl<KV>,         \
                                ffi::Ffi::Bind()                       \
                                    .Ctx<ffi::ThreadPool>()            \
                                    .Arg<ffi::Buffer<ffi::F32>>()      \
                                    .Arg<ffi::Buffer<KV>>()            \
                                    .Arg<ffi::Buffer<KV>>()            \
                                    .Arg<ffi::Buffer<ffi::PRED>>()     \
                                    .Arg<ffi::Buffer<ffi::S32>>()      \
                                    .Ret<ffi::Buffer<ffi::F32>>()      \
                                    .Attr<int64_t>("share_rows")       \
                                    .Attr<int64_t>("shared_slots"));

EPGRPO_DECODE_ATTENTION(EpgrpoDecodeAttention, ffi::F32)
EPGRPO_DECODE_ATTENTION(EpgrpoDecodeAttentionBf16, ffi::BF16)

#define EPGRPO_MATMUL(NAME, IMPL, IN, OUT)                            \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(NAME, IMPL,                           \
                                ffi::Ffi::Bind()                      \
                                    .Ctx<ffi::ThreadPool>()           \
                                    .Arg<ffi::Buffer<IN>>()           \
                                    .Arg<ffi::Buffer<IN>>()           \
                                    .Ret<ffi::Buffer<OUT>>());

EPGRPO_MATMUL(EpgrpoPackedMatmul, PackedMatmulImpl<ffi::BF16>, ffi::BF16, ffi::BF16)
EPGRPO_MATMUL(EpgrpoPackedMatmulF32, PackedMatmulImpl<ffi::F32>, ffi::BF16, ffi::F32)
EPGRPO_MATMUL(EpgrpoPairMatmul, PairMatmulImpl<ffi::BF16>, ffi::BF16, ffi::BF16)
EPGRPO_MATMUL(EpgrpoPairMatmulF32, PairMatmulImpl<ffi::F32>, ffi::BF16, ffi::F32)
EPGRPO_MATMUL(EpgrpoPanelMatmul, PanelMatmulImpl, ffi::F32, ffi::F32)

XLA_FFI_DEFINE_HANDLER_SYMBOL(EpgrpoPackPanels, PackPanelsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// 1 if the panel matmul can run here (built with AVX-512).
extern "C" int EpgrpoPanelsReady() {
#if defined(__AVX512F__)
  return 1;
#else
  return 0;
#endif
}

// 1 if the pair matmul can run here (built with AVX512-BF16).
extern "C" int EpgrpoPairsReady() {
#if defined(__AVX512BF16__)
  return 1;
#else
  return 0;
#endif
}

// 1 if the packed matmul can run here (built with AMX, and Linux grants the tile state).
extern "C" int EpgrpoAmxReady() { return AmxReady() ? 1 : 0; }
