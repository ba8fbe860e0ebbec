// Causal paged attention on CPU. One work item is (sequence, KV head, tile of query tokens):
// it runs an online softmax for every query row of the tile (its tokens times the query heads
// sharing that KV head), so a block is read once per KV-head group instead of once per query head.
//
// Each (block, KV head) of the cache is one tile of block_size x head_size elements, stored so
// that both products vectorize without horizontal sums (block_size and head_size are even):
//   keys   [head_size / 2][block_size][2]: kLanes pairs are one dimension pair of kLanes keys,
//   values [block_size / 2][head_size][2]: kLanes pairs are kLanes dimensions of a key pair.
// A bf16 cache splits pairs into even and odd fp32 lanes (two integer operations); that beat
// AVX512-BF16's vdpbf16ps, which also rounds probabilities to bf16, on every workload of
// benchmarks/cpu_attention.py. An fp32 cache keeps value pairs as stored: each row accumulates
// even and odd keys side by side and adds the two at the end.

#include "cpu_kernels.h"
#include "vec_math.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace platform_core_cpu {
namespace {

constexpr int64_t kTileRows = 32;  // query rows (tokens x grouped heads) one work item aims at
constexpr int64_t kDecodesPerThread = 4;  // decodes per thread before one item takes all heads
constexpr int64_t kChunkRows = 8;  // query rows scored together against each key vector

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Sizes and element strides; the cache is seen as [2, blocks, kv_heads, tile].
struct Geometry {
  int64_t group, head_size, block_size;
  int64_t q_token_stride, q_head_stride, o_token_stride, o_head_stride;
  int64_t kv_stride, block_stride, kv_head_stride, table_stride;
  float scale;
};

template <typename T>
struct Batch {
  const T* query;
  const T* cache;
  T* out;
  const int32_t* query_start_loc;
  const int32_t* seq_lens;
  const int32_t* block_tables;
};

// Query tokens [q_begin, q_end) of one sequence against KV heads [kv_head, kv_head_end).
struct WorkItem {
  int64_t seq, kv_head, kv_head_end, q_begin, q_end;
};

// Element bits as load_pairs reads them: fp32 as is, bf16 as raw 16-bit patterns.
inline const float* raw(const float* p) { return p; }
inline const uint16_t* raw(const c10::BFloat16* p) { return reinterpret_cast<const uint16_t*>(p); }

// fp32 values accumulate as stored pairs: 2 * head_size sums per row (even, odd key).
template <typename T>
constexpr bool kPairSums = std::is_same_v<T, float>;

// Accumulator floats per query row.
template <typename T>
int64_t acc_stride(const Geometry& g) {
  return round_up(kPairSums<T> ? 2 * g.head_size : g.head_size, kLanes);
}

// Per-thread buffers: query rows (fp32), their accumulators, and scores of one row chunk
// against a block.
struct Scratch {
  std::vector<float> q, acc, scores, row_max, row_sum;
  int64_t score_stride, acc_stride;
  Scratch(const Geometry& g, int64_t max_rows, int64_t acc_floats)
      : q(max_rows * g.head_size),
        acc(max_rows * acc_floats),
        scores(kChunkRows * round_up(g.block_size, kLanes), 0.0f),
        row_max(max_rows),
        row_sum(max_rows),
        score_stride(round_up(g.block_size, kLanes)),
        acc_stride(acc_floats) {}
};

// Scaled scores of R query rows (from `first`) against keys [0, count) of a key tile, into
// rows of s.scores; lanes up to the next multiple of kLanes past `count` are unspecified.
template <typename T, int R>
void score_chunk(int64_t first, const T* keys, int64_t count, const Geometry& g, Scratch& s) {
  const int64_t pairs = g.head_size / 2;
  for (int64_t j = 0; j < count; j += kLanes) {
    const int64_t lanes = std::min(kLanes, g.block_size - j);
    // Few rows keep even and odd dimensions apart: twice the FMA chains in flight.
    constexpr int kSums = R <= kChunkRows / 2 ? 2 : 1;
    const float* q = s.q.data() + first * g.head_size;
    vecf sums[kSums][R] = {};
    for (int64_t p = 0; p < pairs; ++p) {
      vecf even, odd;
      load_pairs(raw(keys) + 2 * (p * g.block_size + j), lanes, even, odd);
      // Two accumulations, not one of a sum: two FMAs instead of a multiply, FMA and add.
      for (int r = 0; r < R; ++r) {
        sums[0][r] += q[r * g.head_size + 2 * p] * even;
        sums[kSums - 1][r] += q[r * g.head_size + 2 * p + 1] * odd;
      }
    }
    for (int r = 0; r < R; ++r) {
      const vecf dots = kSums == 2 ? sums[0][r] + sums[1][r] : sums[0][r];
      storev(s.scores.data() + r * s.score_stride + j, dots * g.scale);
    }
  }
}

template <typename T>
void score_rows(int64_t first, int64_t rows, const T* keys, int64_t count, const Geometry& g,
                Scratch& s) {
  switch (rows) {
    case 1: return score_chunk<T, 1>(first, keys, count, g, s);
    case 2: return score_chunk<T, 2>(first, keys, count, g, s);
    case 3: return score_chunk<T, 3>(first, keys, count, g, s);
    case 4: return score_chunk<T, 4>(first, keys, count, g, s);
    case 5: return score_chunk<T, 5>(first, keys, count, g, s);
    case 6: return score_chunk<T, 6>(first, keys, count, g, s);
    case 7: return score_chunk<T, 7>(first, keys, count, g, s);
    default: return score_chunk<T, kChunkRows>(first, keys, count, g, s);
  }
}

// acc = acc * decay + sum_j p[j] * values[j] over key pairs [0, pairs) of a bf16 value tile,
// split into fp32 lanes; p is fp32 (p[2 * pairs - 1] must exist, zero past the row's keys).
// Even and odd keys of W vectors of dims accumulate apart: 2 * W independent FMA chains, where
// one chain per vector would wait on the FMA latency at every key.
template <typename T, int W>
void accumulate_value_columns(float* acc, float decay, const float* p, int64_t pairs,
                              const T* values, int64_t c, const Geometry& g) {
  const int64_t lanes = std::min(kLanes, g.head_size - c - (W - 1) * kLanes);
  vecf even_sum[W], odd_sum[W];
  for (int k = 0; k < W; ++k) {
    even_sum[k] = loadv(acc + c + k * kLanes) * decay;
    odd_sum[k] = vecf{};
  }
  for (int64_t i = 0; i < pairs; ++i) {
    const float pe = p[2 * i], po = p[2 * i + 1];
    for (int k = 0; k < W; ++k) {
      vecf even, odd;
      load_pairs(raw(values) + 2 * (i * g.head_size + c + k * kLanes),
                 k == W - 1 ? lanes : kLanes, even, odd);
      even_sum[k] += pe * even;
      odd_sum[k] += po * odd;
    }
  }
  for (int k = 0; k < W; ++k) storev(acc + c + k * kLanes, even_sum[k] + odd_sum[k]);
}

template <typename T>
void accumulate_values(float* acc, float decay, const float* p, int64_t pairs, const T* values,
                       const Geometry& g) {
  constexpr int kWidth = 4;  // vectors of dims per pass: 8 accumulators fit AVX2's registers
  int64_t c = 0;
  for (; c + kWidth * kLanes <= g.head_size; c += kWidth * kLanes) {
    accumulate_value_columns<T, kWidth>(acc, decay, p, pairs, values, c, g);
  }
  for (; c < g.head_size; c += kLanes) {
    accumulate_value_columns<T, 1>(acc, decay, p, pairs, values, c, g);
  }
}

// The (p[2i], p[2i + 1]) pair in every 64-bit lane.
inline vecf splat_pair(const float* p) {
  int64_t bits;
  std::memcpy(&bits, p, sizeof bits);
  return std::bit_cast<vecf>(veci64{} + bits);
}

// The first `lanes` floats at `src`, zeros after.
inline vecf load_first(const float* src, int64_t lanes) {
  if (lanes >= kLanes) return loadv(src);
  float padded[kLanes] = {};
  std::memcpy(padded, src, lanes * sizeof(float));
  return loadv(padded);
}

// The same for an fp32 value tile without splitting pairs: acc holds 2 * head_size pair sums
// (dimension d of even keys at 2d, of odd keys at 2d + 1), each a stored pair times the pair of
// probabilities; eight vectors of sums at a time (eight FMA chains) share a broadcast.
void accumulate_value_pairs(float* acc, float decay, const float* p, int64_t pairs,
                            const float* values, const Geometry& g) {
  constexpr int kWidth = 8;
  const int64_t width = 2 * g.head_size;
  int64_t c = 0;
  for (; c + kWidth * kLanes <= width; c += kWidth * kLanes) {
    vecf a[kWidth];
    for (int k = 0; k < kWidth; ++k) a[k] = loadv(acc + c + k * kLanes) * decay;
    for (int64_t i = 0; i < pairs; ++i) {
      const vecf w = splat_pair(p + 2 * i);
      const float* v = values + i * width + c;
      for (int k = 0; k < kWidth; ++k) a[k] += w * loadv(v + k * kLanes);
    }
    for (int k = 0; k < kWidth; ++k) storev(acc + c + k * kLanes, a[k]);
  }
  for (; c < width; c += kLanes) {
    const int64_t lanes = std::min(kLanes, width - c);
    vecf a = loadv(acc + c) * decay;
    for (int64_t i = 0; i < pairs; ++i) {
      a += splat_pair(p + 2 * i) * load_first(values + i * width + c, lanes);
    }
    storev(acc + c, a);
  }
}

// Folds keys [0, count) of a block, scored in `scores`, into row r's running max, sum and
// output (the values tile `values`).
template <typename T>
void attend_block(int64_t r, int64_t count, float* scores, const T* values, const Geometry& g,
                  Scratch& s) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  vecf block_max = splat(kNegInf);
  for (int64_t j = 0; j < count; j += kLanes) {
    block_max = vmax(block_max, keep_first(loadv(scores + j), count - j, kNegInf));
  }
  const float new_max = std::max(s.row_max[r], hmax(block_max));
  const float decay = expv(splat(s.row_max[r] - new_max))[0];  // ~0 on the row's first block
  // Probabilities, zero past `count` to the end of its vector: an odd count's last pair is
  // whole (kLanes is even).
  vecf block_sum = {};
  for (int64_t j = 0; j < count; j += kLanes) {
    const vecf p = keep_first(expv(loadv(scores + j) - new_max), count - j, 0.0f);
    storev(scores + j, p);
    block_sum += p;
  }
  s.row_sum[r] = s.row_sum[r] * decay + hsum(block_sum);
  s.row_max[r] = new_max;
  float* acc = s.acc.data() + r * s.acc_stride;
  const int64_t pairs = (count + 1) / 2;
  if constexpr (kPairSums<T>) {
    accumulate_value_pairs(acc, decay, scores, pairs, values, g);
  } else {
    accumulate_values(acc, decay, scores, pairs, values, g);
  }
}

