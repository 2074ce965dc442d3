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

inline std::span<const uint8_t> bytes_of(std::string_view s) {
  return {reinterpret_cast<const uint8_t*>(s.data()), s.size()};
}

}  // namespace fuzz
