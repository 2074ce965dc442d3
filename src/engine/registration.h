// What registration shares between reg_mr, reg_mrs and metrics_text: one region as the engine
// registers it (RegionEntry) and the registration counters.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>

#include "fabric/imm_range.h"
#include "fabric/metrics.h"
#include "fabric/types.h"

namespace fabric {

// One region to register, its reservation already resolved to a range.
struct RegionEntry {
  void* ptr = nullptr;
  size_t len = 0;
  Device device{};
  ImmRange imms{};
  bool prefault = false;
};

// Registration calls and their cost, written by registering threads (any, under the engine's
// control mutex, so relaxed atomics suffice) and read by metrics_text.
class RegistrationStats {
 public:
  // One call that registered `regions` regions, `bytes` in all, in `elapsed` (checks, prefault and
  // every provider's registration; not the caller's allocation).
  void registered(size_t regions, uint64_t bytes, std::chrono::nanoseconds elapsed);
  void failed() { failed_.fetch_add(1, std::memory_order_relaxed); }
  void write(MetricsWriter& w) const;

 private:
  std::atomic<uint64_t> regions_{0};
  std::atomic<uint64_t> bytes_{0};
  std::atomic<uint64_t> failed_{0};
  DurationHistogram seconds_;
};

}  // namespace fabric
