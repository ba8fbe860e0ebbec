// Row-wise argmax of float32 logits, as torch.argmax(dim=-1) answers it (the first maximal
// index; the first NaN if a row holds one), vectorized and split across threads by rows:
// torch's own kernel scans one element at a time.

#include "cpu_kernels.h"
#include "vec_math.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <cmath>
#include <limits>

namespace platform_core_cpu {
namespace {

int64_t row_argmax(const float* x, int64_t n) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  vec16 best = splat(kNegInf);
  ivec16 best_at = {};
  ivec16 at = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  ivec16 nan_seen = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes, at += kLanes) {
    const vec16 v = load16(x + i);
    nan_seen |= (v != v);
    const ivec16 better = v > best;  // strict: each lane keeps its first maximum
    best = better ? v : best;
    best_at = better ? at : best_at;
  }
  float value = kNegInf;
  int64_t index = -1;  // lanes that saw only -inf keep index 0: right when the row is all -inf
  for (int64_t lane = 0; i > 0 && lane < kLanes; ++lane) {
    if (index < 0 || best[lane] > value || (best[lane] == value && best_at[lane] < index)) {
      value = best[lane];
      index = best_at[lane];
    }
  }
  bool has_nan = false;
  for (int64_t lane = 0; lane < kLanes; ++lane) has_nan |= nan_seen[lane] != 0;
  for (int64_t j = i; j < n; ++j) {  // the tail
    has_nan |= std::isnan(x[j]);
    if (index < 0 || x[j] > value) {
      value = x[j];
      index = j;
    }
  }
  if (has_nan) {
    for (int64_t j = 0; j < n; ++j) {
      if (std::isnan(x[j])) return j;
    }
  }
  return index < 0 ? 0 : index;
}

}  // namespace

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kFloat,
              "argmax_rows: float32 [rows, n] with contiguous rows");
  TORCH_CHECK(x.size(1) > 0, "argmax_rows: rows must not be empty");
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* src = x.data_ptr<float>();
  int64_t* dst = out.data_ptr<int64_t>();
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / n);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) dst[r] = row_argmax(src + r * stride, n);
  });
  return out;
}

}  // namespace platform_core_cpu
