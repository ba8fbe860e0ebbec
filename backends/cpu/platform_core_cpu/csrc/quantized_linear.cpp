// Linears on weights kept in GGML blocks (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K), read as stored:
// y = x W^T (+ b) with x [M, K] (float32 or bf16) and W [N, row_bytes] uint8, each row its
// blocks back to back (platform_core/quantization/formats.py has the layouts).
//
// - Up to 16 rows (8 where the alternative is a bf16 matmul; decode): x is rounded to
//   integers per 32 values (a float scale and the scaled sum of each half): to 8 bits for 4-
//   and 6-bit weights, whose own rounding is far coarser, and to 16 bits for Q8_0, whose 8-bit
//   activations would double its error (and flip near-ties of the logits: Q8_0 is the usual
//   output head). Each 32 weights meet them in integer dot products: VNNI's vpdpbusd /
//   vpdpwssd where the build has AVX512-VNNI, AVX2's vpmaddubsw / vpmaddwd otherwise, plain
//   loops on generic builds. Every format reduces to "w = a * q + c per 16 weights" with q an
//   8-bit integer, so a 32-weight block adds (a * dx) * sum(q * qx) + c * dx * sum(qx).
//   The weights stream from memory once per call, at a quarter to an eighth of bf16's bytes.
//   Threads take bands of weight rows; each row's blocks are decoded once for up to four rows
//   of x, and one row of x meets four weight rows at a time.
// - More rows (prefill, large batches: bound by arithmetic): chunks of up to 4M weights are
//   dequantized (vectorized) and go through torch's matmul, in bf16 on AVX512-BF16 builds for
//   bf16 x, else in fp32. Larger chunks measured faster: fewer, wider matmuls.

