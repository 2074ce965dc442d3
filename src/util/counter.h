// Counters one thread writes and any thread reads (the workers' metrics): a relaxed load and
// store, no locked instruction and no shared cache line bouncing between writers, since each
// counter has one writer. Readers see each counter's latest value, not a snapshot across them.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>

#include "fabric/metrics.h"

namespace fabric::util {

class Counter {
 public:
  void add(uint64_t n = 1) { v_.store(v_.load(std::memory_order_relaxed) + n, std::memory_order_relaxed); }
  void sub(uint64_t n = 1) { v_.store(v_.load(std::memory_order_relaxed) - n, std::memory_order_relaxed); }
  uint64_t read() const { return v_.load(std::memory_order_relaxed); }

 private:
  std::atomic<uint64_t> v_{0};
};

// Durations in fabric::DurationHistogram's buckets, one writer.
struct DurationCounters {
  std::array<Counter, DurationHistogram::kBuckets> counts;
  Counter sum_ns;
  void observe(uint64_t ns) {
    counts[DurationHistogram::bucket_of(ns)].add();
    sum_ns.add(ns);
  }
};

}  // namespace fabric::util
