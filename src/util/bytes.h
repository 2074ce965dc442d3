// Little-endian byte writer and a bounds-checked reader for wire formats from outside the process.
#pragma once

#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "fabric/error.h"

namespace fabric::util {

class ByteWriter {
 public:
  void u8(uint8_t v) { out_.push_back(v); }
  void u16(uint16_t v) { raw(&v, sizeof v); }
  void u32(uint32_t v) { raw(&v, sizeof v); }
  void u64(uint64_t v) { raw(&v, sizeof v); }
  void raw(const void* p, size_t n) {
    auto* b = static_cast<const uint8_t*>(p);
    out_.insert(out_.end(), b, b + n);
  }
  std::vector<uint8_t> take() { return std::move(out_); }

 private:
  std::vector<uint8_t> out_;  // little-endian hosts only (x86_64, aarch64)
};

// The offset of the first byte of `s` that does not start a well-formed UTF-8 sequence (Unicode
// table 3-7: no overlong forms, no surrogates U+D800..U+DFFF, nothing above U+10FFFF, no truncated
// sequence), or npos when all of `s` is well-formed.
size_t utf8_error_offset(std::string_view s);
inline bool is_utf8(std::string_view s) { return utf8_error_offset(s) == std::string_view::npos; }

// Every read checks the remaining length; a short or malformed input throws kMalformed with
// `what` (the type being parsed) and the field that failed.
class ByteReader {
 public:
  ByteReader(std::span<const uint8_t> in, std::string_view what) : in_(in), what_(what) {}
  uint8_t u8(const char* field) { return read<uint8_t>(field); }
  uint16_t u16(const char* field) { return read<uint16_t>(field); }
  uint32_t u32(const char* field) { return read<uint32_t>(field); }
  uint64_t u64(const char* field) { return read<uint64_t>(field); }
  std::string str(size_t n, const char* field) {
    need(n, field);
    std::string s(reinterpret_cast<const char*>(in_.data() + pos_), n);
    pos_ += n;
    return s;
  }
  // A text field (it ends up in messages and in Python str): n bytes of well-formed UTF-8.
  std::string text(size_t n, const char* field) {
    std::string s = str(n, field);
    size_t bad = utf8_error_offset(s);
    if (bad != std::string_view::npos)
      fail(std::string("field '") + field + "' is not valid UTF-8 (byte " + std::to_string(bad) +
           " of " + std::to_string(n) + ")");
    return s;
  }
  size_t remaining() const { return in_.size() - pos_; }
  [[noreturn]] void fail(const std::string& why) const {
    throw Error(ErrorCode::kMalformed, std::string(what_) + ": " + why +
                                           " (was it produced by a different fabric-lib version, "
                                           "or truncated in transit?)");
  }
  void expect_end() const {
    if (remaining() != 0) fail(std::to_string(remaining()) + " trailing bytes");
  }

 private:
  void need(size_t n, const char* field) const {
    if (remaining() < n)
      fail(std::string("truncated at field '") + field + "' (need " + std::to_string(n) +
           " bytes, " + std::to_string(remaining()) + " left)");
  }
  template <class T>
  T read(const char* field) {
    need(sizeof(T), field);
    T v;
    std::memcpy(&v, in_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  std::span<const uint8_t> in_;
  std::string_view what_;
  size_t pos_ = 0;
};

std::string to_hex(std::span<const uint8_t> bytes);
// Throws kMalformed for odd length or a non-hex character.
std::vector<uint8_t> from_hex(std::string_view hex, std::string_view what);

}  // namespace fabric::util
