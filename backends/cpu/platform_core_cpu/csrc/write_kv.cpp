// Scatter of new keys/values into the paged cache's tiles (layout: paged_attention.cpp).

#include "cpu_kernels.h"

#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace platform_core_cpu {
namespace {

// Element bits (E) and the word holding a pair of them (P).
template <typename E>
using PairOf = std::conditional_t<sizeof(E) == 2, uint32_t, uint64_t>;

// Writes one token's key row at `offset` of its key tile: one pair word per dimension pair.
template <typename E>
void write_key(const E* key, E* key_tile, int64_t offset, int64_t head_size, int64_t block_size) {
  using P = PairOf<E>;
  auto* dst = reinterpret_cast<P*>(key_tile) + offset;
  for (int64_t p = 0; p < head_size / 2; ++p) {
    P word;
    std::memcpy(&word, key + 2 * p, sizeof word);
    dst[p * block_size] = word;
  }
}

// Writes the value rows of the tokens at `offset` and, if `next` is given, `offset + 1`
// (offset even): their pair row is then written whole, one word per dimension.
template <typename E>
void write_values(const E* value, const E* next, E* value_tile, int64_t offset,
                  int64_t head_size) {
  using P = PairOf<E>;
  constexpr int kBits = 8 * sizeof(E);
  E* row = value_tile + 2 * (offset / 2) * head_size;
  if (next != nullptr) {
    auto* dst = reinterpret_cast<P*>(row);
    for (int64_t d = 0; d < head_size; ++d) {
      dst[d] = static_cast<P>(value[d]) | (static_cast<P>(next[d]) << kBits);
    }
    return;
  }
  for (int64_t d = 0; d < head_size; ++d) row[2 * d + offset % 2] = value[d];
}

template <typename E>
void scatter(const at::Tensor& key, const at::Tensor& value, const at::Tensor& kv_cache,
             const int64_t* slots) {
  const int64_t tokens = key.size(0), heads = key.size(1), head_size = key.size(2);
  const int64_t block_size = kv_cache.size(3) / head_size;
  const auto* keys = static_cast<const E*>(key.data_ptr());
  const auto* values = static_cast<const E*>(value.data_ptr());
  auto* cache = static_cast<E*>(kv_cache.data_ptr());
  at::parallel_for(0, tokens, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slots[t] < 0) continue;  // padding token
      const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
      // A prefill's tokens come in slot order: an even slot and the next one share value words.
      const bool pair = offset % 2 == 0 && t + 1 < end && slots[t + 1] == slots[t] + 1;
      for (int64_t h = 0; h < heads; ++h) {
        E* tile = cache + block * kv_cache.stride(1) + h * kv_cache.stride(2);
        const E* k = keys + t * key.stride(0) + h * key.stride(1);
        const E* v = values + t * value.stride(0) + h * value.stride(1);
        write_key(k, tile, offset, head_size, block_size);
        if (pair) write_key(k + key.stride(0), tile, offset + 1, head_size, block_size);
        write_values(v, pair ? v + value.stride(0) : nullptr, tile + kv_cache.stride(0), offset,
                     head_size);
      }
      t += pair;
    }
  });
}

}  // namespace

void write_kv(const at::Tensor& key, const at::Tensor& value, const at::Tensor& kv_cache,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(kv_cache.dim() == 4 && kv_cache.size(0) == 2, "kv_cache: [2, NB, KVH, BS * D]");
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes(), "key/value: [tokens, KVH, D]");
  const int64_t head_size = key.size(2);
  TORCH_CHECK(key.size(1) == kv_cache.size(2) && head_size % 2 == 0 &&
                  kv_cache.size(3) % (2 * head_size) == 0,
              "key/value heads or head size do not fit the cache tiles");
  TORCH_CHECK(key.scalar_type() == kv_cache.scalar_type() &&
                  value.scalar_type() == kv_cache.scalar_type(),
              "key/value must have the cache's dtype");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1 && kv_cache.stride(3) == 1,
              "the head dimension and the cache tiles must be contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == key.size(0),
              "slot_mapping: contiguous int64 [tokens]");
  const int64_t num_slots = kv_cache.size(1) * (kv_cache.size(3) / head_size);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < key.size(0); ++t) {
    TORCH_CHECK(slots[t] < num_slots, "slot ", slots[t], " is past the cache's ", num_slots);
  }
  switch (kv_cache.element_size()) {
    case 2: return scatter<uint16_t>(key, value, kv_cache, slots);
    case 4: return scatter<uint32_t>(key, value, kv_cache, slots);
    default: TORCH_CHECK(false, "unsupported cache dtype ", kv_cache.scalar_type());
  }
}

}  // namespace platform_core_cpu
