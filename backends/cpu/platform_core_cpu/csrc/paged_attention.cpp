// Causal paged attention on CPU. One work item is (sequence, KV head, tile of query tokens):
// it converts each K/V block of its causal window to fp32 once and runs an online softmax for
// every query row of the tile (its tokens times the query heads sharing that KV head), so a
// block is read once per KV-head group instead of once per query head.

#include "cpu_kernels.h"
#include "vec_math.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <limits>
#include <vector>

namespace platform_core_cpu {
namespace {

constexpr int64_t kTileRows = 32;  // query rows (tokens x grouped heads) one work item aims at

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

struct WorkItem {
  int64_t seq, kv_head, q_begin, q_end;
};

// Per-thread fp32 buffers: query rows, their accumulators, one K block and one V block.
struct Scratch {
  std::vector<float> q, acc, keys, values, scores, row_max, row_sum;
  Scratch(const Geometry& g, int64_t max_rows)
      : q(max_rows * g.padded_head),
        acc(max_rows * g.padded_head),
        keys(round_up(g.block_size, kLanes) * g.padded_head, 0.0f),  // padding stays zero
        values(g.block_size * g.padded_head, 0.0f),
        scores(round_up(g.block_size, kLanes)),
        row_max(max_rows),
        row_sum(max_rows) {}
};

template <typename T>
void load_block(const T* keys, const T* values, int64_t valid, const Geometry& g, Scratch& s) {
  for (int64_t j = 0; j < valid; ++j) {
    const T* k = keys + j * g.slot_stride;
    const T* v = values + j * g.slot_stride;
    float* ko = s.keys.data() + j * g.padded_head;
    float* vo = s.values.data() + j * g.padded_head;
#pragma omp simd
    for (int64_t d = 0; d < g.head_size; ++d) {
      ko[d] = to_float(k[d]);
      vo[d] = to_float(v[d]);
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

// Folds the first `count` keys of the loaded block into row r's running max, sum and output.
void attend_block(int64_t r, int64_t count, const Geometry& g, Scratch& s) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  float* scores = s.scores.data();
  const float* q = s.q.data() + r * g.padded_head;
  vec16 block_max = splat(kNegInf);
  for (int64_t j = 0; j < count; j += kLanes) {
    const vec16 dots = dot16(q, s.keys.data() + j * g.padded_head, g.padded_head);
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

template <typename T>
void run_item(const WorkItem& item, const Geometry& g, const Batch<T>& b, Scratch& s) {
  const int64_t seq_start = b.query_start_loc[item.seq];
  const int64_t seq_len = b.seq_lens[item.seq];
  // Position of the sequence's first query token within the sequence.
  const int64_t first_pos = seq_len - (b.query_start_loc[item.seq + 1] - seq_start);
  const int64_t rows = (item.q_end - item.q_begin) * g.group;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t head = item.kv_head * g.group + r % g.group;
    const T* src = b.query + (item.q_begin + r / g.group) * g.q_token_stride +
                   head * g.q_head_stride;
    float* q = s.q.data() + r * g.padded_head;
    for (int64_t d = 0; d < g.head_size; ++d) q[d] = to_float(src[d]) * g.scale;
    std::fill(q + g.head_size, q + g.padded_head, 0.0f);
    std::fill_n(s.acc.data() + r * g.padded_head, g.padded_head, 0.0f);
    s.row_max[r] = -std::numeric_limits<float>::infinity();
    s.row_sum[r] = 0.0f;
  }
  const int64_t kv_len = first_pos + (item.q_end - seq_start);  // keys the last row sees
  const int32_t* table = b.block_tables + item.seq * g.table_stride;
  for (int64_t blk = 0; blk * g.block_size < kv_len; ++blk) {
    const int64_t block_start = blk * g.block_size;
    const int64_t valid = std::min(g.block_size, kv_len - block_start);
    const T* keys = b.cache + table[blk] * g.block_stride + item.kv_head * g.kv_head_stride;
    if (block_start + g.block_size < kv_len) {
      const T* next = b.cache + table[blk + 1] * g.block_stride + item.kv_head * g.kv_head_stride;
      prefetch_block(next, next + g.kv_stride,
                     std::min(g.block_size, kv_len - block_start - g.block_size), g);
    }
    load_block(keys, keys + g.kv_stride, valid, g, s);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t pos = first_pos + (item.q_begin + r / g.group - seq_start);
      const int64_t count = std::min(valid, pos - block_start + 1);
      if (count <= 0) continue;
      attend_block(r, count, g, s);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t head = item.kv_head * g.group + r % g.group;
    T* dst = b.out + (item.q_begin + r / g.group) * g.o_token_stride + head * g.o_head_stride;
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

// Work items, the heavier (later) query tiles of each sequence first.
Plan plan(const int32_t* query_start_loc, const int32_t* seq_lens, int64_t num_seqs,
          int64_t kv_heads, int64_t group, int64_t tile_tokens) {
  Plan p;
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    const int64_t first = query_start_loc[seq], last = query_start_loc[seq + 1];
    for (int64_t end = last; end > first; end -= tile_tokens) {
      const int64_t begin = std::max(first, end - tile_tokens);
      const int64_t keys = seq_lens[seq] - (last - end) + 1;  // seen by the tile's last row
      p.key_visits += kv_heads * group * (end - begin) * keys;
      for (int64_t h = 0; h < kv_heads; ++h) p.items.push_back({seq, h, begin, end});
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
                         seq_lens.size(0), kv_heads, g.group, tile_tokens);
  if (work.items.empty()) return;
  const int64_t max_rows = tile_tokens * g.group;
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
