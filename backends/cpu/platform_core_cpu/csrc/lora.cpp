// LoRA shrink and expand over a step's tokens, each read with its own adapter slot, in place: no
// gathered copies of the tokens, no per-token copies of the adapter weights, no scatter back.
//
// Tokens are grouped by slot here (a counting pass over token_slots), and the work is split into
// items of one slot each, so an item's weights stay in cache while it runs over its tokens:
// - shrink: a tile of up to four tokens of one slot against a block of A's rows; each A vector
//   loaded once meets every token of the tile (A is [rows, in], the dot runs along `in`); with
//   bf16 x and A on AVX512-BF16, vdpbf16ps on both as stored.
// - expand: one slot, one part, a chunk of output columns and up to 64 tokens, with B
//   transposed to [R, columns] (its dtype) by the caller once per write of the slots (it
//   was transposed here per call, for every slot and chunk: most of the op's time), so each
//   token's delta is R broadcast multiply-adds per vector of columns, added to the output row in
//   float32 and rounded once to its dtype.

#include "cpu_kernels.h"
#include "vec_math.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace platform_core_cpu {
namespace {

// Register tiles: tokens x rows (shrink) and tokens x column vectors (expand) accumulators,
// 16 of AVX-512's 32 registers, 8 of AVX2's 16.
constexpr int64_t kTokenTile = 4;
constexpr int64_t kRowGroup = kLanes == 16 ? 4 : 2;     // shrink: A rows sharing each x load
constexpr int64_t kVectorGroup = kLanes == 16 ? 4 : 2;  // expand: column vectors per token
constexpr int64_t kRowBlock = 16;                       // shrink: A rows per work item
constexpr int64_t kColumnChunk = 8 * kLanes;            // expand: columns per work item
constexpr int64_t kExpandTokens = 64;  // expand: tokens per work item
// expand: columns of lora_bt past out's last one (zeros), and the multiple its width is of.
constexpr int64_t kExpandPadding = 64, kExpandAlign = 16;
static_assert(kVectorGroup * kLanes <= kExpandPadding);

inline vecf load_wide(const float* p) { return loadv(p); }
inline vecf load_wide(const uint16_t* p) { return widen(p); }
inline float scalar_wide(float x) { return x; }
inline float scalar_wide(uint16_t x) { return std::bit_cast<float>(static_cast<uint32_t>(x) << 16); }

// `x` rounded to bf16 bit patterns (nearest even; NaN stays a quiet NaN), as from_float does.
inline vecu16 narrow_bf16(vecf x) {
  const vecu bits = std::bit_cast<vecu>(x);
  const vecu rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  const vecu quiet = vecu{} + 0x7FC0u;
  return __builtin_convertvector(x != x ? quiet : rounded, vecu16);
}

inline void add_to(float* out, vecf delta) { storev(out, loadv(out) + delta); }
inline void add_to(uint16_t* out, vecf delta) {
  const vecu16 rounded = narrow_bf16(widen(out) + delta);
  std::memcpy(out, &rounded, sizeof rounded);
}
inline void add_to(float* out, float delta) { *out += delta; }
inline void add_to(uint16_t* out, float delta) {
  *out = from_float<c10::BFloat16>(scalar_wide(*out) + delta).x;
}

// Each slot's tokens in order, from token_slots (-1: the base model's, in no list).
std::vector<std::vector<int64_t>> tokens_by_slot(const at::Tensor& token_slots, int64_t slots,
                                                 const char* op) {
  TORCH_CHECK(token_slots.scalar_type() == at::kInt && token_slots.dim() == 1 &&
                  token_slots.is_contiguous(),
              op, ": token_slots must be a contiguous int32 [T] tensor");
  std::vector<std::vector<int64_t>> by_slot(slots);
  const int32_t* slot_of = token_slots.data_ptr<int32_t>();
  for (int64_t t = 0; t < token_slots.size(0); ++t) {
    TORCH_CHECK(slot_of[t] >= -1 && slot_of[t] < slots, op, ": token ", t, " has slot ",
                slot_of[t], ", outside -1..", slots - 1);
    if (slot_of[t] >= 0) by_slot[slot_of[t]].push_back(t);
  }
  return by_slot;
}

// Copies of rows `tokens` of x [T, in] widened to float, each padded with zeros to `padded`.
template <typename X>
void widen_rows(const X* x, int64_t in, const int64_t* tokens, int64_t count, int64_t padded,
                float* into) {
  for (int64_t j = 0; j < count; ++j) {
    const X* row = x + tokens[j] * in;
    float* dst = into + j * padded;
    for (int64_t k = 0; k < in; ++k) dst[k] = scalar_wide(row[k]);
    std::fill(dst + in, dst + padded, 0.0f);
  }
}

// out[tokens[j], row] = A[row] . x[tokens[j]] for the tile's N tokens and rows [first, end),
// kRowGroup rows at a time (the last group repeats its last row and writes it once).
template <int64_t N, typename W>
void shrink_tile(const float* xs, int64_t padded, const W* a, int64_t in, int64_t first,
                 int64_t end, const int64_t* tokens, float* out, int64_t out_stride) {
  const int64_t vec_end = in - in % kLanes;
  for (int64_t row = first; row < end; row += kRowGroup) {
    const W* w[kRowGroup];
    for (int64_t g = 0; g < kRowGroup; ++g) w[g] = a + std::min(row + g, end - 1) * in;
    vecf acc[N][kRowGroup] = {};
    for (int64_t k = 0; k < vec_end; k += kLanes) {
      vecf wk[kRowGroup];
      for (int64_t g = 0; g < kRowGroup; ++g) wk[g] = load_wide(w[g] + k);
      for (int64_t j = 0; j < N; ++j) {
        const vecf v = loadv(xs + j * padded + k);
        for (int64_t g = 0; g < kRowGroup; ++g) acc[j][g] += wk[g] * v;
      }
    }
    for (int64_t j = 0; j < N; ++j) {
      const float* xj = xs + j * padded;
      float* o = out + tokens[j] * out_stride;
      for (int64_t g = 0; g < kRowGroup && row + g < end; ++g) {
        float tail = 0.0f;
        for (int64_t k = vec_end; k < in; ++k) tail += scalar_wide(w[g][k]) * xj[k];
        o[row + g] = hsum(acc[j][g]) + tail;
      }
    }
  }
}

#if defined(__AVX512BF16__)
// shrink_tile for bf16 x and bf16 A on AVX512-BF16: x's rows read as stored (no widened copy),
// 32 activations times 32 weights per vdpbf16ps, whose pair products are exact in fp32.
template <int64_t N>
void shrink_tile_bf16(const uint16_t* x, int64_t in, const uint16_t* a, int64_t first,
                      int64_t end, const int64_t* tokens, float* out, int64_t out_stride) {
  const int64_t vec_end = in - in % 32;
  for (int64_t row = first; row < end; row += kRowGroup) {
    const uint16_t* w[kRowGroup];
    for (int64_t g = 0; g < kRowGroup; ++g) w[g] = a + std::min(row + g, end - 1) * in;
    __m512 acc[N][kRowGroup];
    for (int64_t j = 0; j < N; ++j) {
      for (int64_t g = 0; g < kRowGroup; ++g) acc[j][g] = _mm512_setzero_ps();
    }
    for (int64_t k = 0; k < vec_end; k += 32) {
      __m512bh wk[kRowGroup];
      for (int64_t g = 0; g < kRowGroup; ++g) wk[g] = (__m512bh)_mm512_loadu_si512(w[g] + k);
      for (int64_t j = 0; j < N; ++j) {
        const __m512bh v = (__m512bh)_mm512_loadu_si512(x + tokens[j] * in + k);
        for (int64_t g = 0; g < kRowGroup; ++g) acc[j][g] = _mm512_dpbf16_ps(acc[j][g], v, wk[g]);
      }
    }
    for (int64_t j = 0; j < N; ++j) {
      const uint16_t* xj = x + tokens[j] * in;
      float* o = out + tokens[j] * out_stride;
      for (int64_t g = 0; g < kRowGroup && row + g < end; ++g) {
        float tail = 0.0f;
        for (int64_t k = vec_end; k < in; ++k) tail += scalar_wide(w[g][k]) * scalar_wide(xj[k]);
        o[row + g] = _mm512_reduce_add_ps(acc[j][g]) + tail;
      }
    }
  }
}
#endif

template <typename X, typename W>
void shrink_impl(const at::Tensor& x, const at::Tensor& lora_a,
                 const std::vector<std::vector<int64_t>>& by_slot, const at::Tensor& out) {
  const int64_t in = x.size(1), rows = lora_a.size(1) * lora_a.size(2);
  const int64_t padded = (in + kLanes - 1) / kLanes * kLanes;
  const auto* xp = reinterpret_cast<const X*>(x.data_ptr());
  const auto* ap = reinterpret_cast<const W*>(lora_a.data_ptr());
  float* op = out.data_ptr<float>();
  struct Item {
    int64_t slot, first_token, count, first_row;
  };
  std::vector<Item> items;
  for (int64_t slot = 0; slot < static_cast<int64_t>(by_slot.size()); ++slot) {
    const int64_t n = by_slot[slot].size();
    for (int64_t t = 0; t < n; t += kTokenTile) {
      for (int64_t row = 0; row < rows; row += kRowBlock) {
        items.push_back({slot, t, std::min(kTokenTile, n - t), row});
      }
    }
  }
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> xs(kTokenTile * padded);
    for (int64_t i = begin; i < end; ++i) {
      const Item& item = items[i];
      const int64_t* tokens = by_slot[item.slot].data() + item.first_token;
      const W* a = ap + item.slot * rows * in;
      const int64_t last = std::min(item.first_row + kRowBlock, rows);
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<X, uint16_t> && std::is_same_v<W, uint16_t>) {
        switch (item.count) {
          case 1: shrink_tile_bf16<1>(xp, in, a, item.first_row, last, tokens, op, rows); break;
          case 2: shrink_tile_bf16<2>(xp, in, a, item.first_row, last, tokens, op, rows); break;
          case 3: shrink_tile_bf16<3>(xp, in, a, item.first_row, last, tokens, op, rows); break;
          default: shrink_tile_bf16<4>(xp, in, a, item.first_row, last, tokens, op, rows); break;
        }
        continue;
      }
#endif
      widen_rows(xp, in, tokens, item.count, padded, xs.data());
      switch (item.count) {
        case 1: shrink_tile<1>(xs.data(), padded, a, in, item.first_row, last, tokens, op, rows); break;
        case 2: shrink_tile<2>(xs.data(), padded, a, in, item.first_row, last, tokens, op, rows); break;
        case 3: shrink_tile<3>(xs.data(), padded, a, in, item.first_row, last, tokens, op, rows); break;
        default: shrink_tile<4>(xs.data(), padded, a, in, item.first_row, last, tokens, op, rows); break;
      }
    }
  });
}

