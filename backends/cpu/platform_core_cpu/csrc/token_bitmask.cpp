// Structured outputs' token bitmask on float32 logits, in place: token t of row rows[i] becomes
// -inf where bit t % 32 of bitmask[i][t / 32] is clear (least-significant bit first, xgrammar's
// packing). Each 32-bit word covers 32 logits: AVX-512 stores -inf through the word's inverted
// halves as two __mmask16, AVX2 expands each byte to a lane mask and blends, other builds test
// bit by bit. Rows are split across threads.

#include "cpu_kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <limits>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace platform_core_cpu {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// x[j] = -inf for each j < count whose bit j of `word` is clear.
inline void mask_bits(float* x, uint32_t word, int64_t count) {
  for (int64_t j = 0; j < count; ++j) {
    if (!((word >> j) & 1u)) x[j] = kNegInf;
  }
}

// The same for a whole word: 32 logits.
inline void mask_word(float* x, uint32_t word) {
#if defined(__AVX512F__)
  const __m512 neg_inf = _mm512_set1_ps(kNegInf);
  // A masked store writes only the lanes whose mask bit is set: the banned tokens.
  _mm512_mask_storeu_ps(x, static_cast<__mmask16>(~word), neg_inf);
  _mm512_mask_storeu_ps(x + 16, static_cast<__mmask16>(~word >> 16), neg_inf);
#elif defined(__AVX2__)
  const __m256 neg_inf = _mm256_set1_ps(kNegInf);
  const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  for (int q = 0; q < 4; ++q) {
    // Lane j tests bit j of byte q; a clear bit gives an all-ones lane, which selects -inf.
    const __m256i byte = _mm256_set1_epi32(static_cast<int>(word >> (8 * q)));
    const __m256i banned =
        _mm256_cmpeq_epi32(_mm256_and_si256(byte, lane_bit), _mm256_setzero_si256());
    float* p = x + 8 * q;
    _mm256_storeu_ps(p, _mm256_blendv_ps(_mm256_loadu_ps(p), neg_inf,
                                         _mm256_castsi256_ps(banned)));
  }
#else
  mask_bits(x, word, 32);
#endif
}

void mask_row(float* x, const uint32_t* words, int64_t vocab) {
  const int64_t full = vocab / 32;
  for (int64_t w = 0; w < full; ++w) {
    if (words[w] != ~0u) mask_word(x + 32 * w, words[w]);  // an all-allowed word: nothing to do
  }
  if (vocab % 32) mask_bits(x + 32 * full, words[full], vocab % 32);
}

}  // namespace

void apply_token_bitmask(const at::Tensor& logits, const at::Tensor& bitmask,
                         const at::Tensor& rows) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.stride(1) == 1,
              "apply_token_bitmask: float32 logits [rows, vocab] with contiguous rows");
  TORCH_CHECK(bitmask.scalar_type() == at::kInt && bitmask.dim() == 2 && bitmask.stride(1) == 1,
              "apply_token_bitmask: int32 bitmask [n, words] with contiguous rows");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous() &&
                  rows.size(0) == bitmask.size(0),
              "apply_token_bitmask: int64 rows [n], one per bitmask row");
  const int64_t n = rows.size(0), vocab = logits.size(1), num_rows = logits.size(0);
  TORCH_CHECK(bitmask.size(1) * 32 >= vocab, "apply_token_bitmask: ", bitmask.size(1),
              " words per row cannot hold ", vocab, " tokens");
  const int64_t* row_of = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(row_of[i] >= 0 && row_of[i] < num_rows, "apply_token_bitmask: row ", row_of[i],
                " is outside the ", num_rows, " rows of logits");
  }
  float* x = logits.data_ptr<float>();
  const auto* words = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  const int64_t x_stride = logits.stride(0), word_stride = bitmask.stride(0);
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(vocab, 1));
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      mask_row(x + row_of[i] * x_stride, words + i * word_stride, vocab);
    }
  });
}

}  // namespace platform_core_cpu
