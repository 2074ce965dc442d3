// NetAddr::from_bytes on arbitrary bytes (engine addresses arrive from a TCP store, a file, a peer).
//
// Property: the format is canonical. Every byte is a fixed magic/version byte, a length that the
// content determines, or content; the parser rejects trailing bytes. So an accepted input is exactly
// the serialisation of the value it parsed to: to_bytes(from_bytes(x)) == x, and parsing that again
// gives an equal value. The hex form must round-trip too.
//
// Text: the provider name and the local endpoint of an accepted address are well-formed UTF-8 (they
// reach error messages and Python str; NIC addresses are binary and may hold any bytes), by an
// independent oracle; and the library's UTF-8 validator agrees with that oracle, offset included,
// on every input taken as text.
#include <algorithm>

#include "fabric/types.h"
#include "fuzz_support.h"
#include "util/bytes.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::span<const uint8_t> in(data, size);
  std::string_view text(reinterpret_cast<const char*>(data), size);
  FUZZ_CHECK(fabric::util::utf8_error_offset(text) == fuzz::utf8_oracle_error(text));
  auto a = fuzz::parse([&] { return fabric::NetAddr::from_bytes(in); });
  if (!a) return 0;

  auto bytes = fuzz::must([&] { return a->to_bytes(); });
  FUZZ_CHECK(std::equal(bytes.begin(), bytes.end(), in.begin(), in.end()));
  FUZZ_CHECK(fuzz::must([&] { return fabric::NetAddr::from_bytes(bytes); }) == *a);
  FUZZ_CHECK(fuzz::must([&] { return fabric::NetAddr::from_hex(a->to_hex()); }) == *a);

  // The accessors agree with the limits the parser enforces.
  FUZZ_CHECK(!a->provider().empty() && a->provider().size() <= fabric::kMaxProviderNameLen);
  FUZZ_CHECK(a->nic_count() >= 1 && a->nic_count() <= fabric::kMaxNics);
  for (size_t i = 0; i < a->nic_count(); i++)
    FUZZ_CHECK(!a->nic(i).empty() && a->nic(i).size() <= fabric::kMaxNicAddrLen);
  FUZZ_CHECK(a->local().size() <= fabric::kMaxNicAddrLen);
  FUZZ_CHECK(fuzz::utf8_oracle(a->provider()) && fuzz::utf8_oracle(a->local()));
  return 0;
}
