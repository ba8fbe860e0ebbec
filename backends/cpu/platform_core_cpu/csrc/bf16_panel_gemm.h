// A bf16 matmul y = x W^T for weights that are produced a few rows at a time (dequantized from
// blocks by the quantized linear), on AVX512-BF16 (vdpbf16ps). Builds without it have none.
//
// Each thread fills a panel of kPanelRows weight rows (bf16, row-major) and multiplies it by
// every row of x before it fills the next, so dequantizing is the GEMM's packing step: no
// dequantized copy of the whole weight is written to memory and read back, and torch's matmul
// is not handed a plain (unpacked) weight to reorder on each call.
//
// x is packed once per call, 16 rows to a vector: for pair p of columns (2p, 2p + 1), lane j
// holds row j's two values. A tile multiplies kPanelRows weight rows by up to kRowVectors
// such vectors: each step loads the x vectors of one pair and broadcasts each weight row's
// pair, so one vdpbf16ps adds that pair's products for 16 rows of x. The sums stay in fp32
// until each output is rounded once.
#pragma once

#if defined(__AVX512BF16__)

#include "cpu_kernels.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <vector>

namespace platform_core_cpu::bf16_gemm {

constexpr int64_t kLanes16 = 16;    // rows of x per vector
constexpr int kPanelRows = 8;       // weight rows per tile
constexpr int kRowVectors = 3;      // x vectors per tile: 8 x 3 accumulators of 32 registers

// x [m, k] (bf16 bits, row stride ldx, k even) as vectors of 16 rows by column pairs:
// group g's pair p is the 16 words at (g * pairs + p) * 16; rows past m are zero.
inline std::vector<uint32_t> pack_rows(const uint16_t* x, int64_t m, int64_t ldx, int64_t k) {
  const int64_t groups = (m + kLanes16 - 1) / kLanes16, pairs = k / 2;
  std::vector<uint32_t> packed(groups * pairs * kLanes16, 0u);
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      for (int64_t j = 0; j < kLanes16 && g * kLanes16 + j < m; ++j) {
        const uint16_t* row = x + (g * kLanes16 + j) * ldx;
        uint32_t* into = packed.data() + g * pairs * kLanes16 + j;
        for (int64_t p = 0; p < pairs; ++p) std::memcpy(into + p * kLanes16, row + 2 * p, 4);
      }
    }
  });
  return packed;
}

// Eight vectors of 16 fp32 (vector r: output column r for 16 rows of x) plus bias[0..8), as
// bf16 rows of 8 at out, out + n, ... (`count` rows of x, all 8 columns).
inline void store_rows(const __m512 (&cols)[kPanelRows], __m256 bias, int64_t count,
                       int64_t n, uint16_t* out) {
  __m512 pairs[8], quads[8];
  for (int r = 0; r < 8; r += 2) {  // per 128-bit lane: (c_r, c_r+1) of rows 0-1, then 2-3
    pairs[r] = _mm512_unpacklo_ps(cols[r], cols[r + 1]);
    pairs[r + 1] = _mm512_unpackhi_ps(cols[r], cols[r + 1]);
  }
  for (int h = 0; h < 2; ++h) {  // quads[4h + e]: columns 4h-4h+3 of row e of each lane
    const __m512 *lo = pairs + 4 * h, *hi = pairs + 4 * h + 2;
    quads[4 * h + 0] = _mm512_shuffle_ps(lo[0], hi[0], 0x44);
    quads[4 * h + 1] = _mm512_shuffle_ps(lo[0], hi[0], 0xEE);
    quads[4 * h + 2] = _mm512_shuffle_ps(lo[1], hi[1], 0x44);
    quads[4 * h + 3] = _mm512_shuffle_ps(lo[1], hi[1], 0xEE);
  }
  alignas(64) float low[4][16], high[4][16];
  for (int e = 0; e < 4; ++e) {
    _mm512_store_ps(low[e], quads[e]);
    _mm512_store_ps(high[e], quads[4 + e]);
  }
  for (int64_t i = 0; i < count; ++i) {  // row i: lane i / 4, row i % 4 of that lane
    const int e = i % 4, at = 4 * (i / 4);
    const __m256 row = _mm256_add_ps(
        _mm256_set_m128(_mm_load_ps(high[e] + at), _mm_load_ps(low[e] + at)), bias);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i * n), (__m128i)_mm256_cvtneps_pbh(row));
  }
}

