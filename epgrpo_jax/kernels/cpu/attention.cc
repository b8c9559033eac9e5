// Causal self-attention without a cache (training, scoring and reference passes), float32,
// forward (EpgrpoCausalAttention) and backward (EpgrpoCausalAttentionGrad).
//
// Inputs keep the projections' layout, so no transposes surround the call:
//   q [B, T, K, G, Hd], k [B, T, K, Hd], v [B, T, K, Hd], valid [B, T] (pred),
//   segments [B, T] (s32).
// Query t sees slot s iff s <= t, valid[b, s] and segments[b, s] == segments[b, t].
// Forward: out [B, T, K, G, Hd] = softmax(q . k / sqrt(Hd)) . v over the visible slots, and
// lse [B, T, K, G], the log of the softmax's denominator (its max added back). A query with
// no visible slot gets out 0 and lse +inf, so it passes no gradient back.
// Backward: from q, k, v, valid, segments, out, lse and dout [B, T, K, G, Hd]: dq, dk, dv in
// the inputs' shapes (flash-style: probabilities recomputed from lse).
//
// Each (b, KV head) is one task on XLA's thread pool. Its keys and values are copied as
// [T, Hd] rows and [Hd, T] columns; queries run in blocks of 16 (times G heads), whose
// scores reach only up to the block's last query: the causal upper half is skipped.

#include <limits>
#include <vector>

#include "common.h"

namespace {

constexpr int64_t kQueryBlock = 16;

struct Dims {
  int64_t B, T, K, G, H;
  int64_t q_stride() const { return K * G * H; }   // between queries t, t + 1
  int64_t kv_stride() const { return K * H; }      // between slots s, s + 1
};

// c[r, :cols] (+)= a[r, :rows] @ b[:rows, :cols] for R rows of a, four at a time.
void MatMulRows(int64_t R, const float* a, int64_t lda, const float* b, int64_t ldb,
                int64_t rows, int64_t cols, float* c, int64_t ldc, bool accumulate) {
  int64_t r = 0;
  for (; r + 4 <= R; r += 4)
    MatMul<4, float>(a + r * lda, lda, b, ldb, rows, cols, c + r * ldc, ldc, accumulate);
  for (; r < R; ++r)
    MatMul<1, float>(a + r * lda, lda, b, ldb, rows, cols, c + r * ldc, ldc, accumulate);
}

// rows_TxH[t, h] and cols_HxT[h, t] = src[t * stride + h] for t < T, h < H (either may be
// empty: not written).
void CopySlots(const float* src, int64_t stride, int64_t T, int64_t H,
               std::vector<float>& rows_TxH, std::vector<float>& cols_HxT) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      const float x = src[t * stride + h];
      if (!rows_TxH.empty()) rows_TxH[t * H + h] = x;
      if (!cols_HxT.empty()) cols_HxT[h * T + t] = x;
    }
}

// The rows of queries [t0, t1) (G heads each) of one KV head, [R, H] contiguous.
void CopyQueries(const Dims& d, const float* src, int64_t t0, int64_t t1, float* dst) {
  const int64_t width = d.G * d.H;
  for (int64_t t = t0; t < t1; ++t)
    std::memcpy(dst + (t - t0) * width, src + t * d.q_stride(), width * sizeof(float));
}

void ScatterQueries(const Dims& d, const float* src, int64_t t0, int64_t t1, float* dst) {
  const int64_t width = d.G * d.H;
  for (int64_t t = t0; t < t1; ++t)
    std::memcpy(dst + t * d.q_stride(), src + (t - t0) * width, width * sizeof(float));
}

// One (b, KV head): where its slots may be seen from, and its keys and values in the
// layouts a pass reads: the forward keys as columns and values as rows, the backward keys
// both ways and values as columns (the others stay empty).
struct Slots {
  const bool* valid;
  const int32_t* segments;
  std::vector<float> k_TxH, kT_HxT, v_TxH, vT_HxT;