// out[t, columns] += buffer[t] @ B[columns].T for the tile's N tokens, with B's chunk
// transposed at `bt` ([rank, width] with rows `bt_stride` apart; whole vectors are read past
// `width`, and only `width` columns written).
template <int64_t N, typename O, typename W>
void expand_tile(O* out, int64_t out_stride, const float* buffer, int64_t buffer_stride,
                 const int64_t* tokens, const W* bt, int64_t bt_stride, int64_t rank,
                 int64_t width) {
  const float* b[N];
  for (int64_t j = 0; j < N; ++j) b[j] = buffer + tokens[j] * buffer_stride;
  for (int64_t first = 0; first < width; first += kVectorGroup * kLanes) {
    vecf acc[N][kVectorGroup] = {};
    for (int64_t r = 0; r < rank; ++r) {
      const W* row = bt + r * bt_stride + first;
      vecf w[kVectorGroup];
      for (int64_t v = 0; v < kVectorGroup; ++v) w[v] = load_wide(row + v * kLanes);
      for (int64_t j = 0; j < N; ++j) {
        const vecf scale = splat(b[j][r]);
        for (int64_t v = 0; v < kVectorGroup; ++v) acc[j][v] += scale * w[v];
      }
    }
    for (int64_t j = 0; j < N; ++j) {
      O* o = out + tokens[j] * out_stride + first;
      for (int64_t v = 0; v < kVectorGroup; ++v) {
        const int64_t column = first + v * kLanes;
        if (column + kLanes <= width) {
          add_to(o + v * kLanes, acc[j][v]);
        } else {
          float rest[kLanes];
          storev(rest, acc[j][v]);
          for (int64_t c = column; c < width; ++c) add_to(o + (c - first), rest[c - column]);
        }
      }
    }
  }
}