#include "cpu_kernels.h"
#include "vec_math.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string_view>
#include <type_traits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace platform_core_cpu {
namespace {

// Rows up to which the integer dot products beat dequantizing into a matmul (Q4_1 at SmolLM2's
// shapes, benchmarks/RESULTS.md): 8 where that matmul runs in bf16 on AVX512-BF16, else 16.
constexpr int64_t kIntegerRowsMaxBf16 = 8, kIntegerRowsMax = 16;
constexpr int64_t kChunkElements = 1 << 22;  // weights dequantized per matmul (16 MiB fp32)
constexpr int64_t kTileRows = 4;             // rows of x that share one decode of a weight row

float half_to_float(const uint8_t* p) {
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

// x rounded to integers A (int8, or int16 for 8-bit weights) per block of 32: x = d * q over
// each block, d = max |x| / (A's largest). Row r's blocks start at q[r * blocks * 32]; the
// scales come per 32 activations (`d32`, and `sums32`: d times the sum of the block's q) and
// per 16 (`d16`, `sums16`: the same over each half).
template <typename A>
struct RoundedRows {
  int64_t blocks = 0;
  std::vector<A> q;
  std::vector<float> d32, sums32, d16, sums16;

  // Row r's d and sums with one entry per `width` activations (32 or 16).
  const float* d(int width, int64_t r) const {
    return width == 32 ? d32.data() + r * blocks : d16.data() + 2 * r * blocks;
  }
  const float* sums(int width, int64_t r) const {
    return width == 32 ? sums32.data() + r * blocks : sums16.data() + 2 * r * blocks;
  }
};

template <typename T, typename A>
RoundedRows<A> round_rows(const at::Tensor& x) {
  constexpr float kLargest = std::numeric_limits<A>::max();
  const int64_t m = x.size(0), k = x.size(1), ldx = x.stride(0);
  RoundedRows<A> rows;
  rows.blocks = k / 32;
  rows.q.resize(m * k);
  rows.d32.resize(m * rows.blocks);
  rows.sums32.resize(m * rows.blocks);
  rows.d16.resize(2 * m * rows.blocks);
  rows.sums16.resize(2 * m * rows.blocks);
  const T* xp = x.data_ptr<T>();
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t b = 0; b < rows.blocks; ++b) {
      const T* in = xp + r * ldx + b * 32;
      const int64_t at = r * rows.blocks + b;
      A* q = rows.q.data() + at * 32;
      float peak = 0.0f;
      bool finite = true;
      for (int e = 0; e < 32; ++e) {
        const float value = to_float(in[e]);
        peak = std::max(peak, std::abs(value));
        finite = finite && std::isfinite(value);
      }
      // A block with an inf or NaN gets q = 0 and d = NaN: its outputs are NaN, as the
      // reference's would be.
      const float d = finite ? peak / kLargest : std::numeric_limits<float>::quiet_NaN();
      const float inverse = finite && peak > 0.0f ? kLargest / peak : 0.0f;
      int32_t half_sums[2] = {0, 0};
      for (int e = 0; e < 32; ++e) {
        q[e] = static_cast<A>(std::nearbyint(to_float(in[e]) * inverse));
        half_sums[e / 16] += q[e];
      }
      rows.d32[at] = d;
      rows.sums32[at] = d * static_cast<float>(half_sums[0] + half_sums[1]);
      for (int h = 0; h < 2; ++h) {
        rows.d16[2 * at + h] = d;
        rows.sums16[2 * at + h] = d * static_cast<float>(half_sums[h]);
      }
    }
  }
  return rows;
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

// sum over t < n of a[t] * b[t], in vector lanes.
inline float dot(const float* a, const float* b, int64_t n) {
  vecf acc = {};
  int64_t t = 0;
  for (; t + kLanes <= n; t += kLanes) acc += loadv(a + t) * loadv(b + t);
  float sum = hsum(acc);
  for (; t < n; ++t) sum += a[t] * b[t];
  return sum;
}

constexpr int kTileWeightRows = 4;

// out[w][i] = weight row w of the WR rows at `wrows` . x row (first + i), for XR rows of x.
// The rows' scales are decoded first and multiplied by x's into `scratch`, with the offsets
// (sum of c times x's sums) as vector dot products; the main loop then decodes each part of
// each weight row once for XR rows of x, and its WR x XR sums are independent chains.
template <class F, int WR, int XR>
void dot_tile(const uint8_t* wrows, int64_t row_bytes,
              const RoundedRows<typename F::Activation>& x, int64_t first,
              std::vector<float>& scratch, float (&out)[kTileWeightRows][kTileRows]) {
  constexpr int width = 32 / F::kSlots;
  const int64_t blocks = row_bytes / F::kBytes, slots = blocks * F::kParts * F::kSlots;
  scratch.resize(slots * (2 * WR + WR * XR));
  float* a = scratch.data();
  float* c = a + WR * slots;
  float* scaled = c + WR * slots;  // [w][i][slot]: a times x's d
  for (int w = 0; w < WR; ++w) {
    row_scales<F>(wrows + w * row_bytes, blocks, a + w * slots, c + w * slots);
  }
  for (int w = 0; w < WR; ++w) {
    for (int i = 0; i < XR; ++i) {
      const float* xd = x.d(width, first + i);
      float* into = scaled + (w * XR + i) * slots;
      for (int64_t t = 0; t < slots; ++t) into[t] = a[w * slots + t] * xd[t];
      out[w][i] = dot(c + w * slots, x.sums(width, first + i), slots);
    }
  }
  Lanes acc[WR][XR];
  for (int w = 0; w < WR; ++w) {
    for (int i = 0; i < XR; ++i) acc[w][i] = no_lanes();
  }
  const typename F::Activation* xq = x.q.data() + first * x.blocks * 32;
  const int64_t x_stride = x.blocks * 32;
  for (int64_t s = 0; s < blocks; ++s) {
    for (int j = 0; j < F::kParts; ++j) {
      const int64_t part = s * F::kParts + j;
#pragma GCC unroll 4
      for (int w = 0; w < WR; ++w) {
        const Quants q = F::quants(wrows + w * row_bytes + s * F::kBytes, j);
#pragma GCC unroll 4
        for (int i = 0; i < XR; ++i) {
          const auto sums = dot32<F::kSigned>(q, xq + i * x_stride + part * 32);
          acc[w][i] = add_scaled<F::kSlots>(acc[w][i], sums,
                                            scaled + (w * XR + i) * slots + part * F::kSlots);
        }
      }
    }
  }
  for (int w = 0; w < WR; ++w) {
    for (int i = 0; i < XR; ++i) out[w][i] += lanes_total(acc[w][i]);
  }
}

// Weight rows [row, row + WR) against every row of x, written to out (+ bias).
template <class F, int WR, typename T>
inline void weight_rows(const RoundedRows<typename F::Activation>& x, int64_t m,
                        const uint8_t* w, int64_t row_bytes, int64_t n, int64_t row,
                        const float* bias, std::vector<float>& scratch, T* out) {
  float sums[kTileWeightRows][kTileRows];
  const uint8_t* wrows = w + row * row_bytes;
  for (int64_t first = 0; first < m; first += kTileRows) {
    const int64_t rows = std::min(kTileRows, m - first);
    if constexpr (WR == kTileWeightRows) {  // one row of x only
      dot_tile<F, WR, 1>(wrows, row_bytes, x, first, scratch, sums);
    } else {
      switch (rows) {
        case 4: dot_tile<F, WR, 4>(wrows, row_bytes, x, first, scratch, sums); break;
        case 3: dot_tile<F, WR, 3>(wrows, row_bytes, x, first, scratch, sums); break;
        case 2: dot_tile<F, WR, 2>(wrows, row_bytes, x, first, scratch, sums); break;
        default: dot_tile<F, WR, 1>(wrows, row_bytes, x, first, scratch, sums); break;
      }
    }
    for (int v = 0; v < WR; ++v) {
      const float b = bias ? bias[row + v] : 0.0f;
      for (int64_t i = 0; i < rows; ++i) {
        out[(first + i) * n + row + v] = from_float<T>(sums[v][i] + b);
      }
    }
  }
}

template <class F, typename T>
void integer_linear(const RoundedRows<typename F::Activation>& x, int64_t m, const uint8_t* w,
                    int64_t row_bytes, int64_t n, const float* bias, T* out) {
  // One x row: four weight rows at a time (four chains); more: two weight rows by four x rows.
  const int64_t step = m == 1 ? kTileWeightRows : 2;
  // At least 32 KiB of weights per task: smaller ones cost more to hand out than they save.
  const int64_t grain = std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(1, row_bytes * step));
  at::parallel_for(0, (n + step - 1) / step, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    const int64_t stop = std::min(n, end * step);
    int64_t row = begin * step;
    for (; row + step <= stop; row += step) {
      if (step == kTileWeightRows) {
        weight_rows<F, kTileWeightRows>(x, m, w, row_bytes, n, row, bias, scratch, out);
      } else {
        weight_rows<F, 2>(x, m, w, row_bytes, n, row, bias, scratch, out);
      }
    }
    for (; row < stop; ++row) weight_rows<F, 1>(x, m, w, row_bytes, n, row, bias, scratch, out);
  });
}

