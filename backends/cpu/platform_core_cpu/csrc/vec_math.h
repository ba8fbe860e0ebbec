// 16-lane fp32 vector helpers on GCC/Clang vector extensions: portable source that compiles to
// AVX-512 (or two AVX2 / four NEON registers) with accumulators kept in registers. Buffers these
// read are padded to a multiple of kLanes floats.
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace platform_core_cpu {

constexpr int64_t kLanes = 16;

typedef float vec16 __attribute__((vector_size(64)));
typedef int32_t ivec16 __attribute__((vector_size(64)));
typedef float vec8 __attribute__((vector_size(32)));
typedef float vec4 __attribute__((vector_size(16)));

inline vec16 load16(const float* p) {
  vec16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store16(float* p, vec16 v) { std::memcpy(p, &v, sizeof v); }

inline vec16 splat(float x) { return vec16{} + x; }

template <typename V>
inline V vmax(V a, V b) {
  return a > b ? a : b;
}

inline float hsum(vec16 v) {
  const vec8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                 __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const vec4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

inline float hmax(vec16 v) {
  const vec8 a = vmax(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7),
                      __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15));
  const vec4 b = vmax(__builtin_shufflevector(a, a, 0, 1, 2, 3),
                      __builtin_shufflevector(a, a, 4, 5, 6, 7));
  return std::max(std::max(b[0], b[1]), std::max(b[2], b[3]));
}

// Lanes j < count of `x`, the rest `fill`.
inline vec16 keep_first(vec16 x, int64_t count, float fill) {
  const ivec16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  return lane < static_cast<int32_t>(count) ? x : splat(fill);
}

// exp by Cody-Waite range reduction and a degree-6 polynomial (relative error ~2e-7).
inline vec16 exp16(vec16 x) {
  x = vmax(x, splat(-87.0f));
  x = x < 88.0f ? x : splat(88.0f);
  const float round = 12582912.0f;  // 1.5 * 2^23: adding and subtracting it rounds to integer
  const vec16 n = (x * 1.44269504f + round) - round;
  const vec16 r = x - n * 0.693359375f + n * 2.12194440e-4f;
  vec16 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const ivec16 scale = (__builtin_convertvector(n, ivec16) + 127) << 23;
  return p * std::bit_cast<vec16>(scale);
}

// Lane j of the result is the sum of all lanes of v[j]: a transpose-and-add tree that halves the
// partial sums per key at each level, 30 shuffles for 16 keys instead of 16 horizontal sums.
inline vec16 transpose_sum(const vec16 (&v)[kLanes]) {
  vec16 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) {
    a[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18,
                                   19, 20, 21, 22, 23) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25,
                                   26, 27, 28, 29, 30, 31);
  }
  for (int i = 0; i < 4; ++i) {
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18,
                                   19, 24, 25, 26, 27) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21,
                                   22, 23, 28, 29, 30, 31);
  }
  for (int i = 0; i < 2; ++i) {
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20,
                                   21, 24, 25, 28, 29) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19,
                                   22, 23, 26, 27, 30, 31);
  }
  return __builtin_shufflevector(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                 28, 30) +
         __builtin_shufflevector(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27,
                                 29, 31);
}

// Dot products of q with 16 consecutive rows of `keys` (rows `padded` floats apart).
inline vec16 dot16(const float* q, const float* keys, int64_t padded) {
  vec16 partial[kLanes];
  const vec16 q0 = load16(q);
#pragma GCC unroll 16
  for (int j = 0; j < kLanes; ++j) partial[j] = q0 * load16(keys + j * padded);
  for (int64_t c = kLanes; c < padded; c += kLanes) {
    const vec16 qc = load16(q + c);
#pragma GCC unroll 16
    for (int j = 0; j < kLanes; ++j) partial[j] += qc * load16(keys + j * padded + c);
  }
  return transpose_sum(partial);
}

#if defined(__AVX512BF16__)
constexpr bool kHasBf16Dot = true;
#else
constexpr bool kHasBf16Dot = false;
#endif
// bf16 elements one AVX512-BF16 dot step consumes per row (q rows are zero-padded to it).
constexpr int64_t kBf16Pair = 32;

// Dot products of bf16 q (zero-padded to kBf16Pair) with the first `rows` (<= 16) of 16 bf16
// key rows `stride` elements apart, each `head_size` long: products exact in fp32, sums in
// fp32; lanes past `rows` are 0. Only those rows' own elements are read (masked tail loads).
inline vec16 dot16_bf16(const uint16_t* q, const uint16_t* keys, int64_t stride,
                        int64_t head_size, int64_t rows) {
#if defined(__AVX512BF16__)
  __m512 partial[kLanes];
#pragma GCC unroll 16
  for (int j = 0; j < kLanes; ++j) partial[j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < head_size; c += kBf16Pair) {
    const int64_t left = head_size - c;
    const __mmask32 mask = left >= kBf16Pair ? ~__mmask32{0} : (__mmask32{1} << left) - 1;
    const __m512bh qc = (__m512bh)_mm512_loadu_si512(q + c);
#pragma GCC unroll 16
    for (int j = 0; j < kLanes; ++j) {
      if (j >= rows) break;
      const __m512bh kc = (__m512bh)_mm512_maskz_loadu_epi16(mask, keys + j * stride + c);
      partial[j] = _mm512_dpbf16_ps(partial[j], qc, kc);
    }
  }
  vec16 sums[kLanes];
  for (int j = 0; j < kLanes; ++j) std::memcpy(&sums[j], &partial[j], sizeof(vec16));
  return transpose_sum(sums);
#else
  (void)q, (void)keys, (void)stride, (void)head_size, (void)rows;
  return vec16{};
#endif
}

// acc = acc * decay + sum_j p[j] * rows[j] (rows `padded` floats apart), four register
// accumulators at a time so the FMA chains overlap.
inline void decay_and_accumulate(float* acc, float decay, const float* p, int64_t count,
                                 const float* rows, int64_t padded) {
  int64_t c = 0;
  for (; c + 4 * kLanes <= padded; c += 4 * kLanes) {
    vec16 a0 = load16(acc + c) * decay, a1 = load16(acc + c + kLanes) * decay;
    vec16 a2 = load16(acc + c + 2 * kLanes) * decay, a3 = load16(acc + c + 3 * kLanes) * decay;
    for (int64_t j = 0; j < count; ++j) {
      const float* v = rows + j * padded + c;
      a0 += p[j] * load16(v);
      a1 += p[j] * load16(v + kLanes);
      a2 += p[j] * load16(v + 2 * kLanes);
      a3 += p[j] * load16(v + 3 * kLanes);
    }
    store16(acc + c, a0);
    store16(acc + c + kLanes, a1);
    store16(acc + c + 2 * kLanes, a2);
    store16(acc + c + 3 * kLanes, a3);
  }
  for (; c < padded; c += kLanes) {
    vec16 a = load16(acc + c) * decay;
    for (int64_t j = 0; j < count; ++j) a += p[j] * load16(rows + j * padded + c);
    store16(acc + c, a);
  }
}

}  // namespace platform_core_cpu
