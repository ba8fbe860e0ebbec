// bf16 linears y = x W^T (+ b) with x [M, K] and W [N, K] row-major, both bf16: fp32 sums, each
// output rounded to bf16 once. Threads take contiguous bands of W's rows, so the weights stream
// from memory once per call whatever M is (decode is bound by reading them).
// - One row (batch-1 decode): on AVX512-BF16 builds, dot steps on bf16 pairs (vdpbf16ps); on
//   others, the widened path below. Every level takes one row here, even where oneDNN has bf16.
// - Up to kWidenedRowsMax rows: the weights widen to fp32 in registers (a 16-bit shift) and
//   meet x, widened once up front, in FMAs; tiles of up to four x rows by two weight rows share
//   each load.
// - More rows (prefill) are bound by arithmetic, not by reading weights: chunks of weight rows,
//   small enough to stay in cache, widen to fp32 and go through torch's fp32 matmul (MKL or
//   oneDNN), which reaches more of the FMA peak than the tiles above (benchmarks/RESULTS.md).
// The last two are the bf16 path of CPUs whose oneDNN has none (AVX2 without AVX-NE-CONVERT).

#include "cpu_kernels.h"
#include "vec_math.h"

#include <ATen/Parallel.h>

#include <vector>

namespace platform_core_cpu {
namespace {

constexpr int64_t kWidenedRowsMax = 32;
// Weight elements a one-row stream asks for ahead of use (4 KiB): widening takes several
// instructions per cache line, so the out-of-order window alone keeps too few lines in flight
// to cover memory latency (on AVX2, SmolLM2's output head: 6.0 -> 3.6 ms; RESULTS.md).
constexpr int64_t kStreamAhead = 2048;
constexpr int64_t kChunkElements = 1 << 18;  // fp32 weights widened per matmul: 1 MiB

inline float bf16_bits_to_float(uint16_t bits) { return std::bit_cast<float>(uint32_t{bits} << 16); }

// sums[i][j] = x row i . W row j for MR rows of x (fp32, leading dimension ldx) and NR rows of W.
template <int MR, int NR>
inline void dot_tile(const float* x, int64_t ldx, const uint16_t* w, int64_t k,
                     float (&sums)[4][2]) {
  vecf acc[MR][NR] = {};
  int64_t c = 0;
  for (; c + kLanes <= k; c += kLanes) {
    vecf wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = widen(w + j * k + c);
    for (int i = 0; i < MR; ++i) {
      const vecf xv = loadv(x + i * ldx + c);
      for (int j = 0; j < NR; ++j) acc[i][j] += xv * wv[j];
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NR; ++j) {
      float sum = hsum(acc[i][j]);
      for (int64_t t = c; t < k; ++t) sum += x[i * ldx + t] * bf16_bits_to_float(w[j * k + t]);
      sums[i][j] = sum;
    }
  }
}

// x . one W row, for one-row linears, with x split into its even (xe) and odd (xo) elements
// as fp32: a weight vector of 2 * kLanes bf16 is kLanes 32-bit pairs that widen in two integer
// operations (the low half shifted up, the high half masked), a third of the instructions of
// widening in order. One front-to-back stream of the row (see dot_row_bf16) and four
// accumulators, so that four FMA chains are in flight.
float dot_row_widened(const float* xe, const float* xo, const uint16_t* w, int64_t k) {
  constexpr int64_t kStep = 4 * kLanes;  // bf16 elements per iteration: two pair vectors
  vecf acc[4] = {};
  int64_t c = 0;
  for (; c + kStep <= k; c += kStep) {
    __builtin_prefetch(w + c + kStreamAhead);
    for (int u = 0; u < 2; ++u) {
      const int64_t at = c + 2 * u * kLanes;
      vecf even, odd;
      load_pairs(w + at, kLanes, even, odd);
      acc[2 * u] += loadv(xe + at / 2) * even;
      acc[2 * u + 1] += loadv(xo + at / 2) * odd;
    }
  }
  float sum = hsum((acc[0] + acc[1]) + (acc[2] + acc[3]));
  for (; c < k; ++c) sum += (c % 2 ? xo : xe)[c / 2] * bf16_bits_to_float(w[c]);
  return sum;
}

template <int MR>
inline void dot_rows(const float* x, int64_t ldx, const uint16_t* w, int64_t k, int nr,
                     float (&sums)[4][2]) {
  if (nr == 2) {
    dot_tile<MR, 2>(x, ldx, w, k, sums);
  } else {
    dot_tile<MR, 1>(x, ldx, w, k, sums);
  }
}

// Widened-weight path: rows [begin, end) of W against every row of x (fp32, [m, k]).
void widened_band(const float* x, int64_t m, const uint16_t* w, int64_t k, const float* bias,
                  int64_t n, int64_t begin, int64_t end, c10::BFloat16* out) {
  float sums[4][2];
  for (int64_t row = begin; row < end; row += 2) {
    const int nr = row + 1 < end ? 2 : 1;
    for (int64_t r = 0; r < m; r += 4) {
      const float* xr = x + r * k;
      const uint16_t* wr = w + row * k;
      switch (std::min<int64_t>(4, m - r)) {
        case 4: dot_rows<4>(xr, k, wr, k, nr, sums); break;
        case 3: dot_rows<3>(xr, k, wr, k, nr, sums); break;
        case 2: dot_rows<2>(xr, k, wr, k, nr, sums); break;
        default: dot_rows<1>(xr, k, wr, k, nr, sums); break;
      }
      for (int64_t i = 0; i < std::min<int64_t>(4, m - r); ++i) {
        for (int j = 0; j < nr; ++j) {
          const float b = bias ? bias[row + j] : 0.0f;
          out[(r + i) * n + row + j] = from_float<c10::BFloat16>(sums[i][j] + b);
        }
      }
    }
  }
}

#if defined(__AVX512BF16__)
// Dot product of x with one W row. Rows are read one after another, front to back, so each
// thread's band is one linear stream: reading four rows side by side (an earlier version)
// streamed 21-22 GB/s where this reaches 27-28 on the same weights. Four accumulators keep
// four dot steps in flight.
float dot_row_bf16(const uint16_t* x, const uint16_t* w, int64_t k) {
  constexpr int64_t kStep = 4 * kBf16Pair;
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                   _mm512_setzero_ps()};
  int64_t c = 0;
  for (; c + kStep <= k; c += kStep) {
    for (int64_t i = 0; i < 4; ++i) {
      const int64_t at = c + i * kBf16Pair;
      acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_loadu_si512(x + at),
                                (__m512bh)_mm512_loadu_si512(w + at));
    }
  }
  for (; c < k; c += kBf16Pair) {
    const int64_t left = k - c;
    const __mmask32 mask = left >= kBf16Pair ? ~__mmask32{0} : (__mmask32{1} << left) - 1;
    acc[0] = _mm512_dpbf16_ps(acc[0], (__m512bh)_mm512_maskz_loadu_epi16(mask, x + c),
                              (__m512bh)_mm512_maskz_loadu_epi16(mask, w + c));
  }
  return _mm512_reduce_add_ps(
      _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
}
#endif

// x times chunks of W widened to fp32, through torch's fp32 matmul.
void widened_matmul(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                    at::Tensor& out) {
  const at::Tensor xf = x.to(at::kFloat);
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t rows = std::max<int64_t>(16, kChunkElements / std::max<int64_t>(1, k));
  for (int64_t start = 0; start < n; start += rows) {
    const int64_t len = std::min(rows, n - start);
    at::Tensor part = xf.mm(weight.narrow(0, start, len).to(at::kFloat).t());
    if (bias.defined()) part.add_(bias.narrow(0, start, len));
    out.narrow(1, start, len).copy_(part);
  }
}

}  // namespace

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& weight,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "linear_bf16: x [M, K] with contiguous rows");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.size(1) == x.size(1),
              "linear_bf16: contiguous weight [N, K] matching x");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16,
              "linear_bf16: bfloat16 x and weight");
  const int64_t m = x.size(0), n = weight.size(0), k = weight.size(1);
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "linear_bf16: bias [N]");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  at::Tensor out = new_tensor({m, n}, x.scalar_type());
  if (m == 0 || n == 0) return out;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr<c10::BFloat16>());
  const float* b = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  auto* op = out.data_ptr<c10::BFloat16>();
  // At least 64 KiB of weights per task: smaller ones cost more to hand out than they save.
  const int64_t grain = std::max<int64_t>(2, (1 << 15) / std::max<int64_t>(1, k));
