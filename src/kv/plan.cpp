// The KV-cache write plan: which bytes of one layer a prefill rank writes into which decode rank.
#include <fmt/format.h>

#include <algorithm>

#include "fabric/error.h"
#include "fabric/kv/layout.h"

namespace fabric::kv {

namespace {

uint32_t heads_per_rank(uint32_t total_heads, uint32_t size, const char* side) {
  if (size == 0 || total_heads == 0 || total_heads % size != 0)
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("kv: {} KV heads do not split evenly over {} {} ranks", total_heads, size, side));
  return total_heads / size;
}

// A decode rank receives whole pages when each run is a whole contiguous block of both pages.
bool whole_pages(PageOrder order, uint32_t prefill_size, uint32_t decode_size) {
  return order == PageOrder::kHeadMajor || prefill_size == decode_size;
}

void check_layouts(const KvLayout& p, const KvLayout& d, uint32_t total_heads, uint32_t prefill_size,
                   uint32_t decode_size) {
  if (p.num_layers != d.num_layers || p.page_tokens != d.page_tokens || p.head_dim != d.head_dim ||
      p.dtype_bytes != d.dtype_bytes || p.order != d.order)
    throw Error(ErrorCode::kInvalidArgument,
                "kv: prefill and decode layouts differ in layers, page tokens, head size, dtype or page "
                "order (only the heads per rank may differ)");
  if (p.kv_heads != heads_per_rank(total_heads, prefill_size, "prefill") ||
      d.kv_heads != heads_per_rank(total_heads, decode_size, "decode"))
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("kv: layouts hold {} and {} heads, but {} heads over TP {} and {} give {} and {}",
                            p.kv_heads, d.kv_heads, total_heads, prefill_size, decode_size,
                            total_heads / prefill_size, total_heads / decode_size));
  for (const KvLayout* l : {&p, &d})
    if (l->stride() < l->page_bytes() || l->stride() % l->token_bytes() != 0)
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("kv: page stride {} must be at least the page ({} bytes) and a multiple "
                              "of a token's {} bytes",
                              l->stride(), l->page_bytes(), l->token_bytes()));
}

}  // namespace

std::vector<HeadOverlap> head_overlaps(uint32_t total_heads, TensorParallel prefill, uint32_t decode_size) {
  const uint32_t ph = heads_per_rank(total_heads, prefill.size, "prefill");
  const uint32_t dh = heads_per_rank(total_heads, decode_size, "decode");
  if (prefill.rank >= prefill.size)
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("kv: prefill rank {} of a TP size {}", prefill.rank, prefill.size));
  const uint32_t first = prefill.rank * ph, end = first + ph;
  std::vector<HeadOverlap> out;
  for (uint32_t r = first / dh; r < decode_size && r * dh < end; r++) {
    const uint32_t lo = std::max(first, r * dh), hi = std::min(end, (r + 1) * dh);
    out.push_back({r, lo - first, lo - r * dh, hi - lo});
  }
  return out;
}

std::vector<LayerWrite> plan_layer(const KvLayout& p, const KvLayout& d, uint32_t total_heads,
                                   TensorParallel prefill_tp, uint32_t decode_size,
                                   std::span<const uint32_t> src_pages, std::span<const uint32_t> dst_pages) {
  check_layouts(p, d, total_heads, prefill_tp.size, decode_size);
  if (src_pages.size() != dst_pages.size())
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("kv: {} prefill pages but {} decode pages", src_pages.size(), dst_pages.size()));
  for (uint32_t s : src_pages)
    if (s >= p.num_pages) throw Error(ErrorCode::kOutOfBounds, fmt::format("kv: prefill page {} of {}", s, p.num_pages));
  for (uint32_t s : dst_pages)
    if (s >= d.num_pages) throw Error(ErrorCode::kOutOfBounds, fmt::format("kv: decode page {} of {}", s, d.num_pages));

  const bool whole = whole_pages(p.order, prefill_tp.size, decode_size);
  std::vector<LayerWrite> out;
  for (const HeadOverlap& o : head_overlaps(total_heads, prefill_tp, decode_size)) {
    LayerWrite w;
    w.decode_rank = o.decode_rank;
    if (whole) {
      // One run per page: the overlap's heads for every token, contiguous on both sides.
      const uint64_t head_block = p.order == PageOrder::kHeadMajor ? uint64_t{p.page_tokens} * p.head_bytes() : 0;
      w.run_bytes = p.order == PageOrder::kHeadMajor ? o.heads * head_block : p.page_bytes();
      w.src_offset = o.src_head * head_block;
      w.dst_offset = o.dst_head * head_block;
      w.src_stride = p.stride();
      w.dst_stride = d.stride();
      w.src_index.assign(src_pages.begin(), src_pages.end());
      w.dst_index.assign(dst_pages.begin(), dst_pages.end());
    } else {
      // One run per token: the overlap's heads of that token (token-major pages, TP sizes differ).
      // Token t of page q is token q * (stride / token_bytes) + t of the tensor.
      w.run_bytes = o.heads * p.head_bytes();
      w.src_offset = o.src_head * p.head_bytes();
      w.dst_offset = o.dst_head * d.head_bytes();
      w.src_stride = p.token_bytes();
      w.dst_stride = d.token_bytes();
      const uint64_t src_tokens_per_page = p.stride() / p.token_bytes();
      const uint64_t dst_tokens_per_page = d.stride() / d.token_bytes();
      if ((p.num_pages ? (p.num_pages - 1) * src_tokens_per_page + p.page_tokens : 0) > UINT32_MAX ||
          (d.num_pages ? (d.num_pages - 1) * dst_tokens_per_page + d.page_tokens : 0) > UINT32_MAX)
        throw Error(ErrorCode::kInvalidArgument, "kv: more than 2^32 tokens in one tensor");
      w.src_index.reserve(src_pages.size() * p.page_tokens);
      w.dst_index.reserve(src_pages.size() * p.page_tokens);
      for (size_t i = 0; i < src_pages.size(); i++)
        for (uint32_t t = 0; t < p.page_tokens; t++) {
          w.src_index.push_back(static_cast<uint32_t>(src_pages[i] * src_tokens_per_page + t));
          w.dst_index.push_back(static_cast<uint32_t>(dst_pages[i] * dst_tokens_per_page + t));
        }
    }
    LayerWrite v = w;
    v.value = true;
    out.push_back(std::move(w));
    out.push_back(std::move(v));
  }
  return out;
}

uint64_t layer_writes_into(const KvLayout& prefill, uint32_t total_heads, uint32_t prefill_size,
                           TensorParallel decode_tp, uint32_t pages) {
  heads_per_rank(total_heads, decode_tp.size, "decode");
  uint64_t writes = 0;
  const uint64_t per_tensor = whole_pages(prefill.order, prefill_size, decode_tp.size)
                                  ? pages
                                  : uint64_t{pages} * prefill.page_tokens;
  for (uint32_t r = 0; r < prefill_size; r++)
    for (const HeadOverlap& o : head_overlaps(total_heads, {prefill_size, r}, decode_tp.size))
      if (o.decode_rank == decode_tp.rank) writes += 2 * per_tensor;  // K and V
  return writes;
}

}  // namespace fabric::kv
