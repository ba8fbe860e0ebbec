// bf16 matrix-vector products for one-row linears (batch-1 decode): y = x W^T (+ b) with x
// [1, K], W [N, K] row-major. Threads stream contiguous bands of W's rows once, with
// AVX512-BF16 dot steps and fp32 sums; each output rounds to bf16 once.

#include "cpu_kernels.h"
#include "vec_math.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

namespace platform_core_cpu {
namespace {

constexpr int64_t kRowsPerStep = 4;  // W rows whose dot products run side by side

#if defined(__AVX512BF16__)
// Dot products of x with W rows [0, count), count <= kRowsPerStep, into out.
void dot_rows(const uint16_t* x, const uint16_t* w, int64_t k, int64_t count, float* out) {
  __m512 acc[kRowsPerStep];
  for (int64_t i = 0; i < kRowsPerStep; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t c = 0; c < k; c += kBf16Pair) {
    const int64_t left = k - c;
    const __mmask32 mask = left >= kBf16Pair ? ~__mmask32{0} : (__mmask32{1} << left) - 1;
    const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + c);
    for (int64_t i = 0; i < kRowsPerStep; ++i) {
      if (i < count) {
        acc[i] = _mm512_dpbf16_ps(acc[i], xv, (__m512bh)_mm512_maskz_loadu_epi16(mask, w + i * k + c));
      }
    }
  }
  for (int64_t i = 0; i < count; ++i) out[i] = _mm512_reduce_add_ps(acc[i]);
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
  const int64_t grain = std::max<int64_t>(kRowsPerStep, (1 << 15) / std::max<int64_t>(1, k));
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    float sums[kRowsPerStep];
    for (int64_t n0 = begin; n0 < end; n0 += kRowsPerStep) {
      const int64_t count = std::min(kRowsPerStep, end - n0);
      dot_rows(xp, wp + n0 * k, k, count, sums);
      for (int64_t i = 0; i < count; ++i) {
        op[n0 + i] = from_float<c10::BFloat16>(sums[i] + (b ? b[n0 + i] : 0.0f));
      }
    }
  });
#endif
  return out;
}

}  // namespace platform_core_cpu