// Asks for the first `valid` keys and values of a tile ahead of use: blocks are scattered,
// so hardware prefetch misses them.
template <typename T>
void prefetch_tile(const T* keys, const T* values, int64_t valid, const Geometry& g) {
  constexpr int64_t kLine = 64 / sizeof(T);
  for (int64_t p = 0; p < g.head_size / 2; ++p) {
    for (int64_t e = 0; e < 2 * valid; e += kLine) __builtin_prefetch(keys + 2 * p * g.block_size + e);
  }
  const int64_t value_elements = round_up(valid, 2) * g.head_size;
  for (int64_t e = 0; e < value_elements; e += kLine) __builtin_prefetch(values + e);
}

// Asks for block `blk` of a sequence's table ahead of use, if the sequence reaches it.
template <typename T>
void prefetch_table_block(const int32_t* table, int64_t blk, int64_t kv_len, int64_t kv_head,
                          const Geometry& g, const Batch<T>& b) {
  const int64_t start = blk * g.block_size;
  if (start >= kv_len) return;
  const T* keys = b.cache + table[blk] * g.block_stride + kv_head * g.kv_head_stride;
  prefetch_tile(keys, keys + g.kv_stride, std::min(g.block_size, kv_len - start), g);
}

// Query row r of an item: rows run over (KV head, token, head within the group).
struct RowMap {
  int64_t kv_head, q_begin, group, rows_per_head;
  int64_t token(int64_t r) const { return q_begin + (r % rows_per_head) / group; }
  int64_t head(int64_t r) const {
    return (kv_head + r / rows_per_head) * group + (r % rows_per_head) % group;
  }
};

