// Hex encoding of serialized addresses and descriptors; UTF-8 validation of their text fields.
#include "util/bytes.h"

namespace fabric::util {

std::string to_hex(std::span<const uint8_t> bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string s;
  s.reserve(bytes.size() * 2);
  for (uint8_t b : bytes) {
    s.push_back(kDigits[b >> 4]);
    s.push_back(kDigits[b & 15]);
  }
  return s;
}

static int hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

std::vector<uint8_t> from_hex(std::string_view hex, std::string_view what) {
  if (hex.size() % 2 != 0)
    throw Error(ErrorCode::kMalformed, std::string(what) + ": hex string has odd length " +
                                          std::to_string(hex.size()));
  std::vector<uint8_t> out(hex.size() / 2);
  for (size_t i = 0; i < out.size(); i++) {
    int hi = hex_value(hex[2 * i]), lo = hex_value(hex[2 * i + 1]);
    if (hi < 0 || lo < 0)
      throw Error(ErrorCode::kMalformed, std::string(what) + ": non-hex character at position " +
                                             std::to_string(hi < 0 ? 2 * i : 2 * i + 1));
    out[i] = static_cast<uint8_t>(hi << 4 | lo);
  }
  return out;
}

size_t utf8_error_offset(std::string_view s) {
  auto at = [&](size_t i) { return static_cast<uint8_t>(s[i]); };
  auto cont = [](uint8_t b, uint8_t lo = 0x80, uint8_t hi = 0xbf) { return b >= lo && b <= hi; };
  size_t i = 0;
  while (i < s.size()) {
    uint8_t b = at(i);
    size_t left = s.size() - i;
    size_t n = 0;
    if (b < 0x80) {
      n = 1;
    } else if (b >= 0xc2 && b <= 0xdf) {  // 0xc0, 0xc1: overlong two-byte forms
      n = left >= 2 && cont(at(i + 1)) ? 2 : 0;
    } else if (b >= 0xe0 && b <= 0xef) {
      // E0: A0..BF (no overlong); ED: 80..9F (no surrogates).
      uint8_t lo = b == 0xe0 ? 0xa0 : 0x80, hi = b == 0xed ? 0x9f : 0xbf;
      n = left >= 3 && cont(at(i + 1), lo, hi) && cont(at(i + 2)) ? 3 : 0;
    } else if (b >= 0xf0 && b <= 0xf4) {  // 0xf5..0xff: above U+10FFFF or not UTF-8 at all
      // F0: 90..BF (no overlong); F4: 80..8F (nothing above U+10FFFF).
      uint8_t lo = b == 0xf0 ? 0x90 : 0x80, hi = b == 0xf4 ? 0x8f : 0xbf;
      n = left >= 4 && cont(at(i + 1), lo, hi) && cont(at(i + 2)) && cont(at(i + 3)) ? 4 : 0;
    }
    if (n == 0) return i;
    i += n;
  }
  return std::string_view::npos;
}

}  // namespace fabric::util
