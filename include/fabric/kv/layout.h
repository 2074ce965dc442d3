// KV-cache transfer (disaggregated prefill/decode): how a paged KV cache is laid out on each rank,
// and how one layer of one request becomes paged WRITEs from a prefill rank to the decode ranks,
// with prefill and decode tensor parallelism equal or not. This part is pure arithmetic (no
// engine): the sender and the receiver both derive from it what is written and how many
// immediates each decode rank counts, so they never exchange more than page indices.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace fabric::kv {

// The order inside one page of one layer's K (or V) tensor.
enum class PageOrder : uint8_t {
  kTokenMajor,  // [page_tokens, kv_heads, head_dim] (vLLM, SGLang): a head slice is strided per token
  kHeadMajor,   // [kv_heads, page_tokens, head_dim]: a head slice is one contiguous run
};

// One rank's paged KV cache: per layer a K and a V tensor of num_pages pages. Page p of a tensor
// starts page_stride bytes after page p-1: page_bytes() for separate K and V tensors, 2 x
// page_bytes() when K and V of a page are interleaved ([num_pages, 2, ...]).
struct KvLayout {
  uint32_t num_layers = 0;
  uint32_t num_pages = 0;
  uint32_t page_tokens = 0;
  uint32_t kv_heads = 0;  // the heads this rank holds (total heads / tensor-parallel size)
  uint32_t head_dim = 0;
  uint32_t dtype_bytes = 2;
  PageOrder order = PageOrder::kTokenMajor;
  uint64_t page_stride = 0;  // 0: page_bytes()

  uint64_t token_bytes() const { return uint64_t{kv_heads} * head_dim * dtype_bytes; }
  uint64_t head_bytes() const { return uint64_t{head_dim} * dtype_bytes; }
  uint64_t page_bytes() const { return token_bytes() * page_tokens; }
  uint64_t stride() const { return page_stride ? page_stride : page_bytes(); }
  // Bytes a tensor of this layout spans (what is registered).
  uint64_t tensor_bytes() const { return num_pages ? stride() * (num_pages - 1) + page_bytes() : 0; }
};

// Tensor parallelism of one side: `size` ranks split the model's KV heads evenly, rank r holding
// heads [r * H / size, (r + 1) * H / size).
struct TensorParallel {
  uint32_t size = 1;
  uint32_t rank = 0;
};

// The part of a prefill rank's heads that one decode rank holds.
struct HeadOverlap {
  uint32_t decode_rank = 0;
  uint32_t src_head = 0;  // first head, as an index into the prefill rank's own heads
  uint32_t dst_head = 0;  // the same head, as an index into the decode rank's own heads
  uint32_t heads = 0;
};

// The decode ranks whose heads overlap prefill rank `prefill.rank`'s, in rank order. Throws
// fabric::Error(kInvalidArgument) when total_heads is not divisible by either side's size.
std::vector<HeadOverlap> head_overlaps(uint32_t total_heads, TensorParallel prefill, uint32_t decode_size);

// One paged write of a layer plan: `count` runs of `run_bytes`, run i read at
// src_offset + src_stride * src_index[i] of the prefill tensor and written at
// dst_offset + dst_stride * dst_index[i] of the decode tensor (as PagedWrites takes them).
struct LayerWrite {
  uint32_t decode_rank = 0;
  bool value = false;  // the V tensor (else K)
  uint64_t run_bytes = 0;
  uint64_t src_offset = 0, src_stride = 0;
  uint64_t dst_offset = 0, dst_stride = 0;
  std::vector<uint32_t> src_index, dst_index;
};

// What a prefill rank writes for one layer of one request whose pages are src_pages on its side
// and dst_pages on the decode side (the same number: page i of the prompt): one LayerWrite per
// (decode rank, K/V). Whole pages where a decode rank holds all of the prefill rank's heads in one
// block of its page (equal TP, or kHeadMajor); otherwise one run per token and head block
// (token-major pages split across TP sizes). Layouts must agree on everything but kv_heads.
std::vector<LayerWrite> plan_layer(const KvLayout& prefill, const KvLayout& decode, uint32_t total_heads,
                                   TensorParallel prefill_tp, uint32_t decode_size,
                                   std::span<const uint32_t> src_pages, std::span<const uint32_t> dst_pages);

// WRITEs (so immediates, one per run) decode rank `decode_rank` receives for one layer of a request
// of `pages` pages, summed over every prefill rank: what its expectation for that layer counts.
uint64_t layer_writes_into(const KvLayout& prefill, uint32_t total_heads, uint32_t prefill_size,
                           TensorParallel decode_tp, uint32_t pages);

}  // namespace fabric::kv
