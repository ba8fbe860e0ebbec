// The GGML block formats as the quantized linear (quantized_linear.cpp) reads them, each
// reduced to "w = a * q + c" with q an 8-bit integer (layouts: platform_core/quantization/
// formats.py).
#pragma once

#include "quant_simd.h"

namespace platform_core_cpu::quant {

// Each format describes a block of kParts parts of 32 weights, where w = a * q + c with q an
// 8-bit integer (int8 where kSigned) and one (a, c) per 32 weights (kSlots 1) or per 16
// (kSlots 2). scales(block, a, c) writes the block's kParts * kSlots of each; quants(block, j)
// gives part j's q. Activation is the integer x is rounded to.
struct Q8_0 {
  static constexpr int kBytes = 34, kParts = 1, kSlots = 1;
  static constexpr bool kSigned = true;
  using Activation = int16_t;  // 8-bit weights: 8-bit activations would double the error
  static inline void scales(const uint8_t* block, float* a, float* c) {
    a[0] = half_to_float(block);
    c[0] = 0.0f;
  }
#if defined(__AVX2__)
  static inline void scales8(__m256 d, __m256, float* a, float* c) {
    _mm256_storeu_ps(a, d);
    _mm256_storeu_ps(c, _mm256_setzero_ps());
  }
#endif
  static inline Quants quants(const uint8_t* block, int) { return bytes_at(block + 2); }
};

struct Q4_0 {
  static constexpr int kBytes = 18, kParts = 1, kSlots = 1;
  static constexpr bool kSigned = false;
  using Activation = int8_t;
  static inline void scales(const uint8_t* block, float* a, float* c) {
    a[0] = half_to_float(block);
    c[0] = -8.0f * a[0];
  }
#if defined(__AVX2__)
  static inline void scales8(__m256 d, __m256, float* a, float* c) {
    _mm256_storeu_ps(a, d);
    _mm256_storeu_ps(c, _mm256_mul_ps(d, _mm256_set1_ps(-8.0f)));
  }
#endif
  static inline Quants quants(const uint8_t* block, int) { return nibbles_split(block + 2); }
};

struct Q4_1 {
  static constexpr int kBytes = 20, kParts = 1, kSlots = 1;
  static constexpr bool kSigned = false;
  using Activation = int8_t;
  static inline void scales(const uint8_t* block, float* a, float* c) {
    halves_to_float(block, a[0], c[0]);
  }
#if defined(__AVX2__)
  static inline void scales8(__m256 d, __m256 m, float* a, float* c) {
    _mm256_storeu_ps(a, d);
    _mm256_storeu_ps(c, m);
  }
#endif
  static inline Quants quants(const uint8_t* block, int) { return nibbles_split(block + 4); }
};

struct Q4_K {
  static constexpr int kBytes = 144, kParts = 8, kSlots = 1;
  static constexpr bool kSigned = false;
  using Activation = int8_t;
  static inline void scales(const uint8_t* block, float* a, float* c) {
    float d, dmin;
    halves_to_float(block, d, dmin);
    const uint8_t* low = block + 4;   // scales 0-3 and mins 0-3: six bits each
    const uint8_t* mid = block + 8;
    const uint8_t* high = block + 12;  // low four bits of scales / mins 4-7
    for (int j = 0; j < kParts; ++j) {
      int scale, min;
      if (j < 4) {
        scale = low[j] & 63;
        min = mid[j] & 63;
      } else {
        scale = (high[j - 4] & 0x0F) | ((low[j - 4] >> 6) << 4);
        min = (high[j - 4] >> 4) | ((mid[j - 4] >> 6) << 4);
      }
      a[j] = d * static_cast<float>(scale);
      c[j] = -dmin * static_cast<float>(min);
    }
  }
  // Each 32 bytes hold parts 2g (low nibbles) and 2g + 1 (high nibbles).
  static inline Quants quants(const uint8_t* block, int j) {
    return nibbles_at(block + 16 + (j / 2) * 32, 4 * (j % 2));
  }
};

struct Q6_K {
  static constexpr int kBytes = 210, kParts = 8, kSlots = 2;
  static constexpr bool kSigned = true;  // q - 32, so no offset has to cancel a large sum
  using Activation = int8_t;
  static inline void scales(const uint8_t* block, float* a, float* c) {
    const float d = half_to_float(block + 208);
    const auto* scales = reinterpret_cast<const int8_t*>(block + 192);  // one per 16 weights
    for (int t = 0; t < kParts * kSlots; ++t) {
      a[t] = d * scales[t];
      c[t] = 0.0f;
    }
  }
  // Half h = j / 4 of 128 weights, quarter r = j % 4: low nibbles from bytes 64h + 32(r % 2),
  // shifted by 4(r / 2); the high two bits from bytes 128 + 32h, shifted by 2r.
  static inline Quants quants(const uint8_t* block, int j) {
    const int h = j / 4, r = j % 4;
    return minus_32(
        six_bits(block + 64 * h + 32 * (r % 2), 4 * (r / 2), block + 128 + 32 * h, 2 * r));
  }
};

// a and c of every part of a weight row of `blocks` blocks. One-part formats, whose scales are
// the float16 pair at each block's start, convert eight blocks' at a time (F::scales8).
template <class F>
inline void row_scales(const uint8_t* row, int64_t blocks, float* a, float* c) {
  constexpr int64_t per_block = F::kParts * F::kSlots;
  int64_t s = 0;
#if defined(__AVX2__)
  if constexpr (F::kParts == 1) {
    uint32_t pairs[8];
    for (; s + 8 <= blocks; s += 8) {
      for (int t = 0; t < 8; ++t) std::memcpy(&pairs[t], row + (s + t) * F::kBytes, 4);
      __m256 first, second;
      split_halves(pairs, first, second);
      F::scales8(first, second, a + s, c + s);
    }
  }
#endif
  for (; s < blocks; ++s) F::scales(row + s * F::kBytes, a + s * per_block, c + s * per_block);
}


}  // namespace platform_core_cpu::quant
