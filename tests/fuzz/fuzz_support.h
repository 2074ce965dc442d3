// Shared helpers of the fuzz targets: what counts as a clean rejection, and how a violated property
// stops the fuzzer (__builtin_trap: libFuzzer reports it as a crash and saves the input).
#pragma once

#include <cstdint>
#include <cstdio>
#include <exception>
#include <optional>
#include <span>
#include <string_view>

#include "fabric/error.h"

namespace fuzz {

[[noreturn]] inline void violated(const char* what, const char* file, int line) {
  std::fprintf(stderr, "fuzz property violated: %s (%s:%d)\n", what, file, line);
  __builtin_trap();
}

#define FUZZ_CHECK(cond) ((cond) ? (void)0 : ::fuzz::violated(#cond, __FILE__, __LINE__))

// Runs a parser on untrusted bytes. The only acceptable failure is fabric::Error(kMalformed);
// anything else (another error code, std::bad_alloc, std::out_of_range, ...) is a bug: trap.
// Returns nullopt for a clean rejection.
template <class F>
auto parse(F&& f) -> std::optional<decltype(f())> {
  try {
    return f();
  } catch (const fabric::Error& e) {
    if (e.code() == fabric::ErrorCode::kMalformed) return std::nullopt;
    std::fprintf(stderr, "parser threw a non-kMalformed error: %s\n", e.what());
    __builtin_trap();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "parser threw a foreign exception: %s\n", e.what());
    __builtin_trap();
  } catch (...) {
    std::fprintf(stderr, "parser threw a non-std exception\n");
    __builtin_trap();
  }
}

// Runs something that must not fail at all (re-serialising and re-parsing a value that parsed).
template <class F>
auto must(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "round trip of an accepted value threw: %s\n", e.what());
    __builtin_trap();
  } catch (...) {
    __builtin_trap();
  }
}

// An oracle for UTF-8 well-formedness written differently from util::utf8_error_offset (which
// checks byte ranges, Unicode table 3-7): decode each code point from its lead byte's length, then
// reject overlong forms (a code point below the minimum for its length), surrogates and values above
// U+10FFFF. Returns the offset of the first sequence that does not decode, or npos.
inline size_t utf8_oracle_error(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    auto b = static_cast<uint8_t>(s[i]);
    size_t len = b < 0x80 ? 1 : (b >> 5) == 0x6 ? 2 : (b >> 4) == 0xe ? 3 : (b >> 3) == 0x1e ? 4 : 0;
    if (len == 0 || s.size() - i < len) return i;
    uint32_t cp = len == 1 ? b : len == 2 ? (b & 0x1fu) : len == 3 ? (b & 0x0fu) : (b & 0x07u);
    for (size_t k = 1; k < len; k++) {
      auto c = static_cast<uint8_t>(s[i + k]);
      if ((c >> 6) != 0x2) return i;
      cp = (cp << 6) | (c & 0x3fu);
    }
    static constexpr uint32_t kMin[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < kMin[len] || (cp >= 0xd800 && cp <= 0xdfff) || cp > 0x10ffff) return i;
    i += len;
  }
  return std::string_view::npos;
}
inline bool utf8_oracle(std::string_view s) { return utf8_oracle_error(s) == std::string_view::npos; }

inline std::span<const uint8_t> bytes_of(std::string_view s) {
  return {reinterpret_cast<const uint8_t*>(s.data()), s.size()};
}

}  // namespace fuzz
