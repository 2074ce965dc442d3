// The CPU reference of MoE dispatch and combine (include/fabric/moe/reference.h). It follows the
// documented output layout directly: expert e's rows are the slots that name e, from source ranks
// in rank order, each source's by token, then top-k slot.
#include "fabric/moe/reference.h"

#include <cmath>
#include <cstring>

#include "layout.h"

namespace fabric::moe {

namespace {

struct Shape {
  uint64_t L, M, payload, scales;
};

Shape shape_of(const AllToAllConfig& c) {
  const bool fp8 = c.dispatch_dtype == Dtype::kFp8;
  return {c.experts / c.ranks, uint64_t{c.ranks} * c.max_tokens, fp8 ? c.hidden : 2ull * c.hidden, fp8 ? c.hidden / 128ull : 0};
}

// Calls f(source, token, slot, row) for every slot that names expert e, in output row order.
template <typename F>
void for_rows_of(const AllToAllConfig& c, std::span<const ReferenceInput> inputs, uint32_t e, F&& f) {
  uint64_t row = 0;
  for (uint32_t s = 0; s < c.ranks; ++s)
    for (uint32_t t = 0; t < inputs[s].num_tokens; ++t)
      for (uint32_t k = 0; k < c.topk; ++k)
        if (inputs[s].topk_idx[uint64_t{t} * c.topk + k] == e) f(s, t, k, row++);
}

}  // namespace

std::vector<ReferenceDispatch> reference_dispatch(const AllToAllConfig& c, std::span<const ReferenceInput> inputs) {
  const Shape sh = shape_of(c);
  std::vector<ReferenceDispatch> out(c.ranks);
  for (uint32_t d = 0; d < c.ranks; ++d) {
    ReferenceDispatch& o = out[d];
    o.counts.assign(sh.L, 0);
    o.x.assign(sh.L * sh.M * sh.payload, std::byte{0});
    o.scales.assign(sh.L * sh.M * sh.scales, 0.0f);
    o.src.assign(sh.L * sh.M, -1);
    for (uint32_t el = 0; el < sh.L; ++el)
      for_rows_of(c, inputs, static_cast<uint32_t>(d * sh.L + el), [&](uint32_t s, uint32_t t, uint32_t, uint64_t row) {
        const uint64_t at = el * sh.M + row;
        std::memcpy(o.x.data() + at * sh.payload, inputs[s].x.data() + t * sh.payload, sh.payload);
        if (sh.scales) std::memcpy(o.scales.data() + at * sh.scales, inputs[s].x_scales.data() + t * sh.scales, 4 * sh.scales);
        o.src[at] = static_cast<int32_t>(s * c.max_tokens + t);
        o.counts[el]++;
      });
  }
  return out;
}

std::vector<uint16_t> reference_combine(const AllToAllConfig& c, std::span<const ReferenceInput> inputs, uint32_t rank,
                                        std::span<const std::vector<uint16_t>> expert_out) {
  const Shape sh = shape_of(c);
  const ReferenceInput& in = inputs[rank];
  // Where each (token, slot) of this rank landed: the expert's rank and its output row.
  std::vector<int64_t> row_of(uint64_t{in.num_tokens} * c.topk, -1);
  for (uint32_t e = 0; e < c.experts; ++e)
    for_rows_of(c, inputs, e, [&](uint32_t s, uint32_t t, uint32_t k, uint64_t row) {
      if (s == rank) row_of[uint64_t{t} * c.topk + k] = static_cast<int64_t>((e % sh.L) * sh.M + row);
    });
  std::vector<uint16_t> out(uint64_t{in.num_tokens} * c.hidden);
  std::vector<float> acc(c.hidden);
  for (uint32_t t = 0; t < in.num_tokens; ++t) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (uint32_t k = 0; k < c.topk; ++k) {
      const uint64_t slot = uint64_t{t} * c.topk + k;
      if (in.topk_idx[slot] < 0) continue;
      const uint32_t d = static_cast<uint32_t>(in.topk_idx[slot] / static_cast<int64_t>(sh.L));
      const uint16_t* x = expert_out[d].data() + static_cast<uint64_t>(row_of[slot]) * c.hidden;
      for (uint32_t h = 0; h < c.hidden; ++h) acc[h] = std::fma(in.topk_weights[slot], detail::bf16_to_float(x[h]), acc[h]);
    }
    for (uint32_t h = 0; h < c.hidden; ++h) out[uint64_t{t} * c.hidden + h] = detail::float_to_bf16(acc[h]);
  }
  return out;
}

}  // namespace fabric::moe
