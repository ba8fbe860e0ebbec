// Fused element-wise layer ops: RMS norm, SiLU-and-multiply and rotary embedding. Each reads
// its input once and rounds where the unfused torch ops round, so bf16 results match them
// (float32 math inside, one rounding per torch op that the default chain would run).

#include "cpu_kernels.h"
#include "vec_math.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <type_traits>

namespace platform_core_cpu {
namespace {

// Rows of work below which one thread does it all: waking the pool costs more.
constexpr int64_t kGrainElements = 1 << 15;

int64_t grain_rows(int64_t row_elements) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, row_elements));
}

// Rounds through T (a no-op for float): the rounding a torch op producing T applies.
template <typename T>
inline float round_to(float x) {
  return to_float(from_float<T>(x));
}


// kLanes elements of T as fp32.
template <typename T>
inline vecf loadv_as_float(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return loadv(p);
  } else {
    vecu16 raw;
    std::memcpy(&raw, p, sizeof raw);
    return std::bit_cast<vecf>(__builtin_convertvector(raw, veci) << 16);
  }
}

// x rounded to T's precision (round to nearest even), still as fp32; NaN stays NaN.
template <typename T>
inline vecf round_lanes(vecf x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    const veci bits = std::bit_cast<veci>(x);
    const veci rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & static_cast<int32_t>(0xFFFF0000);
    return x != x ? x : std::bit_cast<vecf>(rounded);
  }
}

// Stores kLanes fp32 values already rounded to T's precision.
template <typename T>
inline void storev_rounded(T* p, vecf x) {
  if constexpr (std::is_same_v<T, float>) {
    storev(p, x);
  } else {
    const vecu16 raw = __builtin_convertvector(
        static_cast<veci>(std::bit_cast<veci>(x) >> 16) & 0xFFFF, vecu16);
    std::memcpy(p, &raw, sizeof raw);
  }
}

template <typename T>
void rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, double eps,
                   const at::Tensor& out) {
  const int64_t rows = x.size(0), dim = x.size(1), in_stride = x.stride(0);
  const T* src = x.data_ptr<T>();
  const T* w = weight.data_ptr<T>();
  T* dst = out.data_ptr<T>();
  at::parallel_for(0, rows, grain_rows(dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* in = src + r * in_stride;
      float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < dim; ++i) squares += to_float(in[i]) * to_float(in[i]);
      const float inv = 1.0f / std::sqrt(squares / static_cast<float>(dim) + static_cast<float>(eps));
      T* o = dst + r * dim;
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) {
        o[i] = from_float<T>(to_float(w[i]) * round_to<T>(to_float(in[i]) * inv));
      }
    }
  });
}

template <typename T>
void silu_and_mul_rows(const at::Tensor& x, const at::Tensor& out) {
  const int64_t rows = x.size(0), dim = out.size(1), in_stride = x.stride(0);
  const T* src = x.data_ptr<T>();
  T* dst = out.data_ptr<T>();
  at::parallel_for(0, rows, grain_rows(2 * dim), [&](int64_t begin, int64_t end) {
    float gate[kLanes];
    for (int64_t r = begin; r < end; ++r) {
      const T* g = src + r * in_stride;
      const T* u = g + dim;
      T* o = dst + r * dim;
      int64_t i0 = 0;
      for (; i0 + kLanes <= dim; i0 += kLanes) {
        const vecf v = loadv_as_float(g + i0);
        const vecf silu = round_lanes<T>(v / (1.0f + expv(-v)));
        storev_rounded(o + i0, round_lanes<T>(silu * loadv_as_float(u + i0)));
      }
      if (i0 == dim) continue;
      const int64_t n = dim - i0;  // the tail, through a padded buffer
      for (int64_t j = 0; j < kLanes; ++j) gate[j] = j < n ? to_float(g[i0 + j]) : 0.0f;
      const vecf v = loadv(gate);
      storev(gate, v / (1.0f + expv(-v)));
      for (int64_t j = 0; j < n; ++j) {
        o[i0 + j] = from_float<T>(round_to<T>(gate[j]) * to_float(u[i0 + j]));
      }
    }
  });
}

// Rotates x [tokens, heads, head_size] in place by cos/sin [tokens, head_size / 2].
template <typename T>
void rotate_in_place(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t tokens = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  T* base = x.data_ptr<T>();
  const T* c = cos.data_ptr<T>();
  const T* s = sin.data_ptr<T>();
  const int64_t ts = x.stride(0), hs = x.stride(1), cs = cos.stride(0), ss = sin.stride(0);
  at::parallel_for(0, tokens, grain_rows(heads * 2 * half), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* ct = c + t * cs;
      const T* st = s + t * ss;
      for (int64_t h = 0; h < heads; ++h) {
        T* first = base + t * ts + h * hs;
        T* second = first + half;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = to_float(first[i]), b = to_float(second[i]);
          const float co = to_float(ct[i]), si = to_float(st[i]);
          // The default op: first * cos - second * sin and second * cos + first * sin, each
          // product and sum rounded to T.
          first[i] = from_float<T>(round_to<T>(a * co) - round_to<T>(b * si));
          second[i] = from_float<T>(round_to<T>(b * co) + round_to<T>(a * si));
        }
      }
    }
  });
}

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, ": a 2-D tensor with contiguous rows");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, name,
              ": float32 or bfloat16, got ", x.scalar_type());
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm input");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(1) &&
                  weight.scalar_type() == x.scalar_type(),
              "rms_norm weight: contiguous [hidden] in the input's dtype");
  at::Tensor out = new_tensor(x.sizes(), x.scalar_type());
  if (x.scalar_type() == at::kFloat) {
    rms_norm_rows<float>(x, weight, eps, out);
  } else {
    rms_norm_rows<c10::BFloat16>(x, weight, eps, out);
  }
  return out;
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  check_rows(x, "silu_and_mul input");
  TORCH_CHECK(x.size(1) % 2 == 0, "silu_and_mul input: even last dimension (gate | up)");
  at::Tensor out = new_tensor({x.size(0), x.size(1) / 2}, x.scalar_type());
  if (x.scalar_type() == at::kFloat) {
    silu_and_mul_rows<float>(x, out);
  } else {
    silu_and_mul_rows<c10::BFloat16>(x, out);
  }
  return out;
}

void rotary(const at::Tensor& query, const at::Tensor& key, const at::Tensor& cos,
            const at::Tensor& sin) {
  for (const at::Tensor* t : {&query, &key}) {
    TORCH_CHECK(t->dim() == 3 && t->stride(2) == 1 && t->size(2) == 2 * cos.size(1) &&
                    t->size(0) == cos.size(0),
                "rotary: query/key [tokens, heads, 2 * cos.size(1)] with contiguous heads");
    TORCH_CHECK(t->scalar_type() == cos.scalar_type(), "rotary: one dtype for all inputs");
  }
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.stride(1) == 1 && sin.stride(1) == 1,
              "rotary: cos/sin [tokens, head_size / 2] with contiguous rows");
  TORCH_CHECK(sin.scalar_type() == cos.scalar_type(), "rotary: one dtype for all inputs");
  for (const at::Tensor* t : {&query, &key}) {
    if (t->scalar_type() == at::kFloat) {
      rotate_in_place<float>(*t, cos, sin);
    } else if (t->scalar_type() == at::kBFloat16) {
      rotate_in_place<c10::BFloat16>(*t, cos, sin);
    } else {
      TORCH_CHECK(false, "rotary: float32 or bfloat16, got ", t->scalar_type());
    }
  }
}

}  // namespace platform_core_cpu