template <typename T>
void run_item(const WorkItem& item, const Geometry& g, const Batch<T>& b, Scratch& s) {
  const int64_t seq_start = b.query_start_loc[item.seq];
  const int64_t seq_len = b.seq_lens[item.seq];
  // Position of the sequence's first query token within the sequence.
  const int64_t first_pos = seq_len - (b.query_start_loc[item.seq + 1] - seq_start);
  const int64_t heads = item.kv_head_end - item.kv_head;
  const RowMap map{item.kv_head, item.q_begin, g.group, (item.q_end - item.q_begin) * g.group};
  const int64_t rows = heads * map.rows_per_head;
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = b.query + map.token(r) * g.q_token_stride + map.head(r) * g.q_head_stride;
    float* q = s.q.data() + r * g.head_size;
    for (int64_t d = 0; d < g.head_size; ++d) q[d] = to_float(src[d]);
    std::fill_n(s.acc.data() + r * s.acc_stride, s.acc_stride, 0.0f);
    s.row_max[r] = -std::numeric_limits<float>::infinity();
    s.row_sum[r] = 0.0f;
  }
  const int64_t kv_len = first_pos + (item.q_end - seq_start);  // keys the last row sees
  const int32_t* table = b.block_tables + item.seq * g.table_stride;
  // Keys of the current block that row r sees (<= 0: none).
  auto visible = [&](int64_t r, int64_t block_start, int64_t valid) {
    return std::min(valid, first_pos + (map.token(r) - seq_start) - block_start + 1);
  };
  for (int64_t blk = 0; blk * g.block_size < kv_len; ++blk) {
    const int64_t block_start = blk * g.block_size;
    const int64_t valid = std::min(g.block_size, kv_len - block_start);
    for (int64_t h = item.kv_head; h < item.kv_head_end; ++h) {
      prefetch_table_block(table, blk + 1, kv_len, h, g, b);
    }
    // The item's heads of one block lie side by side: read them in order.
    for (int64_t h = 0; h < heads; ++h) {
      const T* keys =
          b.cache + table[blk] * g.block_stride + (item.kv_head + h) * g.kv_head_stride;
      const int64_t head_end = (h + 1) * map.rows_per_head;
      for (int64_t first = h * map.rows_per_head; first < head_end; first += kChunkRows) {
        const int64_t chunk = std::min(kChunkRows, head_end - first);
        // Rows are in token order, so the chunk's last row sees the most keys.
        const int64_t most = visible(first + chunk - 1, block_start, valid);
        if (most <= 0) continue;
        score_rows(first, chunk, keys, most, g, s);
        for (int64_t r = first; r < first + chunk; ++r) {
          const int64_t count = visible(r, block_start, valid);
          if (count <= 0) continue;
          float* scores = s.scores.data() + (r - first) * s.score_stride;
          attend_block(r, count, scores, keys + g.kv_stride, g, s);
        }
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    T* dst = b.out + map.token(r) * g.o_token_stride + map.head(r) * g.o_head_stride;
    const float* acc = s.acc.data() + r * s.acc_stride;
    const float inv = 1.0f / s.row_sum[r];
    for (int64_t d = 0; d < g.head_size; ++d) {
      const float sum = kPairSums<T> ? acc[2 * d] + acc[2 * d + 1] : acc[d];
      dst[d] = from_float<T>(sum * inv);
    }
  }
}

// Rejects metadata that would make the kernel read outside its tensors.
void check_metadata(const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                    const at::Tensor& block_tables, int64_t num_tokens, int64_t num_blocks,
                    int64_t block_size) {
  const int64_t num_seqs = seq_lens.size(0);
  TORCH_CHECK(query_start_loc.size(0) == num_seqs + 1 && block_tables.size(0) >= num_seqs,
              "query_start_loc needs num_seqs + 1 entries and block_tables num_seqs rows");
  const auto* qsl = query_start_loc.data_ptr<int32_t>();
  const auto* lens = seq_lens.data_ptr<int32_t>();
  const auto* tables = block_tables.data_ptr<int32_t>();
  TORCH_CHECK(qsl[0] == 0 && qsl[num_seqs] == num_tokens, "query_start_loc must span query");
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t q_len = qsl[i + 1] - qsl[i], used = (lens[i] + block_size - 1) / block_size;
    TORCH_CHECK(q_len >= 0 && q_len <= lens[i], "sequence ", i, ": bad query length ", q_len);
    TORCH_CHECK(q_len == 0 || used <= block_tables.size(1), "sequence ", i, ": table too short");
    for (int64_t b = 0; q_len > 0 && b < used; ++b) {
      const int32_t id = tables[i * block_tables.stride(0) + b];
      TORCH_CHECK(id >= 0 && id < num_blocks, "sequence ", i, ": block id ", id, " out of range");
    }
  }
}

