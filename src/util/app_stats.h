// The counters the applications (kv, weights, moe) keep for their metrics: updated on their own
// threads without a lock, read with relaxed loads by their metrics source (a reader sees each
// cell's recent value; cells are not a consistent snapshot of one another). Durations go into
// fabric::DurationHistogram (fabric/metrics.h).
#pragma once

#include <atomic>
#include <cstdint>

#include "util/counter.h"  // util::Counter: one writer (the MoE proxy thread, the AllToAll's caller)

namespace fabric::util {

// Added to by any thread (callback threads, callers).
class SharedCounter {
 public:
  void add(uint64_t n = 1) { v_.fetch_add(n, std::memory_order_relaxed); }
  uint64_t get() const { return v_.load(std::memory_order_relaxed); }

 private:
  std::atomic<uint64_t> v_{0};
};

// The last value set (a gauge).
class LastValue {
 public:
  void set(double v) { v_.store(v, std::memory_order_relaxed); }
  double get() const { return v_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> v_{0};
};

}  // namespace fabric::util