  Slots(const Dims& d, const bool* valid_b, const int32_t* segments_b, const float* k,
        const float* v, bool backward)
      : valid(valid_b), segments(segments_b), k_TxH(backward ? d.T * d.H : 0),
        kT_HxT(d.T * d.H), v_TxH(backward ? 0 : d.T * d.H), vT_HxT(backward ? d.T * d.H : 0) {
    CopySlots(k, d.kv_stride(), d.T, d.H, k_TxH, kT_HxT);
    CopySlots(v, d.kv_stride(), d.T, d.H, v_TxH, vT_HxT);
  }

  // visible[s] = 1 where query t sees slot s, else 0, for s < L.
  void Visible(int64_t t, int64_t L, float* visible) const {
    const int32_t segment = segments[t];
#pragma omp simd
    for (int64_t s = 0; s < L; ++s)
      visible[s] = static_cast<float>(s <= t && valid[s] && segments[s] == segment);
  }
};

// scores[r, :L] = q_blk[r] . k[:L] / sqrt(H) for the block's rows, L = t1.
void BlockScores(const Dims& d, const Slots& slots, const float* q_blk, int64_t rows,
                 int64_t L, float* scores) {
  MatMulRows(rows, q_blk, d.H, slots.kT_HxT.data(), d.T, d.H, L, scores, L, false);
  const float root = std::sqrt(static_cast<float>(d.H));
  for (int64_t i = 0; i < rows * L; ++i) scores[i] /= root;
}

// Forward of one (b, KV head).
void AttendTask(const Dims& d, const Slots& slots, const float* q, float* out, float* lse) {
  const int64_t G = d.G, H = d.H;
  std::vector<float> q_blk(kQueryBlock * G * H), p(kQueryBlock * G * d.T), o(kQueryBlock * G * H);
  std::vector<float> visible(d.T);
  for (int64_t t0 = 0; t0 < d.T; t0 += kQueryBlock) {
    const int64_t t1 = std::min(d.T, t0 + kQueryBlock), rows = (t1 - t0) * G, L = t1;
    CopyQueries(d, q, t0, t1, q_blk.data());
    BlockScores(d, slots, q_blk.data(), rows, L, p.data());
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t t = t0 + r / G;
      if (r % G == 0) slots.Visible(t, L, visible.data());
      const float* vis = visible.data();
      float* row = p.data() + r * L;
      float m = -3.0e38f;
#pragma omp simd reduction(max : m)
      for (int64_t s = 0; s < L; ++s) m = std::max(m, vis[s] > 0.0f ? row[s] : -3.0e38f);
      float* row_lse = lse + t * d.K * G + r % G;
      if (m == -3.0e38f) {  // sees nothing
        std::fill(row, row + L, 0.0f);
        *row_lse = std::numeric_limits<float>::infinity();
        continue;
      }
      float total = 0.0f;
#pragma omp simd reduction(+ : total)
      for (int64_t s = 0; s < L; ++s) {
        row[s] = ExpNonPositive(std::min(row[s] - m, 0.0f)) * vis[s];
        total += row[s];
      }
      const float inv = 1.0f / total;
#pragma omp simd
      for (int64_t s = 0; s < L; ++s) row[s] *= inv;
      *row_lse = m + std::log(total);
    }
    MatMulRows(rows, p.data(), L, slots.v_TxH.data(), H, L, H, o.data(), H, false);
    ScatterQueries(d, o.data(), t0, t1, out);
  }
}