#if defined(__AVX512BF16__)
  if (m == 1) {
    at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) {
        op[row] = from_float<c10::BFloat16>(dot_row_bf16(xp, wp + row * k, k) + (b ? b[row] : 0.0f));
      }
    });
    return out;
  }
#endif
  if (m > kWidenedRowsMax) {
    widened_matmul(x, weight, bias_f, out);
    return out;
  }
  if (m == 1) {
    const int64_t half = (k + 1) / 2;
    std::vector<float> xe(half), xo(half);
    for (int64_t c = 0; c < k; ++c) (c % 2 ? xo : xe)[c / 2] = bf16_bits_to_float(xp[c]);
    at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) {
        const float sum = dot_row_widened(xe.data(), xo.data(), wp + row * k, k);
        op[row] = from_float<c10::BFloat16>(sum + (b ? b[row] : 0.0f));
      }
    });
    return out;
  }
  std::vector<float> xf(m * k);
  const int64_t ldx = x.stride(0);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t c = 0; c < k; ++c) xf[r * k + c] = bf16_bits_to_float(xp[r * ldx + c]);
  }
  // Bands start at even rows so that every thread's weight-row pairs are whole.
  at::parallel_for(0, (n + 1) / 2, std::max<int64_t>(1, grain / 2), [&](int64_t begin, int64_t end) {
    widened_band(xf.data(), m, wp, k, b, n, 2 * begin, std::min(n, 2 * end), op);
  });
  return out;
}

}  // namespace platform_core_cpu