template <typename O, typename W>
void expand_impl(const at::Tensor& out, const at::Tensor& buffer, const at::Tensor& lora_bt,
                 const std::vector<int64_t>& slice_sizes,
                 const std::vector<std::vector<int64_t>>& by_slot) {
  const int64_t rank = lora_bt.size(1), bt_stride = lora_bt.size(2);
  auto* op = reinterpret_cast<O*>(out.data_ptr());
  const float* bp = buffer.data_ptr<float>();
  const auto* btp = reinterpret_cast<const W*>(lora_bt.data_ptr());
  struct Item {
    int64_t slot, part, first_column, width, first_token, count;
  };
  std::vector<Item> items;
  for (int64_t slot = 0; slot < static_cast<int64_t>(by_slot.size()); ++slot) {
    const int64_t tokens = by_slot[slot].size();
    int64_t start = 0;
    for (int64_t part = 0; part < static_cast<int64_t>(slice_sizes.size()); ++part) {
      const int64_t stop = start + slice_sizes[part];
      for (int64_t c = start; c < stop; c += kColumnChunk) {
        for (int64_t t = 0; t < tokens; t += kExpandTokens) {
          items.push_back({slot, part, c, std::min(kColumnChunk, stop - c), t,
                           std::min(kExpandTokens, tokens - t)});
        }
      }
      start = stop;
    }
  }
  const int64_t out_stride = out.stride(0), token_stride = buffer.stride(1);
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Item& item = items[i];
      const W* bt = btp + item.slot * rank * bt_stride + item.first_column;
      O* o = op + item.first_column;
      const float* b = bp + item.part * buffer.stride(0);
      const int64_t* tokens = by_slot[item.slot].data() + item.first_token;
      for (int64_t t = 0; t < item.count; t += kTokenTile) {
        const int64_t* tile = tokens + t;
        switch (std::min(kTokenTile, item.count - t)) {
          case 1: expand_tile<1>(o, out_stride, b, token_stride, tile, bt, bt_stride, rank, item.width); break;
          case 2: expand_tile<2>(o, out_stride, b, token_stride, tile, bt, bt_stride, rank, item.width); break;
          case 3: expand_tile<3>(o, out_stride, b, token_stride, tile, bt, bt_stride, rank, item.width); break;
          default: expand_tile<4>(o, out_stride, b, token_stride, tile, bt, bt_stride, rank, item.width); break;
        }
      }
    }
  });
}