// Backward of one (b, KV head): dq for its queries, dk and dv ([T, H] rows) for its slots.
void AttendGradTask(const Dims& d, const Slots& slots, const float* q, const float* out,
                    const float* lse, const float* dout, float* dq, float* dk_TxH,
                    float* dv_TxH) {
  const int64_t G = d.G, H = d.H, R = kQueryBlock * G;
  std::vector<float> q_blk(R * H), o_blk(R * H), do_blk(R * H), dq_blk(R * H), delta(R);
  std::vector<float> p(R * d.T), ds(R * d.T), pT(d.T * R), dsT(d.T * R), visible(d.T);
  const float root = std::sqrt(static_cast<float>(H));
  std::fill(dk_TxH, dk_TxH + d.T * H, 0.0f);
  std::fill(dv_TxH, dv_TxH + d.T * H, 0.0f);
  for (int64_t t0 = 0; t0 < d.T; t0 += kQueryBlock) {
    const int64_t t1 = std::min(d.T, t0 + kQueryBlock), rows = (t1 - t0) * G, L = t1;
    CopyQueries(d, q, t0, t1, q_blk.data());
    CopyQueries(d, out, t0, t1, o_blk.data());
    CopyQueries(d, dout, t0, t1, do_blk.data());
    for (int64_t r = 0; r < rows; ++r) {
      float acc = 0.0f;
      for (int64_t h = 0; h < H; ++h) acc += do_blk[r * H + h] * o_blk[r * H + h];
      delta[r] = acc;
    }
    BlockScores(d, slots, q_blk.data(), rows, L, p.data());
    // dP = dout . v over the slots, into ds.
    MatMulRows(rows, do_blk.data(), H, slots.vT_HxT.data(), d.T, H, L, ds.data(), L, false);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t t = t0 + r / G;
      if (r % G == 0) slots.Visible(t, L, visible.data());
      const float *vis = visible.data(), row_lse = lse[t * d.K * G + r % G], dr_r = delta[r];
      float *pr = p.data() + r * L, *dr = ds.data() + r * L;
#pragma omp simd
      for (int64_t s = 0; s < L; ++s) {
        // A query that sees nothing has lse +inf: its p is 0 (vis is 0 too).
        pr[s] = ExpNonPositive(std::min(pr[s] - row_lse, 0.0f)) * vis[s];
        dr[s] = pr[s] * (dr[s] - dr_r) / root;
      }
      for (int64_t s = 0; s < L; ++s) {
        pT[s * rows + r] = pr[s];
        dsT[s * rows + r] = dr[s];
      }
    }
    MatMulRows(rows, ds.data(), L, slots.k_TxH.data(), H, L, H, dq_blk.data(), H, false);
    ScatterQueries(d, dq_blk.data(), t0, t1, dq);
    MatMulRows(L, dsT.data(), rows, q_blk.data(), H, rows, H, dk_TxH, H, true);
    MatMulRows(L, pT.data(), rows, do_blk.data(), H, rows, H, dv_TxH, H, true);
  }
}

// The inputs both handlers take, their shapes checked (`Gather`).
struct Inputs {
  Dims d;
  const float *q, *k, *v;
  const bool* valid;
  const int32_t* segments;

  // Offsets of one (b, KV head) in q-shaped, k-shaped and lse-shaped arrays.
  int64_t QOffset(int64_t b, int64_t kh) const { return (b * d.T * d.K + kh) * d.G * d.H; }
  int64_t KvOffset(int64_t b, int64_t kh) const { return (b * d.T * d.K + kh) * d.H; }
  int64_t LseOffset(int64_t b, int64_t kh) const { return (b * d.T * d.K + kh) * d.G; }

  Slots SlotsOf(int64_t b, int64_t kh, bool backward) const {
    const int64_t o = KvOffset(b, kh);
    return Slots(d, valid + b * d.T, segments + b * d.T, k + o, v + o, backward);
  }
};

ffi::Error Gather(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                  ffi::Buffer<ffi::PRED> valid, ffi::Buffer<ffi::S32> segments, Inputs& in) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(),
             ad = valid.dimensions(), sd = segments.dimensions();
  if (qd.size() != 5 || kd.size() != 4 || vd.size() != 4 || ad.size() != 2 || sd.size() != 2 ||
      kd[0] != qd[0] || kd[1] != qd[1] || kd[2] != qd[2] || kd[3] != qd[4] ||
      !std::equal(kd.begin(), kd.end(), vd.begin()) || ad[0] != qd[0] || ad[1] != qd[1] ||
      sd[0] != qd[0] || sd[1] != qd[1]) {
    return ffi::Error::InvalidArgument(
        "causal attention: expected q [B, T, K, G, Hd], k and v [B, T, K, Hd], valid and "
        "segments [B, T]");
  }
  in = Inputs{Dims{qd[0], qd[1], qd[2], qd[3], qd[4]}, q.typed_data(), k.typed_data(),
              v.typed_data(), valid.typed_data(), segments.typed_data()};
  return ffi::Error::Success();
}

