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
}
