#include "kv/endpoint.h"

#include <fmt/format.h>

namespace fabric::kv {

void check_layout(const KvLayout& l, const KvTensors& t, const KvRank& rank) {
  if (l.num_layers == 0 || l.num_layers > kMaxLayers)
    throw Error(ErrorCode::kInvalidArgument, fmt::format("kv: {} layers; 1 to {} are supported", l.num_layers, kMaxLayers));
  if (t.k.size() != l.num_layers || t.v.size() != l.num_layers)
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("kv: {} K and {} V tensors for {} layers", t.k.size(), t.v.size(), l.num_layers));
  if (rank.tp.size == 0 || rank.tp.rank >= rank.tp.size || rank.total_heads % rank.tp.size != 0 ||
      l.kv_heads != rank.total_heads / rank.tp.size)
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("kv: rank {} of TP {} with {} of {} heads: the heads must split evenly", rank.tp.rank,
                            rank.tp.size, l.kv_heads, rank.total_heads));
  if (l.num_pages == 0 || l.page_tokens == 0 || l.head_dim == 0 || l.dtype_bytes == 0)
    throw Error(ErrorCode::kInvalidArgument, "kv: pages, page tokens, head size and dtype must be non-zero");
  if ((t.extras != nullptr) != (t.extra_slots > 0) || (t.extra_slots > 0) != (t.extra_bytes > 0))
    throw Error(ErrorCode::kInvalidArgument,
                "kv: extras need all three of a pointer, a slot count and a slot size (or none of them)");
}

Registered::Registered(TransferEngine& e, const KvLayout& l, const KvTensors& t, const ImmReservation& imms)
    : engine(e) {
  auto reg = [&](void* p, uint64_t len) { return imms.held() ? e.reg_mr(p, len, t.device, imms) : e.reg_mr(p, len, t.device); };
  try {
    for (uint32_t i = 0; i < l.num_layers; i++) {
      auto [hk, dk] = reg(t.k[i], l.tensor_bytes());
      k.push_back(hk);
      k_desc.push_back(dk);
      auto [hv, dv] = reg(t.v[i], l.tensor_bytes());
      v.push_back(hv);
      v_desc.push_back(dv);
    }
    if (t.extra_slots) {
      auto [h, d] = reg(t.extras, uint64_t{t.extra_slots} * t.extra_bytes);
      extras = h;
      extras_desc = d;
    }
  } catch (...) {
    release();
    throw;
  }
}

void Registered::release() {
  for (auto* list : {&k, &v})
    for (MrHandle h : *list) engine.dereg_mr(h);
  if (extras) engine.dereg_mr(*extras);
  k.clear();
  v.clear();
  extras.reset();
}

Registered::~Registered() { release(); }

wire::Descriptor Endpoint::descriptor() const {
  return wire::Descriptor{.rank = rank,
                          .layout = layout,
                          .extra_slots = tensors.extra_slots,
                          .extra_bytes = tensors.extra_bytes,
                          .k = regions.k_desc,
                          .v = regions.v_desc,
                          .extras = regions.extras_desc};
}

}  // namespace fabric::kv
