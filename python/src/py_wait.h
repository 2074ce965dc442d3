// Waiting from Python for a word that a worker, a NIC or a GPU sets: with the GIL released,
// spinning first, then yielding, then sleeping, so a short wait costs microseconds and a long one
// little CPU.
#pragma once

#include <nanobind/nanobind.h>

#include <chrono>
#include <cmath>
#include <optional>
#include <thread>

namespace fabric::py {

namespace nb = nanobind;

enum class WaitEnd { kDone, kTimedOut, kStopped };

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Spins for kSpin (an answer in flight, e.g. a GPU's store crossing PCIe, comes within it), then
// yields until kYield (still microseconds where the core is free: a yield with nothing else to
// run returns at once), then sleeps kSleep between checks. Sleeping at once, as waits did before,
// cost each wake-up 60-100 us of timer slack. `stop` ends the wait early (the engine closes).
// None waits forever; a timeout <= 0 checks once.
template <class Done, class Stop>
WaitEnd wait_released(Done done, Stop stop, std::optional<double> timeout_s) {
  using Clock = std::chrono::steady_clock;
  constexpr auto kSpin = std::chrono::microseconds(50);
  constexpr auto kYield = std::chrono::milliseconds(2);
  constexpr auto kSleep = std::chrono::microseconds(50);
  if (timeout_s && std::isnan(*timeout_s)) throw nb::value_error("timeout must be a number of seconds or None");
  // Beyond 1e9 s (31 years) is forever; the duration cast would overflow.
  const bool forever = !timeout_s || *timeout_s >= 1e9;
  nb::gil_scoped_release release;
  const Clock::time_point start = Clock::now();
  const Clock::time_point deadline =
      forever ? Clock::time_point::max()
              : start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(*timeout_s));
  for (;;) {
    if (done()) return WaitEnd::kDone;
    if (stop()) return WaitEnd::kStopped;
    const Clock::time_point now = Clock::now();
    if (now >= deadline) return WaitEnd::kTimedOut;
    const auto waited = now - start;
    if (waited < kSpin) {
      for (int i = 0; i < 32; i++) cpu_relax();
    } else if (waited < kYield) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(kSleep);
    }
  }
}

// Without a stop condition: true when done, false on timeout.
template <class Done>
bool wait_released(Done done, std::optional<double> timeout_s) {
  return wait_released(done, [] { return false; }, timeout_s) == WaitEnd::kDone;
}

}  // namespace fabric::py
