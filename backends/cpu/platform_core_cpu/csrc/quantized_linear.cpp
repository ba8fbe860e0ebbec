// Linears on weights kept in GGML blocks (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K), read as stored:
// y = x W^T (+ b) with x [M, K] (float32 or bf16) and W [N, row_bytes] uint8, each row its
// blocks back to back (platform_core/quantization/formats.py has the layouts).
//
// - Up to 16 rows (5 where the alternative is bf16 panels; decode): x is rounded to
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
// - More rows (prefill, large batches: bound by arithmetic): on AVX512-BF16 builds with bf16
//   x, each thread dequantizes a panel of weight rows at a time into bf16 dot products
//   (bf16_panel_gemm.h), so no dequantized copy of the weight goes through memory; otherwise
//   chunks of up to 4M weights are dequantized into torch's fp32 matmul (larger chunks
//   measured faster: fewer, wider matmuls).

#include "bf16_panel_gemm.h"
#include "cpu_kernels.h"
#include "quant_formats.h"
#include "vec_math.h"

#include <ATen/Parallel.h>

#include <limits>
#include <string_view>
#include <vector>

namespace platform_core_cpu {
namespace {

// Rows up to which the integer dot products beat dequantizing into a matmul (SmolLM2's Q4_1
// and Q8_0 shapes, benchmarks/RESULTS.md): 5 where bf16 panels take more (AVX512-BF16), else 16.
constexpr int64_t kIntegerRowsMaxBf16 = 5, kIntegerRowsMax = 16;
constexpr int64_t kChunkElements = 1 << 22;  // weights dequantized per matmul (16 MiB fp32)
// Rows of x that share one decode of a weight row, at most: m rows run as ceil(m / 5) tiles of
// sizes differing by one at most (5 rows as one tile, not 4 + 1: each tile decodes the weights
// again, which costs about as much as two rows' dot products).
constexpr int64_t kTileRows = 5;

using namespace quant;  // the formats and their integer building blocks

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
  const int64_t tiles = (m + kTileRows - 1) / kTileRows;
  for (int64_t tile = 0, first = 0, rows = 0; tile < tiles; ++tile, first += rows) {
    rows = (m - first + (tiles - tile) - 1) / (tiles - tile);  // the rest, shared evenly
    if constexpr (WR == kTileWeightRows) {  // one row of x only
      dot_tile<F, WR, 1>(wrows, row_bytes, x, first, scratch, sums);
    } else {
      switch (rows) {
        case 5: dot_tile<F, WR, 5>(wrows, row_bytes, x, first, scratch, sums); break;
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
// c[Slots - 1] for 16-31) as fp32 at `out` (for torch's fp32 matmul).
template <bool Signed, int Slots>
inline void write_part(Quants quants, const float* a, const float* c, float* out) {
#if defined(__AVX2__)
  for (int quarter = 0; quarter < 4; ++quarter) {
    const __m128i bytes = quarter < 2 ? _mm256_castsi256_si128(quants)
                                      : _mm256_extracti128_si256(quants, 1);
    const __m128i eight = quarter % 2 ? _mm_srli_si128(bytes, 8) : bytes;
    const __m256i ints = Signed ? _mm256_cvtepi8_epi32(eight) : _mm256_cvtepu8_epi32(eight);
    const int t = quarter < 2 ? 0 : Slots - 1;
    _mm256_storeu_ps(out + 8 * quarter,
                     _mm256_fmadd_ps(_mm256_cvtepi32_ps(ints), _mm256_set1_ps(a[t]),
                                     _mm256_set1_ps(c[t])));
  }
#else
  uint8_t q[32];
  store_quants(quants, q);
  for (int half = 0; half < 2; ++half) {
    const float scale = a[half * (Slots - 1)], offset = c[half * (Slots - 1)];
    for (int e = 16 * half; e < 16 * half + 16; ++e) {
      const float value = Signed ? static_cast<float>(static_cast<int8_t>(q[e])) : q[e];
      out[e] = scale * value + offset;
    }
  }
#endif
}

#if defined(__AVX512BF16__)
// The same as bf16, rounded to nearest even (for the bf16 panels), sixteen weights at a time.
template <bool Signed, int Slots>
inline void write_part(Quants quants, const float* a, const float* c, c10::BFloat16* out) {
  for (int half = 0; half < 2; ++half) {
    const __m128i bytes =
        half ? _mm256_extracti128_si256(quants, 1) : _mm256_castsi256_si128(quants);
    const __m512i ints = Signed ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes);
    const int t = half ? Slots - 1 : 0;
    const __m512 values = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ints), _mm512_set1_ps(a[t]),
                                          _mm512_set1_ps(c[t]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16 * half),
                        (__m256i)_mm512_cvtneps_pbh(values));
  }
}
#endif

// One weight row of `blocks` blocks dequantized to W (fp32, or bf16 on AVX512-BF16) at `out`.
template <class F, typename W>
inline void dequantize_row(const uint8_t* row, int64_t blocks, W* out) {
  float a[F::kParts * F::kSlots], c[F::kParts * F::kSlots];
  for (int64_t s = 0; s < blocks; ++s) {
    const uint8_t* block = row + s * F::kBytes;
    F::scales(block, a, c);
    for (int j = 0; j < F::kParts; ++j) {
      write_part<F::kSigned, F::kSlots>(F::quants(block, j), a + j * F::kSlots,
                                        c + j * F::kSlots, out + (s * F::kParts + j) * 32);
    }
  }
}

// Weight rows [0, rows) of `w` dequantized to rows of `k` fp32 values at `out`.
template <class F>
void dequantize_rows(const uint8_t* w, int64_t row_bytes, int64_t rows, int64_t k, float* out) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      dequantize_row<F>(w + row * row_bytes, row_bytes / F::kBytes, out + row * k);
    }
  });
}