struct Plan {
  std::vector<WorkItem> items;
  int64_t key_visits = 0;  // query rows times the keys they see, summed over items
};

// Work items, the heavier (later) query tiles of each sequence first. A decode (one query
// token) covers all KV heads in one item when there are enough decodes to share out, so each
// block's heads are read as one contiguous run.
Plan plan(const int32_t* query_start_loc, const int32_t* seq_lens, int64_t num_seqs,
          int64_t kv_heads, int64_t group, int64_t tile_tokens, int64_t threads) {
  Plan p;
  int64_t decodes = 0;
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    decodes += query_start_loc[seq + 1] - query_start_loc[seq] == 1;
  }
  const bool whole_decodes = decodes >= kDecodesPerThread * threads;
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    const int64_t first = query_start_loc[seq], last = query_start_loc[seq + 1];
    for (int64_t end = last; end > first; end -= tile_tokens) {
      const int64_t begin = std::max(first, end - tile_tokens);
      const int64_t keys = seq_lens[seq] - (last - end) + 1;  // seen by the tile's last row
      p.key_visits += kv_heads * group * (end - begin) * keys;
      if (whole_decodes && last - first == 1) {
        p.items.push_back({seq, 0, kv_heads, begin, end});
        continue;
      }
      for (int64_t h = 0; h < kv_heads; ++h) p.items.push_back({seq, h, h + 1, begin, end});
    }
  }
  return p;
}

