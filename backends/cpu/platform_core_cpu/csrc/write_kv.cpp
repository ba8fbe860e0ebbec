// Scatter of new keys/values into the paged cache, one token row per slot.

#include "cpu_kernels.h"

#include <ATen/Parallel.h>

#include <cstring>

namespace platform_core_cpu {

void write_kv(const at::Tensor& key, const at::Tensor& value, const at::Tensor& kv_cache,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2, "kv_cache: [2, NB, KVH, BS, D]");
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes(), "key/value: [tokens, KVH, D]");
  TORCH_CHECK(key.size(1) == kv_cache.size(2) && key.size(2) == kv_cache.size(4),
              "key/value heads or head size differ from the cache");
  TORCH_CHECK(key.scalar_type() == kv_cache.scalar_type() &&
                  value.scalar_type() == kv_cache.scalar_type(),
              "key/value must have the cache's dtype");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1 && kv_cache.stride(4) == 1,
              "the head dimension must be contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == key.size(0),
              "slot_mapping: contiguous int64 [tokens]");
  const int64_t tokens = key.size(0), heads = key.size(1), block_size = kv_cache.size(3);
  const int64_t num_slots = kv_cache.size(1) * block_size;
  const int64_t item = kv_cache.element_size();
  const size_t row_bytes = key.size(2) * item;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const auto* k_base = static_cast<const char*>(key.data_ptr());
  const auto* v_base = static_cast<const char*>(value.data_ptr());
  auto* cache = static_cast<char*>(kv_cache.data_ptr());
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slots[t] < num_slots, "slot ", slots[t], " is past the cache's ", num_slots);
  }
  at::parallel_for(0, tokens, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slots[t] < 0) continue;  // padding token
      const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
      char* dst = cache + (block * kv_cache.stride(1) + offset * kv_cache.stride(3)) * item;
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t h_dst = h * kv_cache.stride(2) * item;
        std::memcpy(dst + h_dst, k_base + (t * key.stride(0) + h * key.stride(1)) * item,
                    row_bytes);
        std::memcpy(dst + h_dst + kv_cache.stride(0) * item,
                    v_base + (t * value.stride(0) + h * value.stride(1)) * item, row_bytes);
      }
    }
  });
}

}  // namespace platform_core_cpu
