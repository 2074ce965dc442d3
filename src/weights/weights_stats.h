// What a weight-update endpoint counts for its metrics, and how it writes them (docs/api.md,
// "Application metrics").
#pragma once

#include <cstdint>

#include "fabric/metrics.h"
#include "util/app_stats.h"

namespace fabric::weights::detail {

// A training rank (WeightSender): updates that returned, that threw, their time, the bytes its
// WRITEs carried (gathers to other training ranks and sends), and the last update's bytes and
// rate (bytes over its wall time).
struct SenderStats {
  util::SharedCounter updates, failed, bytes;
  DurationHistogram seconds;
  util::LastValue last_bytes, last_bytes_per_second;
};

// An inference rank (WeightReceiver): steps that landed whole, steps that timed out, the bytes
// the plan writes into this rank per step (counted when a step lands).
struct ReceiverStats {
  util::SharedCounter updates, failed, bytes;
};

// The fabric_weights_* samples, labelled side (train, inference) and rank.
void write_metrics(MetricsWriter& w, const SenderStats& s, uint32_t rank);
void write_metrics(MetricsWriter& w, const ReceiverStats& s, uint32_t rank);

}  // namespace fabric::weights::detail
