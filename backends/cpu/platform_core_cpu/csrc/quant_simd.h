// Integer building blocks of the quantized linear (quantized_linear.cpp), one set per build:
// AVX2 (with VNNI where the build has AVX512-VNNI) or plain loops. A part is 32 weights as
// 8-bit integers (`Quants`, in the order of the activations they meet); dot32 sums them times
// 32 rounded activations into lanes (AVX2: lanes 0-3 over elements 0-15, 4-7 over 16-31;
// plain: the two halves), and `Lanes` accumulate those sums times float scales.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace platform_core_cpu::quant {

inline float half_to_float(const uint8_t* p) {
  const uint16_t bits = static_cast<uint16_t>(p[0] | (p[1] << 8));
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1F, fraction = bits & 0x3FF;
  if (exponent == 0) {  // zero or subnormal
    const float value = std::ldexp(static_cast<float>(fraction), -24);
    return sign ? -value : value;
  }
  const uint32_t out = exponent == 0x1F ? (sign | 0x7F800000u | (fraction << 13))
                                        : (sign | ((exponent + 112) << 23) | (fraction << 13));
  return std::bit_cast<float>(out);
#endif
}

// The two float16s at p (little-endian, back to back) as floats.
inline void halves_to_float(const uint8_t* p, float& first, float& second) {
#if defined(__F16C__)
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  const __m128 both = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(bits)));
  first = _mm_cvtss_f32(both);
  second = _mm_cvtss_f32(_mm_movehdup_ps(both));
#else
  first = half_to_float(p);
  second = half_to_float(p + 2);
#endif
}

// 32 weights' integers, in the order of the 32 activations they meet.
#if defined(__AVX2__)
using Quants = __m256i;

inline Quants nibbles_split(const uint8_t* p16) {  // byte j: weight j low, weight j + 16 high
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p16));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

inline __m256i shift_right(__m256i v, int shift) {
  return _mm256_srl_epi16(v, _mm_cvtsi32_si128(shift));
}

inline Quants nibbles_at(const uint8_t* p32, int shift) {  // weight j in byte j's nibble
  const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p32));
  return _mm256_and_si256(shift_right(packed, shift), _mm256_set1_epi8(0x0F));
}

inline Quants six_bits(const uint8_t* low32, int low_shift, const uint8_t* high32, int high_shift) {
  const __m256i high = _mm256_and_si256(
      shift_right(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(high32)), high_shift),
      _mm256_set1_epi8(3));
  return _mm256_or_si256(nibbles_at(low32, low_shift), _mm256_slli_epi16(high, 4));
}

inline Quants bytes_at(const uint8_t* p32) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p32));
}

inline Quants minus_32(Quants q) { return _mm256_sub_epi8(q, _mm256_set1_epi8(32)); }

// Sums of q * qx: lanes 0-3 over elements 0-15, lanes 4-7 over 16-31. `q` unsigned (< 128)
// or, with Signed, int8; vpmaddubsw's 16-bit pair sums cannot overflow either way.
template <bool Signed>
inline __m256i dot32(Quants q, const int8_t* xq) {
  __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
  if constexpr (Signed) {  // |q| * (qx with q's sign): an unsigned operand, the same products
    x = _mm256_sign_epi8(x, q);
    q = _mm256_sign_epi8(q, q);
  }
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), q, x);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), _mm256_set1_epi16(1));
#endif
}

// The same for int8 weights and int16 activations (vpmaddwd, or VNNI's vpdpwssd): its lanes
// mix the two halves, so for formats with one scale per 32 weights only.
template <bool Signed>
inline __m256i dot32(Quants q, const int16_t* xq) {
  static_assert(Signed, "int16 activations meet int8 weights");
  const __m256i low = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(q));
  const __m256i high = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(q, 1));
  const __m256i x_low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
  const __m256i x_high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 16));
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(_mm256_madd_epi16(low, x_low), high, x_high);
#else
  return _mm256_add_epi32(_mm256_madd_epi16(low, x_low), _mm256_madd_epi16(high, x_high));
#endif
}