// The 32 weights a * q + c of one part (a, c: a[0], c[0] for elements 0-15 and a[Slots - 1],
// c[Slots - 1] for 16-31) as W (fp32, or bf16 rounded to nearest even) at `out`.
template <bool Signed, int Slots, typename W>
inline void write_part(Quants quants, const float* a, const float* c, W* out) {
#if defined(__AVX2__)
  for (int quarter = 0; quarter < 4; ++quarter) {
    const __m128i bytes = quarter < 2 ? _mm256_castsi256_si128(quants)
                                      : _mm256_extracti128_si256(quants, 1);
    const __m128i eight = quarter % 2 ? _mm_srli_si128(bytes, 8) : bytes;
    const __m256i ints = Signed ? _mm256_cvtepi8_epi32(eight) : _mm256_cvtepu8_epi32(eight);
    const int t = quarter < 2 ? 0 : Slots - 1;
    const __m256 values = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ints), _mm256_set1_ps(a[t]),
                                          _mm256_set1_ps(c[t]));
    if constexpr (std::is_same_v<W, float>) {
      _mm256_storeu_ps(out + 8 * quarter, values);
    } else {
#if defined(__AVX512BF16__)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 8 * quarter),
                       (__m128i)_mm256_cvtneps_pbh(values));
#else
      float spilled[8];
      _mm256_storeu_ps(spilled, values);
      for (int e = 0; e < 8; ++e) out[8 * quarter + e] = from_float<W>(spilled[e]);
#endif
    }
  }
#else
  uint8_t q[32];
  store_quants(quants, q);
  for (int half = 0; half < 2; ++half) {
    const float scale = a[half * (Slots - 1)], offset = c[half * (Slots - 1)];
    for (int e = 16 * half; e < 16 * half + 16; ++e) {
      const float value = Signed ? static_cast<float>(static_cast<int8_t>(q[e])) : q[e];
      out[e] = from_float<W>(scale * value + offset);
    }
  }
#endif
}

// Weight rows [0, rows) of `w` dequantized to rows of `k` values W (fp32 or bf16) at `out`.
template <class F, typename W>
void dequantize_rows(const uint8_t* w, int64_t row_bytes, int64_t rows, int64_t k, W* out) {
  const int64_t blocks = row_bytes / F::kBytes;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    float a[F::kParts * F::kSlots], c[F::kParts * F::kSlots];
    for (int64_t row = begin; row < end; ++row) {
      for (int64_t s = 0; s < blocks; ++s) {
        const uint8_t* block = w + row * row_bytes + s * F::kBytes;
        F::scales(block, a, c);
        for (int j = 0; j < F::kParts; ++j) {
          write_part<F::kSigned, F::kSlots>(F::quants(block, j), a + j * F::kSlots,
                                            c + j * F::kSlots,
                                            out + row * k + (s * F::kParts + j) * 32);
        }
      }
    }
  });
}

