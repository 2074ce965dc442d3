// What an AllToAll counts for its metrics, and how it writes them (docs/api.md, "Application
// metrics"). Every cell here has one writer, the thread that calls the AllToAll (one at a time, as
// its calls must be); the proxy thread keeps its own (proxy.h). Nothing on the dispatch and
// combine path takes a lock.
#pragma once

#include <atomic>
#include <cstdint>

#include "fabric/metrics.h"
#include "fabric/moe/types.h"
#include "util/app_stats.h"

namespace fabric::moe::detail {

struct MoeStats {
  util::Counter dispatches, combines;  // accepted dispatch_send / combine_send calls
  // Host kernels: the time of a dispatch's (a combine's) two halves, send and receive, not the
  // caller's work between them. CUDA kernels return before the GPU ran them: not observed.
  DurationHistogram dispatch_seconds, combine_seconds;
  util::Counter timeouts;      // receive halves that raised kTimeout (host kernels)
  std::atomic<bool> failed{false};  // a host receive half failed: the AllToAll refuses every call
};

// What the metrics source reads besides MoeStats, at the time of the read.
struct MoeReading {
  uint64_t proxy_dispatches = 0;  // every buffer set's proxy
  ProxyStats proxy{};
  uint32_t masked = 0;
  bool failed = false;  // MoeStats::failed, a kernel's error word or a proxy's failure
};

// The fabric_moe_* samples, labelled moe_job (AllToAllConfig::job; "job" is the label Prometheus
// gives the scrape target) and rank.
void write_metrics(MetricsWriter& w, const MoeStats& s, const MoeReading& r,
                   const AllToAllConfig& cfg);

}  // namespace fabric::moe::detail
