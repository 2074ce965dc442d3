// The KV endpoints' wire formats on arbitrary bytes: the descriptor a decode rank publishes
// ("FBKV", KvSender::add_decoder) and the admit message it sends per request ("FBKA",
// KvSender::begin, kv::read_admit). Both come from other processes.
//
// Property: canonical. An accepted input re-encodes to itself (every count and flag is checked,
// the embedded MrDescs are canonical, nothing may follow), and what the endpoints rely on holds:
// 1 to 254 layers with one K and one V descriptor each, extras with both a slot count and a size,
// a TP rank inside its group.
#include <algorithm>

#include "fuzz_support.h"
#include "kv/wire.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace fabric::kv;
  std::span<const uint8_t> in(data, size);
  if (size >= 4 && data[3] == 'V') {
    auto d = fuzz::parse([&] { return wire::parse_descriptor(in); });
    if (!d) return 0;
    auto bytes = fuzz::must([&] { return wire::encode(*d); });
    FUZZ_CHECK(std::equal(bytes.begin(), bytes.end(), in.begin(), in.end()));
    FUZZ_CHECK(d->layout.num_layers >= 1 && d->layout.num_layers <= kMaxLayers);
    FUZZ_CHECK(d->k.size() == d->layout.num_layers && d->v.size() == d->layout.num_layers);
    FUZZ_CHECK(d->rank.tp.rank < d->rank.tp.size);
    FUZZ_CHECK((d->extra_slots == 0) == (d->extra_bytes == 0) && (d->extra_slots == 0) == !d->extras);
  } else {
    auto a = fuzz::parse([&] { return wire::parse_admit(in); });
    if (!a) return 0;
    auto bytes = fuzz::must([&] { return wire::encode(*a); });
    FUZZ_CHECK(std::equal(bytes.begin(), bytes.end(), in.begin(), in.end()));
    auto info = fuzz::must([&] { return read_admit(in); });
    FUZZ_CHECK(info.pages == a->pages && info.request == a->request && info.extra_slot == a->extra_slot);
  }
  return 0;
}