bool is_float_or_bf16(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16;
}

}  // namespace

void lora_shrink(const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& token_slots,
                 const at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && is_float_or_bf16(x),
              "lora_shrink: x must be a contiguous float32 or bf16 [T, in] tensor");
  TORCH_CHECK(lora_a.dim() == 4 && lora_a.is_contiguous() && is_float_or_bf16(lora_a) &&
                  lora_a.size(3) == x.size(1),
              "lora_shrink: lora_a must be a contiguous float32 or bf16 [L, S, R, in] tensor");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2 &&
                  out.size(0) == x.size(0) && out.size(1) == lora_a.size(1) * lora_a.size(2),
              "lora_shrink: out must be a contiguous float32 [T, S * R] tensor");
  TORCH_CHECK(token_slots.numel() == x.size(0), "lora_shrink: one slot per token");
  const auto by_slot = tokens_by_slot(token_slots, lora_a.size(0), "lora_shrink");
  out.zero_();
  const bool x_bf16 = x.scalar_type() == at::kBFloat16;
  const bool a_bf16 = lora_a.scalar_type() == at::kBFloat16;
  if (x_bf16 && a_bf16) shrink_impl<uint16_t, uint16_t>(x, lora_a, by_slot, out);
  else if (x_bf16) shrink_impl<uint16_t, float>(x, lora_a, by_slot, out);
  else if (a_bf16) shrink_impl<float, uint16_t>(x, lora_a, by_slot, out);
  else shrink_impl<float, float>(x, lora_a, by_slot, out);
}

