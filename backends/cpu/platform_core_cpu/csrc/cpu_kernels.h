// Declarations shared by the CPU kernel translation units, and their element conversions.
#pragma once

#include <ATen/EmptyTensor.h>
#include <ATen/core/Tensor.h>

#include <bit>
#include <cstdint>

namespace platform_core_cpu {

// A new uninitialized CPU tensor; at::empty's header alone doubles a kernel file's compile time.
inline at::Tensor new_tensor(at::IntArrayRef sizes, at::ScalarType dtype) {
  return at::detail::empty_cpu(sizes, dtype, /*pin_memory=*/false, std::nullopt);
}

// Causal paged attention over a flattened batch of prefill chunks and decodes; writes `out`.
void paged_attention(const at::Tensor& query, const at::Tensor& kv_cache,
                     const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                     const at::Tensor& block_tables, double scale, const at::Tensor& out);

// Scatters key/value [tokens, kv_heads, head_size] into the cache; slots of -1 are skipped.
void write_kv(const at::Tensor& key, const at::Tensor& value, const at::Tensor& kv_cache,
              const at::Tensor& slot_mapping);

// RMS norm of each row of x [rows, hidden] (contiguous rows), scaled by weight; a new tensor.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// silu(gate) * up for x [rows, 2 * d] = [gate | up] (contiguous rows); a new [rows, d] tensor.
at::Tensor silu_and_mul(const at::Tensor& x);

// Rotates query/key [tokens, heads, head_size] in place by cos/sin [tokens, head_size / 2].
void rotary(const at::Tensor& query, const at::Tensor& key, const at::Tensor& cos,
            const at::Tensor& sin);

// x [M, K] times weight [N, K]^T (+ bias) for bf16 x and weight with fp32 sums; bf16 [M, N].
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& weight,
                       const c10::optional<at::Tensor>& bias);

// x [M, K] (float32 or bf16, contiguous rows) times weights kept as GGML blocks of `format`
// (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K; uint8 [N, row_bytes]) transposed (+ bias); x's dtype [M, N].
at::Tensor quantized_linear(const at::Tensor& x, const at::Tensor& qweight,
                            c10::string_view format, const c10::optional<at::Tensor>& bias);

// torch.argmax(x, dim=-1) for float32 x [rows, n] with contiguous rows; int64 [rows].
at::Tensor argmax_rows(const at::Tensor& x);

// Sets logits[rows[i], t] = -inf where bit t % 32 of bitmask[i, t / 32] is clear, for float32
// logits [R, V] (contiguous rows), int32 bitmask [n, >= ceil(V / 32)], int64 rows [n].
void apply_token_bitmask(const at::Tensor& logits, const at::Tensor& bitmask,
                         const at::Tensor& rows);

// LoRA shrink: out[t] = lora_a[slot(t)] (as [S * R, in]) @ x[t] for float32 out [T, S * R],
// zero rows for tokens of slot -1; x [T, in] and lora_a [L, S, R, in] float32 or bf16.
void lora_shrink(const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& token_slots,
                 const at::Tensor& out);

// LoRA expand: out[t, part s] += buffer[s, t] @ lora_b[slot(t), rows of part s].T in place,
// summed in float32 and rounded once to out's dtype (float32 or bf16), for tokens with a slot.
// B comes transposed: lora_bt [L, R, W] float32 or bf16, lora_bt[l, r, n] = lora_b[l, n, r]
// for the N columns of out, zeros from N to W (W a multiple of 16, at least N + 64: reads run
// past the last column of a chunk by up to 63).
void lora_expand(const at::Tensor& out, const at::Tensor& buffer, const at::Tensor& lora_bt,
                 const at::Tensor& token_slots, at::IntArrayRef slice_sizes);

// Element conversions written on raw bits so that loops over them vectorize.
template <typename T>
inline float to_float(T x) {
  return static_cast<float>(x);
}

template <>
inline float to_float<c10::BFloat16>(c10::BFloat16 x) {
  return std::bit_cast<float>(static_cast<uint32_t>(x.x) << 16);
}

template <typename T>
inline T from_float(float x) {
  return static_cast<T>(x);
}

template <>
inline c10::BFloat16 from_float<c10::BFloat16>(float x) {
  // Round to nearest even; NaN keeps a quiet-NaN pattern.
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  c10::BFloat16 out;
  out.x = (x != x) ? uint16_t{0x7FC0}
                   : static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
  return out;
}

}  // namespace platform_core_cpu
