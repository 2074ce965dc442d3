// MrDesc::from_bytes on arbitrary bytes (memory descriptors are handed to remote peers, which send
// them back in requests or pass them on).
//
// Property: canonical like NetAddr. The embedded owner address has an explicit length that must be
// consumed exactly (NetAddr::from_bytes rejects trailing bytes), the key count is either 0 or the
// owner's NIC count, the local-key flag is 0 or 1, and nothing may follow. So an accepted input
// re-serialises to itself, and the result parses to an equal value, through bytes and hex. The
// owner's text fields (provider name, local endpoint) are well-formed UTF-8 (independent oracle).
#include <algorithm>

#include "fabric/types.h"
#include "fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::span<const uint8_t> in(data, size);
  auto d = fuzz::parse([&] { return fabric::MrDesc::from_bytes(in); });
  if (!d) return 0;

  auto bytes = fuzz::must([&] { return d->to_bytes(); });
  FUZZ_CHECK(std::equal(bytes.begin(), bytes.end(), in.begin(), in.end()));
  FUZZ_CHECK(fuzz::must([&] { return fabric::MrDesc::from_bytes(bytes); }) == *d);
  FUZZ_CHECK(fuzz::must([&] { return fabric::MrDesc::from_hex(d->to_hex()); }) == *d);

  // What the engine relies on when it uses a descriptor from a peer: at least one way to reach the
  // region, one key per NIC when there are NIC keys, a local key only with a local endpoint, and a
  // range that does not wrap around.
  FUZZ_CHECK(!d->keys().empty() || d->local_key().has_value());
  FUZZ_CHECK(d->keys().empty() || d->keys().size() == d->owner().nic_count());
  FUZZ_CHECK(!d->local_key() || !d->owner().local().empty());
  FUZZ_CHECK(d->addr() + d->len() >= d->addr());
  FUZZ_CHECK(fuzz::utf8_oracle(d->owner().provider()) && fuzz::utf8_oracle(d->owner().local()));
  return 0;
}
