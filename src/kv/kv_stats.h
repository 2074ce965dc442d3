// What a KV endpoint counts for its metrics, and how it writes them (docs/api.md, "Application
// metrics"): kept apart from the endpoint's state so that callbacks of requests outliving their
// endpoint still count safely.
#pragma once

#include "fabric/kv/transfer.h"
#include "fabric/metrics.h"
#include "util/app_stats.h"

namespace fabric::kv {

struct KvSenderStats {
  util::SharedCounter begun, completed, failed;  // requests
  util::SharedCounter layers,
      bytes;                  // layers handed to the engine, bytes of their writes (extras too)
  DurationHistogram exposed;  // last layer_done -> every write completed (completed requests)
};

struct KvReceiverStats {
  util::SharedCounter admitted, completed, failed;  // requests
  util::SharedCounter layers, bytes;  // layers landed, bytes landed in this rank (extras too)
};

// The fabric_kv_* samples of one endpoint, labelled side (prefill, decode), group and tp_rank.
void write_metrics(MetricsWriter& w, const KvSenderStats& s, const KvRank& rank);
void write_metrics(MetricsWriter& w, const KvReceiverStats& s, const KvRank& rank);

}  // namespace fabric::kv