// The dtype the dequantized matmul runs in: bf16 where x is bf16 and the build has AVX512-BF16
// (oneDNN's bf16 GEMM runs on it at about twice fp32's rate), else fp32.
at::ScalarType matmul_dtype(const at::Tensor& x) {
#if defined(__AVX512BF16__)
  return x.scalar_type() == at::kBFloat16 ? at::kBFloat16 : at::kFloat;
#else
  return at::kFloat;
#endif
}

// x times chunks of weight rows dequantized into torch's matmul, in `compute`.
template <class F>
void dequantized_matmul(const at::Tensor& x, const at::Tensor& qweight, int64_t k,
                        const at::Tensor& bias, at::ScalarType compute, at::Tensor& out) {
  const at::Tensor xc = x.to(compute);
  const int64_t n = qweight.size(0), row_bytes = qweight.size(1);
  const int64_t chunk = std::max<int64_t>(16, kChunkElements / std::max<int64_t>(1, k));
  at::Tensor weights = new_tensor({std::min(chunk, n), k}, compute);
  const uint8_t* w = qweight.data_ptr<uint8_t>();
  for (int64_t start = 0; start < n; start += chunk) {
    const int64_t len = std::min(chunk, n - start);
    if (compute == at::kBFloat16) {
      dequantize_rows<F>(w + start * row_bytes, row_bytes, len, k,
                         weights.data_ptr<c10::BFloat16>());
    } else {
      dequantize_rows<F>(w + start * row_bytes, row_bytes, len, k, weights.data_ptr<float>());
    }
    at::Tensor part = xc.mm(weights.narrow(0, 0, len).t());
    if (bias.defined()) part.add_(bias.narrow(0, start, len));
    out.narrow(1, start, len).copy_(part);
  }
}

template <class F>
at::Tensor run(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& bias) {
  const int64_t m = x.size(0), k = x.size(1), n = qweight.size(0), row_bytes = qweight.size(1);
  constexpr int64_t block_weights = 32 * F::kParts;
  TORCH_CHECK(row_bytes % F::kBytes == 0 && row_bytes / F::kBytes * block_weights == k,
              "quantized_linear: weight rows of ", row_bytes, " bytes do not hold ", k,
              " weights in whole blocks");
  at::Tensor out = new_tensor({m, n}, x.scalar_type());
  if (m == 0 || n == 0) return out;
  const at::ScalarType compute = matmul_dtype(x);
  if (m > (compute == at::kBFloat16 ? kIntegerRowsMaxBf16 : kIntegerRowsMax)) {
    dequantized_matmul<F>(x, qweight, k, bias, compute, out);
    return out;
  }
  const float* b = bias.defined() ? bias.data_ptr<float>() : nullptr;
  const uint8_t* w = qweight.data_ptr<uint8_t>();
  using A = typename F::Activation;
  if (x.scalar_type() == at::kBFloat16) {
    integer_linear<F>(round_rows<c10::BFloat16, A>(x), m, w, row_bytes, n, b,
                      out.data_ptr<c10::BFloat16>());
  } else {
    integer_linear<F>(round_rows<float, A>(x), m, w, row_bytes, n, b, out.data_ptr<float>());
  }
  return out;
}

}  // namespace

at::Tensor quantized_linear(const at::Tensor& x, const at::Tensor& qweight,
                            c10::string_view format, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "quantized_linear: x [M, K] with contiguous rows");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "quantized_linear: float32 or bfloat16 x");
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous() && qweight.scalar_type() == at::kByte,
              "quantized_linear: contiguous uint8 blocks [N, row_bytes]");
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == qweight.size(0),
                "quantized_linear: bias [N]");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  const std::string_view name(format.data(), format.size());
  if (name == "Q8_0") return run<Q8_0>(x, qweight, bias_f);
  if (name == "Q4_0") return run<Q4_0>(x, qweight, bias_f);
  if (name == "Q4_1") return run<Q4_1>(x, qweight, bias_f);
  if (name == "Q4_K") return run<Q4_K>(x, qweight, bias_f);
  if (name == "Q6_K") return run<Q6_K>(x, qweight, bias_f);
  TORCH_CHECK(false, "quantized_linear: no kernel for format ", name);
}

}  // namespace platform_core_cpu
