// Registers the kernels as torch.ops.platform_core_cpu.* (no pybind11: keeps the build short).

#include <torch/library.h>

#include "cpu_kernels.h"

TORCH_LIBRARY(platform_core_cpu, m) {
  m.def(
      "paged_attention(Tensor query, Tensor kv_cache, Tensor query_start_loc, Tensor seq_lens, "
      "Tensor block_tables, float scale, Tensor(a!) out) -> ()",
      &platform_core_cpu::paged_attention);
  m.def("write_kv(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()",
        &platform_core_cpu::write_kv);
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &platform_core_cpu::rms_norm);
  m.def("silu_and_mul(Tensor x) -> Tensor", &platform_core_cpu::silu_and_mul);
  m.def("gemv_bf16(Tensor x, Tensor weight, Tensor? bias) -> Tensor",
        &platform_core_cpu::gemv_bf16);
  m.def("gemv_supported() -> bool", &platform_core_cpu::gemv_supported);
  m.def("argmax_rows(Tensor x) -> Tensor", &platform_core_cpu::argmax_rows);
  m.def("rotary(Tensor(a!) query, Tensor(b!) key, Tensor cos, Tensor sin) -> ()",
        &platform_core_cpu::rotary);
}
