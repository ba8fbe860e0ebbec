// bf16 matrix-vector products for one-row linears (batch-1 decode): y = x W^T (+ b) with x
// [1, K], W [N, K] row-major. Threads stream contiguous bands of W's rows once, with
// AVX512-BF16 dot steps and fp32 sums; each output rounds to bf16 once.

#include "cpu_kernels.h"
#include "vec_math.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

namespace platform_core_cpu {
namespace {

#if defined(__AVX512BF16__)
// Dot product of x with one W row. Rows are read one after another, front to back, so each
// thread's band is one linear stream: reading four rows side by side (an earlier version)
// streamed 21-22 GB/s where this reaches 27-28 on the same weights. Four accumulators keep
// four dot steps in flight.
float dot_row(const uint16_t* x, const uint16_t* w, int64_t k) {
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

}  // namespace

bool gemv_supported() { return kHasBf16Dot; }

at::Tensor gemv_bf16(const at::Tensor& x, const at::Tensor& weight,
                     const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(kHasBf16Dot, "gemv_bf16 needs a CPU with AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && x.stride(1) == 1, "gemv_bf16: x [1, K]");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.size(1) == x.size(1),
              "gemv_bf16: contiguous weight [N, K] matching x");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16,
              "gemv_bf16: bfloat16 x and weight");
  const int64_t n = weight.size(0), k = weight.size(1);
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "gemv_bf16: bias [N]");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  at::Tensor out = at::empty({1, n}, x.options());
#if defined(__AVX512BF16__)
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr<c10::BFloat16>());
  const float* b = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  auto* op = out.data_ptr<c10::BFloat16>();
  // At least 64 KiB of weights per task: smaller ones cost more to hand out than they save.
  const int64_t grain = std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(1, k));
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float sum = dot_row(xp, wp + row * k, k);
      op[row] = from_float<c10::BFloat16>(sum + (b ? b[row] : 0.0f));
    }
  });
#endif
  return out;
}

}  // namespace platform_core_cpu
