// fabric::verbs::VerbsAddress::from_bytes on arbitrary bytes: the verbs provider's endpoint name,
// carried inside a NetAddr and inside every handshake message, so it comes from remote peers.
//
// Property: fixed 32-byte format with a version byte, a reserved byte that must be zero, and every
// other byte a field stored verbatim. So an accepted input re-serialises to itself, and the result
// parses to an equal value. The queue pair number is in 1..2^24-1; describe() (used in log lines
// about the peer) must work on anything accepted.
#include <algorithm>

#include "fuzz_support.h"
#include "providers/verbs/verbs_wire.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using fabric::verbs::VerbsAddress;
  std::span<const uint8_t> in(data, size);
  auto a = fuzz::parse([&] { return VerbsAddress::from_bytes(in); });
  if (!a) return 0;

  FUZZ_CHECK(size == VerbsAddress::kSize);
  std::string bytes = fuzz::must([&] { return a->to_bytes(); });
  FUZZ_CHECK(std::equal(bytes.begin(), bytes.end(), in.begin(), in.end(),
                        [](char b, uint8_t i) { return static_cast<uint8_t>(b) == i; }));
  FUZZ_CHECK(fuzz::must([&] { return VerbsAddress::from_bytes(fuzz::bytes_of(bytes)); }) == *a);
  FUZZ_CHECK(a->ud_qpn >= 1 && a->ud_qpn < (1u << 24));
  FUZZ_CHECK(!fuzz::must([&] { return a->describe(); }).empty());
  return 0;
}