template <typename T>
void run(const Geometry& g, const Batch<T>& batch, const Plan& p, int64_t max_rows) {
  // Small steps stay on one thread: waking others costs more than it saves.
  constexpr int64_t kKeyVisitsPerThread = 1 << 12;
  const int64_t threads = std::clamp<int64_t>(
      p.key_visits / kKeyVisitsPerThread, 1,
      std::min<int64_t>(at::get_num_threads(), p.items.size()));
#pragma omp parallel num_threads(threads)
  {
    Scratch scratch(g, max_rows, acc_stride<T>(g));
#pragma omp for schedule(dynamic, 1)
    for (size_t i = 0; i < p.items.size(); ++i) run_item(p.items[i], g, batch, scratch);
  }
}

}  // namespace

void paged_attention(const at::Tensor& query, const at::Tensor& kv_cache,
                     const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                     const at::Tensor& block_tables, double scale, const at::Tensor& out) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query/out: [tokens, heads, D]");
  TORCH_CHECK(kv_cache.dim() == 4 && kv_cache.size(0) == 2, "kv_cache: [2, NB, KVH, BS * D]");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && kv_cache.stride(3) == 1,
              "the head dimension and the cache tiles must be contiguous");
  TORCH_CHECK(query.scalar_type() == kv_cache.scalar_type() &&
                  out.scalar_type() == query.scalar_type(),
              "query, kv_cache and out must share a dtype");
  for (const at::Tensor* t : {&query_start_loc, &seq_lens, &block_tables}) {
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(), "metadata: contiguous int32");
  }
  const int64_t heads = query.size(1), kv_heads = kv_cache.size(2);
  TORCH_CHECK(heads % kv_heads == 0, "query heads must be a multiple of kv heads");
  const int64_t head_size = query.size(2);
  TORCH_CHECK(head_size % 2 == 0 && kv_cache.size(3) % (2 * head_size) == 0,
              "the cache tile must hold an even number of tokens of an even head size");
  const int64_t block_size = kv_cache.size(3) / head_size;
  const Geometry g{heads / kv_heads, head_size, block_size,
                   query.stride(0), query.stride(1), out.stride(0), out.stride(1),
                   kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
                   block_tables.stride(0), static_cast<float>(scale)};
  check_metadata(query_start_loc, seq_lens, block_tables, query.size(0), kv_cache.size(1),
                 block_size);
  const int64_t tile_tokens = std::max<int64_t>(1, kTileRows / g.group);
  const Plan work = plan(query_start_loc.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(),
                         seq_lens.size(0), kv_heads, g.group, tile_tokens, at::get_num_threads());
  if (work.items.empty()) return;
  const int64_t max_rows = std::max(tile_tokens, kv_heads) * g.group;
  const auto* qsl = query_start_loc.data_ptr<int32_t>();
  const auto* lens = seq_lens.data_ptr<int32_t>();
  const auto* tables = block_tables.data_ptr<int32_t>();
  switch (query.scalar_type()) {
    case at::kFloat:
      return run(g, Batch<float>{query.data_ptr<float>(), kv_cache.data_ptr<float>(),
                                 out.data_ptr<float>(), qsl, lens, tables}, work, max_rows);
    case at::kBFloat16:
      return run(g, Batch<c10::BFloat16>{query.data_ptr<c10::BFloat16>(),
                                         kv_cache.data_ptr<c10::BFloat16>(),
                                         out.data_ptr<c10::BFloat16>(), qsl, lens, tables},
                 work, max_rows);
    default:
      TORCH_CHECK(false, "unsupported dtype ", query.scalar_type(), " (float32, bfloat16)");
  }
}

}  // namespace platform_core_cpu