// out rows [first, first + count) by columns [row, row + rows) = kPanelRows weight rows at `w`
// (row stride k) times V x vectors from `xg` (one group apart), plus bias.
template <int V>
inline void tile(const uint32_t* xg, int64_t pairs, const uint16_t* w, int64_t k,
                 const float* bias, int64_t row, int64_t rows, int64_t count, int64_t n,
                 uint16_t* out) {
  __m512 acc[V][kPanelRows];
  for (int v = 0; v < V; ++v) {
    for (int r = 0; r < kPanelRows; ++r) acc[v][r] = _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh xv[V];
    for (int v = 0; v < V; ++v) {
      xv[v] = (__m512bh)_mm512_loadu_si512(xg + (v * pairs + p) * kLanes16);
    }
#pragma GCC unroll 8
    for (int r = 0; r < kPanelRows; ++r) {
      int32_t pair;
      std::memcpy(&pair, w + r * k + 2 * p, 4);
      const __m512bh wb = (__m512bh)_mm512_set1_epi32(pair);
      for (int v = 0; v < V; ++v) acc[v][r] = _mm512_dpbf16_ps(acc[v][r], xv[v], wb);
    }
  }
  alignas(32) float b[kPanelRows] = {};
  for (int64_t r = 0; r < rows && bias; ++r) b[r] = bias[row + r];
  for (int v = 0; v < V && v * kLanes16 < count; ++v) {
    const int64_t lanes = std::min<int64_t>(kLanes16, count - v * kLanes16);
    uint16_t* into = out + v * kLanes16 * n + row;
    if (rows == kPanelRows) {
      store_rows(acc[v], _mm256_load_ps(b), lanes, n, into);
      continue;
    }
    alignas(64) float sums[kPanelRows][kLanes16];
    for (int r = 0; r < kPanelRows; ++r) _mm512_store_ps(sums[r], acc[v][r]);
    for (int64_t i = 0; i < lanes; ++i) {
      for (int64_t r = 0; r < rows; ++r) {
        into[i * n + r] = std::bit_cast<uint16_t>(from_float<c10::BFloat16>(sums[r][i] + b[r]));
      }
    }
  }
}

// Weight rows per panel: up to four tiles' (x is read once per panel), fewer where that would
// leave threads without work.
inline int64_t panel_rows(int64_t n) {
  const int64_t tiles = n / (kPanelRows * 2 * at::get_num_threads());
  return kPanelRows * std::clamp<int64_t>(tiles, 1, 4);
}

// out [m, n] bf16 = x W^T (+ bias), where fill(row, rows, panel) writes weight rows
// [row, row + rows) as bf16 bits to `panel` (row stride k).
template <typename Fill>
void panel_matmul(const uint16_t* x, int64_t m, int64_t ldx, int64_t k, int64_t n,
                  const float* bias, const Fill& fill, uint16_t* out) {
  const std::vector<uint32_t> packed = pack_rows(x, m, ldx, k);
  const int64_t groups = (m + kLanes16 - 1) / kLanes16, pairs = k / 2;
  const int64_t step = panel_rows(n), panels = (n + step - 1) / step;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint16_t> panel(step * k);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t first_row = t * step, rows = std::min(step, n - first_row);
      fill(first_row, rows, panel.data());
      const int64_t padded = (rows + kPanelRows - 1) / kPanelRows * kPanelRows;
      std::fill(panel.begin() + rows * k, panel.begin() + padded * k, uint16_t{0});
      for (int64_t g = 0; g < groups; g += kRowVectors) {
        const uint32_t* xg = packed.data() + g * pairs * kLanes16;
        const int64_t count = std::min<int64_t>(kRowVectors * kLanes16, m - g * kLanes16);
        uint16_t* rows_out = out + g * kLanes16 * n;
        for (int64_t r = 0; r < rows; r += kPanelRows) {
          const uint16_t* w = panel.data() + r * k;
          const int64_t row = first_row + r, width = std::min<int64_t>(kPanelRows, rows - r);
          switch (std::min<int64_t>(kRowVectors, groups - g)) {
            case 3: tile<3>(xg, pairs, w, k, bias, row, width, count, n, rows_out); break;
            case 2: tile<2>(xg, pairs, w, k, bias, row, width, count, n, rows_out); break;
            default: tile<1>(xg, pairs, w, k, bias, row, width, count, n, rows_out); break;
          }
        }
      }
    }
  });
}

}  // namespace platform_core_cpu::bf16_gemm

#endif  // __AVX512BF16__
