// Causal paged attention on CPU. One work item is (sequence, KV head, tile of query tokens):
// it converts each K/V block of its causal window to fp32 once and runs an online softmax for
// every query row of the tile (its tokens times the query heads sharing that KV head), so a
// block is read once per KV-head group instead of once per query head.

#include "cpu_kernels.h"
#include "vec_math.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace platform_core_cpu {
namespace {

constexpr int64_t kTileRows = 32;  // query rows (tokens x grouped heads) one work item aims at
constexpr int64_t kDecodesPerThread = 4;  // decodes per thread before one item takes all heads

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Sizes and element strides; the cache is seen as [2, blocks, kv_heads, block_size, head_size].
struct Geometry {
  int64_t group, head_size, block_size, padded_head;
  int64_t q_token_stride, q_head_stride, o_token_stride, o_head_stride;
  int64_t kv_stride, block_stride, kv_head_stride, slot_stride, table_stride;
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

// bf16 query-key dot products straight from the cache (no fp32 copy of the keys) where the
// CPU has AVX512-BF16; T = float and other CPUs take the fp32 path.
template <typename T>
constexpr bool kBf16Dots = kHasBf16Dot && std::is_same_v<T, c10::BFloat16>;

// Per-thread buffers: query rows (fp32, and raw bf16 for the bf16 dots), their accumulators,
// one K block and one V block in fp32.
struct Scratch {
  std::vector<float> q, acc, keys, values, scores, row_max, row_sum;
  std::vector<uint16_t> q16;
  Scratch(const Geometry& g, int64_t max_rows)
      : q(max_rows * g.padded_head),
        acc(max_rows * g.padded_head),
        keys(round_up(g.block_size, kLanes) * g.padded_head, 0.0f),  // padding stays zero
        values(g.block_size * g.padded_head, 0.0f),
        scores(round_up(g.block_size, kLanes)),
        row_max(max_rows),
        row_sum(max_rows),
        q16(max_rows * round_up(g.head_size, kBf16Pair), 0) {}
};

// Converts a block's values (and its keys, unless the dots read them as bf16) to fp32.
template <typename T>
void load_block(const T* keys, const T* values, int64_t valid, const Geometry& g, Scratch& s) {
  for (int64_t j = 0; j < valid; ++j) {
    const T* v = values + j * g.slot_stride;
    float* vo = s.values.data() + j * g.padded_head;
#pragma omp simd
    for (int64_t d = 0; d < g.head_size; ++d) vo[d] = to_float(v[d]);
    if constexpr (!kBf16Dots<T>) {
      const T* k = keys + j * g.slot_stride;
      float* ko = s.keys.data() + j * g.padded_head;
#pragma omp simd
      for (int64_t d = 0; d < g.head_size; ++d) ko[d] = to_float(k[d]);
    }
  }
}

// Asks for a block's K/V rows ahead of use: blocks are scattered, so hardware prefetch misses them.
template <typename T>
void prefetch_block(const T* keys, const T* values, int64_t valid, const Geometry& g) {
  constexpr int64_t kLine = 64 / sizeof(T);
  for (int64_t j = 0; j < valid; ++j) {
    for (int64_t d = 0; d < g.head_size; d += kLine) {
      __builtin_prefetch(keys + j * g.slot_stride + d);
      __builtin_prefetch(values + j * g.slot_stride + d);
    }
  }
}

// Scaled dot products of row r with keys j .. j+15 of the block (`keys` in the cache); lanes
// at or past `count` are unspecified.
template <typename T>
vec16 block_dots(int64_t r, int64_t j, int64_t count, const T* keys, const Geometry& g,
                 const Scratch& s) {
  if constexpr (kBf16Dots<T>) {
    const int64_t stride = round_up(g.head_size, kBf16Pair);
    return dot16_bf16(s.q16.data() + r * stride,
                      reinterpret_cast<const uint16_t*>(keys + j * g.slot_stride),
                      g.slot_stride, g.head_size, std::min<int64_t>(kLanes, count - j)) *
           g.scale;
  } else {
    return dot16(s.q.data() + r * g.padded_head, s.keys.data() + j * g.padded_head,
                 g.padded_head);
  }
}

// Folds the first `count` keys of the loaded block into row r's running max, sum and output.
template <typename T>
void attend_block(int64_t r, int64_t count, const T* keys, const Geometry& g, Scratch& s) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  float* scores = s.scores.data();
  vec16 block_max = splat(kNegInf);
  for (int64_t j = 0; j < count; j += kLanes) {
    const vec16 dots = block_dots(r, j, count, keys, g, s);
    block_max = vmax(block_max, keep_first(dots, count - j, kNegInf));
    store16(scores + j, dots);
  }
  const float new_max = std::max(s.row_max[r], hmax(block_max));
  const float decay = exp16(splat(s.row_max[r] - new_max))[0];  // ~0 on the row's first block
  vec16 block_sum = {};
  for (int64_t j = 0; j < count; j += kLanes) {
    const vec16 p = keep_first(exp16(load16(scores + j) - new_max), count - j, 0.0f);
    store16(scores + j, p);
    block_sum += p;
  }
  s.row_sum[r] = s.row_sum[r] * decay + hsum(block_sum);
  s.row_max[r] = new_max;
  decay_and_accumulate(s.acc.data() + r * g.padded_head, decay, scores, count, s.values.data(),
                       g.padded_head);
}

// Asks for block `blk` of a sequence's table ahead of use, if the sequence reaches it.
template <typename T>
void prefetch_table_block(const int32_t* table, int64_t blk, int64_t kv_len, int64_t kv_head,
                          const Geometry& g, const Batch<T>& b) {
  const int64_t start = blk * g.block_size;
  if (start >= kv_len) return;
  const T* keys = b.cache + table[blk] * g.block_stride + kv_head * g.kv_head_stride;
  prefetch_block(keys, keys + g.kv_stride, std::min(g.block_size, kv_len - start), g);
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
    if constexpr (kBf16Dots<T>) {
      std::memcpy(s.q16.data() + r * round_up(g.head_size, kBf16Pair), src,
                  g.head_size * sizeof(T));  // the padding stays zero
    } else {
      float* q = s.q.data() + r * g.padded_head;
      for (int64_t d = 0; d < g.head_size; ++d) q[d] = to_float(src[d]) * g.scale;
      std::fill(q + g.head_size, q + g.padded_head, 0.0f);
    }
    std::fill_n(s.acc.data() + r * g.padded_head, g.padded_head, 0.0f);
    s.row_max[r] = -std::numeric_limits<float>::infinity();
    s.row_sum[r] = 0.0f;
  }
  const int64_t kv_len = first_pos + (item.q_end - seq_start);  // keys the last row sees
  const int32_t* table = b.block_tables + item.seq * g.table_stride;
  auto prefetch = [&](int64_t blk) {
    for (int64_t h = item.kv_head; h < item.kv_head_end; ++h) {
      prefetch_table_block(table, blk, kv_len, h, g, b);
    }
  };
  for (int64_t blk = 0; blk * g.block_size < kv_len; ++blk) {
    const int64_t block_start = blk * g.block_size;
    const int64_t valid = std::min(g.block_size, kv_len - block_start);
    prefetch(blk + 1);
    // The item's heads of one block lie side by side: read them in order.
    for (int64_t h = 0; h < heads; ++h) {
      const T* keys =
          b.cache + table[blk] * g.block_stride + (item.kv_head + h) * g.kv_head_stride;
      load_block(keys, keys + g.kv_stride, valid, g, s);
      for (int64_t r = h * map.rows_per_head; r < (h + 1) * map.rows_per_head; ++r) {
        const int64_t pos = first_pos + (map.token(r) - seq_start);
        const int64_t count = std::min(valid, pos - block_start + 1);
        if (count <= 0) continue;
        attend_block(r, count, keys, g, s);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    T* dst = b.out + map.token(r) * g.o_token_stride + map.head(r) * g.o_head_stride;
    const float* acc = s.acc.data() + r * g.padded_head;
    const float inv = 1.0f / s.row_sum[r];
    for (int64_t d = 0; d < g.head_size; ++d) dst[d] = from_float<T>(acc[d] * inv);
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
  constexpr int64_t kKeyVisitsPerThread = 1 << 14;
  const int64_t threads = std::clamp<int64_t>(
      p.key_visits / kKeyVisitsPerThread, 1,
      std::min<int64_t>(at::get_num_threads(), p.items.size()));
#pragma omp parallel num_threads(threads)
  {
    Scratch scratch(g, max_rows);
#pragma omp for schedule(dynamic, 1)
    for (size_t i = 0; i < p.items.size(); ++i) run_item(p.items[i], g, batch, scratch);
  }
}

}  // namespace

void paged_attention(const at::Tensor& query, const at::Tensor& kv_cache,
                     const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                     const at::Tensor& block_tables, double scale, const at::Tensor& out) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query/out: [tokens, heads, D]");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2, "kv_cache: [2, NB, KVH, BS, D]");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && kv_cache.stride(4) == 1,
              "the head dimension must be contiguous");
  TORCH_CHECK(query.scalar_type() == kv_cache.scalar_type() &&
                  out.scalar_type() == query.scalar_type(),
              "query, kv_cache and out must share a dtype");
  for (const at::Tensor* t : {&query_start_loc, &seq_lens, &block_tables}) {
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(), "metadata: contiguous int32");
  }
  const int64_t heads = query.size(1), kv_heads = kv_cache.size(2);
  TORCH_CHECK(heads % kv_heads == 0, "query heads must be a multiple of kv heads");
  const int64_t head_size = query.size(2), block_size = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == head_size, "head size mismatch between query and kv_cache");
  const Geometry g{heads / kv_heads, head_size, block_size, round_up(head_size, kLanes),
                   query.stride(0), query.stride(1),
                   out.stride(0), out.stride(1), kv_cache.stride(0), kv_cache.stride(1),
                   kv_cache.stride(2), kv_cache.stride(3), block_tables.stride(0),
                   static_cast<float>(scale)};
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