void lora_expand(const at::Tensor& out, const at::Tensor& buffer, const at::Tensor& lora_bt,
                 const at::Tensor& token_slots, at::IntArrayRef slice_sizes) {
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1 && is_float_or_bf16(out),
              "lora_expand: out must be a float32 or bf16 [T, N] tensor with contiguous rows");
  TORCH_CHECK(buffer.dim() == 3 && buffer.scalar_type() == at::kFloat && buffer.stride(2) == 1 &&
                  buffer.size(1) == out.size(0),
              "lora_expand: buffer must be a float32 [S, T, R] tensor, R contiguous");
  TORCH_CHECK(lora_bt.dim() == 3 && lora_bt.is_contiguous() && is_float_or_bf16(lora_bt) &&
                  lora_bt.size(1) == buffer.size(2) &&
                  lora_bt.size(2) >= out.size(1) + kExpandPadding &&
                  lora_bt.size(2) % kExpandAlign == 0,
              "lora_expand: lora_bt must be a contiguous float32 or bf16 [L, R, W] tensor, W a multiple "
              "of ", kExpandAlign, " and at least out's columns + ", kExpandPadding);
  TORCH_CHECK(static_cast<int64_t>(slice_sizes.size()) == buffer.size(0),
              "lora_expand: one slice size per buffer part");
  std::vector<int64_t> sizes(slice_sizes.begin(), slice_sizes.end());
  int64_t total = 0;
  for (int64_t size : sizes) {
    TORCH_CHECK(size >= 0, "lora_expand: negative slice size");
    total += size;
  }
  TORCH_CHECK(total == out.size(1), "lora_expand: slice sizes must sum to out's columns");
  TORCH_CHECK(token_slots.numel() == out.size(0), "lora_expand: one slot per token");
  const auto by_slot = tokens_by_slot(token_slots, lora_bt.size(0), "lora_expand");
  const bool o_bf16 = out.scalar_type() == at::kBFloat16;
  const bool b_bf16 = lora_bt.scalar_type() == at::kBFloat16;
  if (o_bf16 && b_bf16) expand_impl<uint16_t, uint16_t>(out, buffer, lora_bt, sizes, by_slot);
  else if (o_bf16) expand_impl<uint16_t, float>(out, buffer, lora_bt, sizes, by_slot);
  else if (b_bf16) expand_impl<float, uint16_t>(out, buffer, lora_bt, sizes, by_slot);
  else expand_impl<float, float>(out, buffer, lora_bt, sizes, by_slot);
}

}  // namespace platform_core_cpu