ffi::Error CausalAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                               ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                               ffi::Buffer<ffi::PRED> valid, ffi::Buffer<ffi::S32> segments,
                               ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> lse) {
  Inputs in;
  if (auto e = Gather(q, k, v, valid, segments, in); e.failure()) return e;
  float *op = out->typed_data(), *lp = lse->typed_data();
  ParallelChunks(pool, in.d.B * in.d.K, [=](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t b = u / in.d.K, kh = u % in.d.K, qo = in.QOffset(b, kh);
      AttendTask(in.d, in.SlotsOf(b, kh, false), in.q + qo, op + qo, lp + in.LseOffset(b, kh));
    }
  });
  return ffi::Error::Success();
}

ffi::Error CausalAttentionGradImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                                   ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                                   ffi::Buffer<ffi::PRED> valid, ffi::Buffer<ffi::S32> segments,
                                   ffi::Buffer<ffi::F32> out, ffi::Buffer<ffi::F32> lse,
                                   ffi::Buffer<ffi::F32> dout, ffi::ResultBuffer<ffi::F32> dq,
                                   ffi::ResultBuffer<ffi::F32> dk, ffi::ResultBuffer<ffi::F32> dv) {
  Inputs in;
  if (auto e = Gather(q, k, v, valid, segments, in); e.failure()) return e;
  const Dims d = in.d;
  if (out.element_count() != q.element_count() || dout.element_count() != q.element_count() ||
      lse.element_count() != d.B * d.T * d.K * d.G) {
    return ffi::Error::InvalidArgument(
        "causal attention grad: out and dout must have q's shape, lse [B, T, K, G]");
  }
  const float *op = out.typed_data(), *lp = lse.typed_data(), *dop = dout.typed_data();
  float *dqp = dq->typed_data(), *dkp = dk->typed_data(), *dvp = dv->typed_data();
  ParallelChunks(pool, d.B * d.K, [=](int64_t begin, int64_t end) {
    std::vector<float> dk_TxH(d.T * d.H), dv_TxH(d.T * d.H);
    for (int64_t u = begin; u < end; ++u) {
      const int64_t b = u / d.K, kh = u % d.K, qo = in.QOffset(b, kh), kv = in.KvOffset(b, kh);
      AttendGradTask(d, in.SlotsOf(b, kh, true), in.q + qo, op + qo, lp + in.LseOffset(b, kh),
                     dop + qo, dqp + qo, dk_TxH.data(), dv_TxH.data());
      for (int64_t t = 0; t < d.T; ++t) {
        std::memcpy(dkp + kv + t * d.kv_stride(), dk_TxH.data() + t * d.H, d.H * sizeof(float));
        std::memcpy(dvp + kv + t * d.kv_stride(), dv_TxH.data() + t * d.H, d.H * sizeof(float));
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace

// q, k, v, valid, segments: the inputs both handlers take.
#define EPGRPO_ATTENTION_INPUTS(BIND)    \
  BIND.Ctx<ffi::ThreadPool>()            \
      .Arg<ffi::Buffer<ffi::F32>>()      \
      .Arg<ffi::Buffer<ffi::F32>>()      \
      .Arg<ffi::Buffer<ffi::F32>>()      \
      .Arg<ffi::Buffer<ffi::PRED>>()     \
      .Arg<ffi::Buffer<ffi::S32>>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(EpgrpoCausalAttention, CausalAttentionImpl,
                              EPGRPO_ATTENTION_INPUTS(ffi::Ffi::Bind())
                                  .Ret<ffi::Buffer<ffi::F32>>()    // out
                                  .Ret<ffi::Buffer<ffi::F32>>());  // lse

XLA_FFI_DEFINE_HANDLER_SYMBOL(EpgrpoCausalAttentionGrad, CausalAttentionGradImpl,
                              EPGRPO_ATTENTION_INPUTS(ffi::Ffi::Bind())
                                  .Arg<ffi::Buffer<ffi::F32>>()    // out
                                  .Arg<ffi::Buffer<ffi::F32>>()    // lse
                                  .Arg<ffi::Buffer<ffi::F32>>()    // dout
                                  .Ret<ffi::Buffer<ffi::F32>>()    // dq
                                  .Ret<ffi::Buffer<ffi::F32>>()    // dk
                                  .Ret<ffi::Buffer<ffi::F32>>());  // dv
