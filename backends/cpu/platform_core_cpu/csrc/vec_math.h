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

// Sixteen (even, odd) element pairs from `src` split into two vectors: lane j of `even` is
// src[2j] and of `odd` src[2j + 1] as fp32; pairs at or past `lanes` read as zero.
inline void load_pairs(const float* src, int64_t lanes, vec16& even, vec16& odd) {
  float padded[2 * kLanes];
  if (lanes < kLanes) {
    std::fill(padded, padded + 2 * kLanes, 0.0f);
    std::memcpy(padded, src, lanes * 2 * sizeof(float));
    src = padded;
  }
  const vec16 lo = load16(src), hi = load16(src + kLanes);
  even = __builtin_shufflevector(lo, hi, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  odd = __builtin_shufflevector(lo, hi, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

// The same for bf16 bit patterns: a pair is one 32-bit word, low half first.
inline void load_pairs(const uint16_t* src, int64_t lanes, vec16& even, vec16& odd) {
  ivec16 words = {};
  if (lanes >= kLanes) {
    std::memcpy(&words, src, sizeof words);
  } else {
    std::memcpy(&words, src, lanes * 2 * sizeof(uint16_t));
  }
  even = std::bit_cast<vec16>(words << 16);
  odd = std::bit_cast<vec16>(words & static_cast<int32_t>(0xFFFF0000u));
}

#if defined(__AVX512BF16__)
constexpr bool kHasBf16Dot = true;
#else
constexpr bool kHasBf16Dot = false;
#endif
// bf16 elements one AVX512-BF16 dot step consumes per row.
constexpr int64_t kBf16Pair = 32;

}  // namespace platform_core_cpu
