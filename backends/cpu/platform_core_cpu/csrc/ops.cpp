// Registers the kernels as torch.ops.<PLATFORM_CORE_CPU_NAMESPACE>.* (no pybind11: keeps the
// build short). Each ISA level's build names its own namespace (kernels.py passes it), so one
// process can load several builds side by side.

#include <torch/library.h>

#include "cpu_kernels.h"

#ifndef PLATFORM_CORE_CPU_NAMESPACE
#error "build with -DPLATFORM_CORE_CPU_NAMESPACE=<namespace> (kernels.py does)"
#endif

// One more macro level, so that the namespace macro expands before TORCH_LIBRARY pastes it.
#define PLATFORM_CORE_CPU_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)

PLATFORM_CORE_CPU_LIBRARY(PLATFORM_CORE_CPU_NAMESPACE, m) {
  m.def(
      "paged_attention(Tensor query, Tensor kv_cache, Tensor query_start_loc, Tensor seq_lens, "
      "Tensor block_tables, float scale, Tensor(a!) out) -> ()",
      &platform_core_cpu::paged_attention);
  m.def("write_kv(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()",
        &platform_core_cpu::write_kv);
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &platform_core_cpu::rms_norm);
  m.def("silu_and_mul(Tensor x) -> Tensor", &platform_core_cpu::silu_and_mul);
  m.def("linear_bf16(Tensor x, Tensor weight, Tensor? bias) -> Tensor",
        &platform_core_cpu::linear_bf16);
  m.def("quantized_linear(Tensor x, Tensor qweight, str format, Tensor? bias) -> Tensor",
        &platform_core_cpu::quantized_linear);
  m.def("argmax_rows(Tensor x) -> Tensor", &platform_core_cpu::argmax_rows);
  m.def("apply_token_bitmask(Tensor(a!) logits, Tensor bitmask, Tensor rows) -> ()",
        &platform_core_cpu::apply_token_bitmask);
  m.def("lora_shrink(Tensor x, Tensor lora_a, Tensor token_slots, Tensor(a!) out) -> ()",
        &platform_core_cpu::lora_shrink);
  m.def(
      "lora_expand(Tensor(a!) out, Tensor buffer, Tensor lora_bt, Tensor token_slots, "
      "int[] slice_sizes) -> ()",
      &platform_core_cpu::lora_expand);
  m.def("rotary(Tensor(a!) query, Tensor(b!) key, Tensor cos, Tensor sin) -> ()",
        &platform_core_cpu::rotary);
}