// Sums in fp32 lanes: each 32-weight part adds its integer sums times its scale(s) `a`, one
// per 32 weights (Slots 1) or one per 16 (Slots 2: a[0] for elements 0-15, a[1] for 16-31).
using Lanes = __m256;

inline Lanes no_lanes() { return _mm256_setzero_ps(); }

template <int Slots>
inline Lanes add_scaled(Lanes acc, __m256i sums, const float* a) {
  __m256 scale;
  if constexpr (Slots == 1) {
    scale = _mm256_broadcast_ss(a);
  } else {
    scale = _mm256_setr_m128(_mm_broadcast_ss(a), _mm_broadcast_ss(a + 1));
  }
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc);
}

inline float lanes_total(Lanes lanes) {
  __m128 v = _mm_add_ps(_mm256_castps256_ps128(lanes), _mm256_extractf128_ps(lanes, 1));
  v = _mm_add_ps(v, _mm_movehl_ps(v, v));
  v = _mm_add_ss(v, _mm_movehdup_ps(v));
  return _mm_cvtss_f32(v);
}

inline void store_quants(Quants q, uint8_t* out) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), q);
}

// Eight pairs of float16s (each pair one 32-bit word, first half low) as eight firsts and
// eight seconds.
inline void split_halves(const uint32_t* pairs, __m256& first, __m256& second) {
  const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pairs));
  // Each 128-bit lane gathers its four words' halves into its low 8 bytes (the rest unused),
  // and the two lanes' low 8 bytes are joined.
  const __m256i low = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1,
                                       0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i high = _mm256_setr_epi8(2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1,
                                        -1, 2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1,
                                        -1, -1);
  const auto halves = [&](__m256i order) {
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(words, order), 0x08);
    return _mm256_cvtph_ps(_mm256_castsi256_si128(packed));
  };
  first = halves(low);
  second = halves(high);
}
#else
struct Quants {
  uint8_t v[32];
};

inline Quants nibbles_split(const uint8_t* p16) {
  Quants q;
  for (int j = 0; j < 16; ++j) {
    q.v[j] = p16[j] & 0x0F;
    q.v[j + 16] = p16[j] >> 4;
  }
  return q;
}

inline Quants nibbles_at(const uint8_t* p32, int shift) {
  Quants q;
  for (int j = 0; j < 32; ++j) q.v[j] = (p32[j] >> shift) & 0x0F;
  return q;
}

inline Quants six_bits(const uint8_t* low32, int low_shift, const uint8_t* high32, int high_shift) {
  Quants q;
  for (int j = 0; j < 32; ++j) {
    q.v[j] = ((low32[j] >> low_shift) & 0x0F) | (((high32[j] >> high_shift) & 3) << 4);
  }
  return q;
}

inline Quants bytes_at(const uint8_t* p32) {
  Quants q;
  std::memcpy(q.v, p32, 32);
  return q;
}

inline Quants minus_32(Quants q) {
  for (auto& value : q.v) value = static_cast<uint8_t>(value - 32);
  return q;
}

struct HalfSums {
  int32_t half[2];
};

template <bool Signed, typename A>
inline HalfSums dot32(const Quants& q, const A* xq) {
  HalfSums out = {{0, 0}};
  for (int h = 0; h < 2; ++h) {
    int32_t sum = 0;
    for (int j = 16 * h; j < 16 * h + 16; ++j) {
      const int32_t w = Signed ? static_cast<int8_t>(q.v[j]) : q.v[j];
      sum += w * xq[j];
    }
    out.half[h] = sum;
  }
  return out;
}

using Lanes = float;

inline Lanes no_lanes() { return 0.0f; }

template <int Slots>
inline Lanes add_scaled(Lanes acc, HalfSums sums, const float* a) {
  if constexpr (Slots == 1) {
    return acc + static_cast<float>(sums.half[0] + sums.half[1]) * a[0];
  } else {
    return acc + static_cast<float>(sums.half[0]) * a[0] + static_cast<float>(sums.half[1]) * a[1];
  }
}

inline float lanes_total(Lanes lanes) { return lanes; }

inline void store_quants(const Quants& q, uint8_t* out) { std::memcpy(out, q.v, 32); }
#endif

}  // namespace platform_core_cpu::quant
