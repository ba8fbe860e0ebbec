// fp32 vector helpers on GCC/Clang vector extensions, one native register wide: 16 lanes where
// AVX-512 is there, 8 (one AVX2 or two SSE/NEON registers) elsewhere, so that a kernel's
// accumulators stay in registers on every build (a 16-lane vector on AVX2 takes two of its
// sixteen registers and spills). Buffers these read are padded to a multiple of kLanes floats.
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace platform_core_cpu {

#if defined(__AVX512F__)
#define PLATFORM_CORE_CPU_LANES 16
#else
#define PLATFORM_CORE_CPU_LANES 8
#endif
constexpr int64_t kLanes = PLATFORM_CORE_CPU_LANES;

typedef float vecf __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t veci __attribute__((vector_size(kLanes * sizeof(int32_t))));
typedef uint32_t vecu __attribute__((vector_size(kLanes * sizeof(uint32_t))));
typedef int64_t veci64 __attribute__((vector_size(kLanes * sizeof(float))));
typedef uint16_t vecu16 __attribute__((vector_size(kLanes * sizeof(uint16_t))));
typedef float vec4 __attribute__((vector_size(16)));

inline vecf loadv(const float* p) {
  vecf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void storev(float* p, vecf v) { std::memcpy(p, &v, sizeof v); }

inline vecf splat(float x) { return vecf{} + x; }

// kLanes bf16 bit patterns at `p` widened to fp32 (a 16-bit shift).
inline vecf widen(const uint16_t* p) {
  vecu16 half;
  std::memcpy(&half, p, sizeof half);
  return std::bit_cast<vecf>(__builtin_convertvector(half, vecu) << 16);
}

template <typename V>
inline V vmax(V a, V b) {
  return a > b ? a : b;
}

// The four-lane sum (or maximum, with vmax for `op`) of a vector's quarters or halves.
template <typename Op>
inline vec4 fold4(vecf v, Op op) {
#if PLATFORM_CORE_CPU_LANES == 16
  typedef float vec8 __attribute__((vector_size(32)));
  const vec8 a = op(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7),
                    __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15));
#else
  const vecf a = v;
#endif
  return op(__builtin_shufflevector(a, a, 0, 1, 2, 3), __builtin_shufflevector(a, a, 4, 5, 6, 7));
}

inline float hsum(vecf v) {
  const vec4 b = fold4(v, [](auto x, auto y) { return x + y; });
  return (b[0] + b[2]) + (b[1] + b[3]);
}

inline float hmax(vecf v) {
  const vec4 b = fold4(v, [](auto x, auto y) { return vmax(x, y); });
  return std::max(std::max(b[0], b[1]), std::max(b[2], b[3]));
}

// Lanes j < count of `x`, the rest `fill`.
inline vecf keep_first(vecf x, int64_t count, float fill) {
#if PLATFORM_CORE_CPU_LANES == 16
  const veci lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#else
  const veci lane = {0, 1, 2, 3, 4, 5, 6, 7};
#endif
  return lane < static_cast<int32_t>(count) ? x : splat(fill);
}

// exp by Cody-Waite range reduction and a degree-6 polynomial (relative error ~2e-7).
inline vecf expv(vecf x) {
  x = vmax(x, splat(-87.0f));
  x = x < 88.0f ? x : splat(88.0f);
  const float round = 12582912.0f;  // 1.5 * 2^23: adding and subtracting it rounds to integer
  const vecf n = (x * 1.44269504f + round) - round;
  const vecf r = x - n * 0.693359375f + n * 2.12194440e-4f;
  vecf p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const veci scale = (__builtin_convertvector(n, veci) + 127) << 23;
  return p * std::bit_cast<vecf>(scale);
}

// kLanes (even, odd) element pairs from `src` split into two vectors: lane j of `even` is
// src[2j] and of `odd` src[2j + 1] as fp32; pairs at or past `lanes` read as zero.
inline void load_pairs(const float* src, int64_t lanes, vecf& even, vecf& odd) {
  float padded[2 * kLanes];
  if (lanes < kLanes) {
    std::fill(padded, padded + 2 * kLanes, 0.0f);
    std::memcpy(padded, src, lanes * 2 * sizeof(float));
    src = padded;
  }
  const vecf lo = loadv(src), hi = loadv(src + kLanes);
#if PLATFORM_CORE_CPU_LANES == 16
  even = __builtin_shufflevector(lo, hi, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  odd = __builtin_shufflevector(lo, hi, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#else
  even = __builtin_shufflevector(lo, hi, 0, 2, 4, 6, 8, 10, 12, 14);
  odd = __builtin_shufflevector(lo, hi, 1, 3, 5, 7, 9, 11, 13, 15);
#endif
}

// The same for bf16 bit patterns: a pair is one 32-bit word, low half first.
inline void load_pairs(const uint16_t* src, int64_t lanes, vecf& even, vecf& odd) {
  veci words = {};
  if (lanes >= kLanes) {
    std::memcpy(&words, src, sizeof words);
  } else {
    std::memcpy(&words, src, lanes * 2 * sizeof(uint16_t));
  }
  even = std::bit_cast<vecf>(words << 16);
  odd = std::bit_cast<vecf>(words & static_cast<int32_t>(0xFFFF0000u));
}

// bf16 elements one AVX512-BF16 dot step consumes per row.
constexpr int64_t kBf16Pair = 32;

}  // namespace platform_core_cpu
