// A worker's own transfer metrics, by transfer kind: taken, completed, failed by cause, and the
// latency histograms (submit to first WRITE posted, submit to completion). Written by the worker
// thread only (util::Counter), read by any thread when the metrics are rendered. Per-NIC counters
// live in the DomainGroup (NicCounters), per-peer ones in the PeerTable's records.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

#include "fabric/error.h"
#include "util/counter.h"
#include "worker/request.h"

namespace fabric {

inline constexpr size_t kTransferKinds = 7;  // TransferKind's values
// Why a transfer failed: its ErrorCode, or kCausePeerLost where its first failure was an operation
// whose completion said the peer's connection is gone (reported as kProvider).
inline constexpr size_t kCausePeerLost = static_cast<size_t>(ErrorCode::kCancelled) + 1;
inline constexpr size_t kFailureCauses = kCausePeerLost + 1;

struct WorkerMetrics {
  std::array<util::Counter, kTransferKinds> taken;      // requests the worker took
  std::array<util::Counter, kTransferKinds> completed;  // reported ok
  std::array<std::array<util::Counter, kFailureCauses>, kTransferKinds> failed;
  std::array<util::DurationCounters, kTransferKinds> first_post;  // submit -> first WRITE posted
  std::array<util::DurationCounters, kTransferKinds> duration;    // submit -> reported ok

  static size_t kind(TransferKind k) { return static_cast<size_t>(k); }
};

}  // namespace fabric
