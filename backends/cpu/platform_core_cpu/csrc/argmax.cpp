// Row-wise argmax of float32 or bf16 logits, as torch.argmax(dim=-1) answers it (the first
// maximal index; the first NaN if a row holds one), vectorized and split across threads by rows:
// torch's own kernel scans one element at a time.

#include "cpu_kernels.h"
#include "vec_math.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <limits>

namespace platform_core_cpu {
namespace {

constexpr int64_t kChunk = 16 * kLanes;  // elements per chunk: sixteen vectors

inline float to_float(float x) { return x; }
inline float to_float(uint16_t bits) { return std::bit_cast<float>(uint32_t{bits} << 16); }

// Maximum of one full chunk; NaN lanes are skipped and reported through `nan_seen`. Four
// independent maxima keep the loads streaming.
inline float chunk_max(const float* x, veci& nan_seen) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  vecf m[4] = {splat(kNegInf), splat(kNegInf), splat(kNegInf), splat(kNegInf)};
  for (int64_t k = 0; k < kChunk; k += 4 * kLanes) {
    for (int u = 0; u < 4; ++u) {
      const vecf v = loadv(x + k + u * kLanes);
      nan_seen |= (v != v);
      m[u] = vmax(v, m[u]);  // a NaN `v` compares false and leaves the maximum as it was
    }
  }
  return hmax(vmax(vmax(m[0], m[1]), vmax(m[2], m[3])));
}

// The same over bf16 bit patterns, widened 32 at a time (even and odd elements apart: order
// inside a chunk does not matter for its maximum).
inline float chunk_max(const uint16_t* x, veci& nan_seen) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  vecf m[4] = {splat(kNegInf), splat(kNegInf), splat(kNegInf), splat(kNegInf)};
  for (int64_t k = 0; k < kChunk; k += 4 * kLanes) {
    for (int u = 0; u < 2; ++u) {
      vecf even, odd;
      load_pairs(x + k + 2 * u * kLanes, kLanes, even, odd);
      nan_seen |= (even != even) | (odd != odd);
      m[2 * u] = vmax(even, m[2 * u]);
      m[2 * u + 1] = vmax(odd, m[2 * u + 1]);
    }
  }
  return hmax(vmax(vmax(m[0], m[1]), vmax(m[2], m[3])));
}

// The first maximal index of x[0, n): the first NaN if there is one. The scan keeps only each
// chunk's maximum (no index bookkeeping in the loop), then finds the first chunk holding the
// row's maximum and the first position within it.
template <typename T>
int64_t row_argmax(const T* x, int64_t n) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  veci nan_seen = {};
  float best = kNegInf;
  int64_t best_chunk = 0;
  const int64_t num_chunks = n / kChunk;
  for (int64_t c = 0; c < num_chunks; ++c) {
    const float m = chunk_max(x + c * kChunk, nan_seen);
    if (m > best) {  // strict: ties keep the earlier chunk
      best = m;
      best_chunk = c;
    }
  }
  bool has_nan = false;
  for (int64_t lane = 0; lane < kLanes; ++lane) has_nan |= nan_seen[lane] != 0;
  int64_t index = -1;
  for (int64_t j = num_chunks * kChunk; j < n; ++j) {  // the tail, one element at a time
    const float v = to_float(x[j]);
    has_nan |= std::isnan(v);
    if (v > best) {
      best = v;
      index = j;
    }
  }
  if (has_nan) {
    for (int64_t j = 0; j < n; ++j) {
      if (std::isnan(to_float(x[j]))) return j;
    }
  }
  if (index >= 0) return index;
  if (num_chunks == 0) return 0;  // a short row of -inf only
  for (int64_t j = best_chunk * kChunk;; ++j) {
    if (to_float(x[j]) == best) return j;
  }
}

template <typename T>
void argmax_rows_of(const T* src, int64_t rows, int64_t n, int64_t stride, int64_t* dst) {
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / n);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) dst[r] = row_argmax(src + r * stride, n);
  });
}

}  // namespace

at::Tensor argmax_rows(const at::Tensor& x) {
  const bool is_float = x.scalar_type() == at::kFloat;
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && (is_float || x.scalar_type() == at::kBFloat16),
              "argmax_rows: float32 or bfloat16 [rows, n] with contiguous rows");
  TORCH_CHECK(x.size(1) > 0, "argmax_rows: rows must not be empty");
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  at::Tensor out = new_tensor({rows}, at::kLong);
  int64_t* dst = out.data_ptr<int64_t>();
  if (is_float) {
    argmax_rows_of(x.data_ptr<float>(), rows, n, stride, dst);
  } else {
    argmax_rows_of(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), rows, n,
                   stride, dst);
  }
  return out;
}

}  // namespace platform_core_cpu
