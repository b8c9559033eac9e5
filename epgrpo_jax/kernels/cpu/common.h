// Helpers shared by the CPU kernels (cpu.cc, attention.cc): a vectorised exp for
// non-positive arguments, eight-lane float vectors, a register-blocked small matmul, and a
// loop over XLA's intra-op thread pool.

#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Cephes' polynomial for exp(r), |r| <= ln 2 / 2, on a float or on eight lanes.
template <typename T>
inline T ExpReduced(T r) {
  T p = T{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return p * r * r + r + 1.0f;
}

// exp(x) for x <= 0: Cephes' polynomial after a range reduction by ln 2, branch-free so
// that the loops calling it vectorize. Relative error about 2e-7; x below -87 gives about
// 1e-38 instead of 0 (masked slots are multiplied by 0 anyway).
inline float ExpNonPositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return ExpReduced(r) * scale;
}

using v8 = float __attribute__((vector_size(32)));

inline v8 Load(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void Store(float* p, v8 v) { std::memcpy(p, &v, sizeof v); }

using v8i = int32_t __attribute__((vector_size(32)));

// ExpNonPositive on eight lanes, the same arithmetic (floor as truncation, one less where
// that rounded up), for loops GCC does not vectorize on its own.
inline v8 ExpNonPositive(v8 x) {
  x = x < -87.0f ? v8{} - 87.0f : x;
  const v8 y = x * 1.44269504088896341f + 0.5f;
  const v8 t = __builtin_convertvector(__builtin_convertvector(y, v8i), v8);
  const v8 n = t > y ? t - 1.0f : t;
  const v8 r = x - n * 0.693359375f + n * 2.12194440e-4f;
  const v8i bits = (__builtin_convertvector(n, v8i) + 127) << 23;
  v8 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return ExpReduced(r) * scale;
}

using v8u = uint32_t __attribute__((vector_size(32)));
using v8h = uint16_t __attribute__((vector_size(16)));

// A bfloat16 is the upper half of a float32's bits.
inline float Widen(float x) { return x; }
inline float Widen(uint16_t x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

inline v8 Load(const uint16_t* p) {
  v8h h;
  std::memcpy(&h, p, sizeof h);
  const v8u bits = __builtin_convertvector(h, v8u) << 16;
  v8 v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

// c[g, :cols] (+)= a[g, :rows] @ b[:rows, :cols] for NG rows of a (lda, ldb, ldc: row
// strides). Blocks of 32 (then 8) columns of c stay in vector registers over all of `rows`,
// so b is streamed once and c is written once. b is float32 or bfloat16 (uint16_t).
template <int NG, typename T>
void MatMul(const float* a, int64_t lda, const T* b, int64_t ldb, int64_t rows,
            int64_t cols, float* c, int64_t ldc, bool accumulate) {
  auto put = [&](float* out, v8 value) { Store(out, accumulate ? Load(out) + value : value); };
  int64_t j = 0;
  for (; j + 32 <= cols; j += 32) {
    v8 acc[NG][4] = {};
    for (int64_t r = 0; r < rows; ++r) {
      const T* row = b + r * ldb + j;
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
      for (int64_t r = 0; r < rows; ++r) acc += a[g * lda + r] * Widen(b[r * ldb + j]);
      c[g * ldc + j] = accumulate ? c[g * ldc + j] + acc : acc;
    }
  }
}

// MatMul for all G queries, two at a time.
template <typename T>
void MatMulAll(int64_t G, const float* a, int64_t lda, const T* b, int64_t ldb, int64_t rows,
               int64_t cols, float* c, int64_t ldc, bool accumulate) {
  int64_t g = 0;
  for (; g + 2 <= G; g += 2)
    MatMul<2, T>(a + g * lda, lda, b, ldb, rows, cols, c + g * ldc, ldc, accumulate);
  for (; g < G; ++g) MatMul<1, T>(a + g * lda, lda, b, ldb, rows, cols, c + g * ldc, ldc, accumulate);
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
}  // namespace