// x times chunks of weight rows dequantized into torch's fp32 matmul.
template <class F>
void dequantized_matmul(const at::Tensor& x, const at::Tensor& qweight, int64_t k,
                        const at::Tensor& bias, at::Tensor& out) {
  const at::Tensor xf = x.to(at::kFloat);
  const int64_t n = qweight.size(0), row_bytes = qweight.size(1);
  const int64_t chunk = std::max<int64_t>(16, kChunkElements / std::max<int64_t>(1, k));
  at::Tensor weights = new_tensor({std::min(chunk, n), k}, at::kFloat);
  const uint8_t* w = qweight.data_ptr<uint8_t>();
  for (int64_t start = 0; start < n; start += chunk) {
    const int64_t len = std::min(chunk, n - start);
    dequantize_rows<F>(w + start * row_bytes, row_bytes, len, k, weights.data_ptr<float>());
    at::Tensor part = xf.mm(weights.narrow(0, 0, len).t());
    if (bias.defined()) part.add_(bias.narrow(0, start, len));
    out.narrow(1, start, len).copy_(part);
  }
}

#if defined(__AVX512BF16__)
// bf16 x times weight rows dequantized a panel at a time (bf16_panel_gemm.h).
template <class F>
void panel_matmul(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& bias,
                  at::Tensor& out) {
  const int64_t row_bytes = qweight.size(1), k = x.size(1);
  const uint8_t* w = qweight.data_ptr<uint8_t>();
  const auto fill = [&](int64_t row, int64_t rows, uint16_t* panel) {
    for (int64_t r = 0; r < rows; ++r) {
      dequantize_row<F>(w + (row + r) * row_bytes, row_bytes / F::kBytes,
                        reinterpret_cast<c10::BFloat16*>(panel + r * k));
    }
  };
  bf16_gemm::panel_matmul(reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>()),
                          x.size(0), x.stride(0), k, qweight.size(0),
                          bias.defined() ? bias.data_ptr<float>() : nullptr, fill,
                          reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>()));
}
#endif

template <class F>
at::Tensor run(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& bias) {
  const int64_t m = x.size(0), k = x.size(1), n = qweight.size(0), row_bytes = qweight.size(1);
  constexpr int64_t block_weights = 32 * F::kParts;
  TORCH_CHECK(row_bytes % F::kBytes == 0 && row_bytes / F::kBytes * block_weights == k,
              "quantized_linear: weight rows of ", row_bytes, " bytes do not hold ", k,
              " weights in whole blocks");
  at::Tensor out = new_tensor({m, n}, x.scalar_type());
  if (m == 0 || n == 0) return out;
#if defined(__AVX512BF16__)
  const bool panels = x.scalar_type() == at::kBFloat16;
#else
  constexpr bool panels = false;
#endif
  if (m > (panels ? kIntegerRowsMaxBf16 : kIntegerRowsMax)) {
#if defined(__AVX512BF16__)
    if (panels) {
      panel_matmul<F>(x, qweight, bias, out);
      return out;
    }
#endif
    dequantized_matmul<F>(x, qweight, k, bias, out);
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
