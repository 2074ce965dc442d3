// The hex forms of NetAddr and MrDesc (what users paste on command lines and store in key-value
// stores), and util::from_hex underneath, on arbitrary text.
//
// Properties:
//  - util::from_hex accepts exactly the even-length strings of [0-9a-fA-F] (checked against an
//    independent oracle), and to_hex of the result is the input in lower case (hex is canonical up
//    to case: each byte has one two-digit spelling per case).
//  - NetAddr::from_hex / MrDesc::from_hex accept exactly what from_hex + from_bytes accepts, give the
//    same value, and to_hex() gives the input back in lower case.
#include <algorithm>
#include <cctype>
#include <string>

#include "fabric/types.h"
#include "fuzz_support.h"
#include "util/bytes.h"

namespace {

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

bool is_hex_text(std::string_view s) {
  return s.size() % 2 == 0 && std::all_of(s.begin(), s.end(), [](char c) {
           return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
         });
}

// One value type T through its hex parser, compared with the byte parser on the decoded bytes.
template <class T>
void check_value(std::string_view text, const std::optional<std::vector<uint8_t>>& raw) {
  auto v = fuzz::parse([&] { return T::from_hex(text); });
  std::optional<T> via_bytes;
  if (raw) via_bytes = fuzz::parse([&] { return T::from_bytes(*raw); });
  FUZZ_CHECK(v.has_value() == via_bytes.has_value());
  if (!v) return;
  FUZZ_CHECK(*v == *via_bytes);
  FUZZ_CHECK(fuzz::must([&] { return v->to_hex(); }) == lower(text));
  FUZZ_CHECK(fuzz::must([&] { return T::from_hex(v->to_hex()); }) == *v);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view text(reinterpret_cast<const char*>(data), size);

  auto raw = fuzz::parse([&] { return fabric::util::from_hex(text, "fuzz"); });
  FUZZ_CHECK(raw.has_value() == is_hex_text(text));
  if (raw) {
    FUZZ_CHECK(raw->size() * 2 == text.size());
    FUZZ_CHECK(fabric::util::to_hex(*raw) == lower(text));
  }

  check_value<fabric::NetAddr>(text, raw);
  check_value<fabric::MrDesc>(text, raw);
  return 0;
}
