// The MLP's gated activation, float32: EpgrpoSwiglu h = silu(gate) * up, and its backward
// EpgrpoSwigluGrad. The input is the gate/up product as one array y [M, 2F] (gate = y[:, :F],
// up = y[:, F:]), so neither half is copied out, and the backward writes dy [M, 2F] in that
// layout, so no concatenation follows. Rows are shared out over XLA's intra-op threads.
// silu(g) = g s, s = sigmoid(g) = 1 / (1 + exp(-g)), from e = exp(-|g|) (no overflow).

#include <vector>

#include "common.h"

namespace {

// s = sigmoid(g) for a row's F gates, eight lanes at a time.
inline void Sigmoid(const float* g, int64_t F, float* s) {
  int64_t j = 0;
  for (; j + 8 <= F; j += 8) {
    const v8 x = Load(g + j);
    const v8 e = ExpNonPositive(x < 0.0f ? x : -x);
    Store(s + j, (x >= 0.0f ? v8{} + 1.0f : e) / (1.0f + e));
  }
  for (; j < F; ++j) {
    const float e = ExpNonPositive(-std::abs(g[j]));
    s[j] = (g[j] >= 0.0f ? 1.0f : e) / (1.0f + e);
  }
}

ffi::Error Check(ffi::Buffer<ffi::F32>& y, int64_t& M, int64_t& F) {
  const auto yd = y.dimensions();
  if (yd.size() != 2 || yd[1] % 2 != 0)
    return ffi::Error::InvalidArgument("swiglu: expected y [M, 2F]");
  M = yd[0];
  F = yd[1] / 2;
  return ffi::Error::Success();
}

ffi::Error SwigluImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> y,
                      ffi::ResultBuffer<ffi::F32> h) {
  int64_t M, F;
  if (auto e = Check(y, M, F); e.failure()) return e;
  const float* yp = y.typed_data();
  float* hp = h->typed_data();
  ParallelChunks(pool, M, [=](int64_t begin, int64_t end) {
    std::vector<float> s(F);
    for (int64_t m = begin; m < end; ++m) {
      const float *g = yp + m * 2 * F, *u = g + F;
      float* out = hp + m * F;
      Sigmoid(g, F, s.data());
#pragma omp simd
      for (int64_t j = 0; j < F; ++j) out[j] = g[j] * s[j] * u[j];
    }
  });
  return ffi::Error::Success();
}

// d gate = dh up s (1 + g (1 - s)),  d up = dh g s.
ffi::Error SwigluGradImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> y,
                          ffi::Buffer<ffi::F32> dh, ffi::ResultBuffer<ffi::F32> dy) {
  int64_t M, F;
  if (auto e = Check(y, M, F); e.failure()) return e;
  if (dh.element_count() != M * F) return ffi::Error::InvalidArgument("swiglu grad: dh [M, F]");
  const float *yp = y.typed_data(), *dhp = dh.typed_data();
  float* dyp = dy->typed_data();
  ParallelChunks(pool, M, [=](int64_t begin, int64_t end) {
    std::vector<float> s(F);
    for (int64_t m = begin; m < end; ++m) {
      const float *g = yp + m * 2 * F, *u = g + F, *d = dhp + m * F;
      float *dg = dyp + m * 2 * F, *du = dg + F;
      Sigmoid(g, F, s.data());
#pragma omp simd
      for (int64_t j = 0; j < F; ++j) {
        dg[j] = d[j] * u[j] * s[j] * (1.0f + g[j] * (1.0f - s[j]));
        du[j] = d[j] * g[j] * s[j];
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EpgrpoSwiglu, SwigluImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(EpgrpoSwigluGrad, SwigluGradImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
