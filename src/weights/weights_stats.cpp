// The fabric_weights_* metrics of WeightSender and WeightReceiver (weights_stats.h; docs/api.md).
#include "weights_stats.h"

#include <array>
#include <span>
#include <string>

namespace fabric::weights::detail {

namespace {

// HELP texts: one per family, the same from both sides.
constexpr const char* kUpdates =
    "Weight updates completed: WeightSender::update returned (train) or wait_update saw every "
    "write land (inference)";
constexpr const char* kFailed =
    "Weight update steps that failed: update threw (train) or wait_update timed out (inference)";
constexpr const char* kBytes =
    "Weight update bytes written by this training rank (gathers and sends) or landed in this "
    "inference rank";

}  // namespace

void write_metrics(MetricsWriter& w, const SenderStats& s, uint32_t rank) {
  const std::string r = std::to_string(rank);
  const std::array<MetricLabel, 2> l_{
      {{"side", "train"}, {"rank", r}}};  // MetricLabels only views them
  const MetricLabels l = std::span<const MetricLabel>(l_);
  w.counter("fabric_weights_updates_total", kUpdates, s.updates.get(), l);
  w.counter("fabric_weights_failed_steps_total", kFailed, s.failed.get(), l);
  w.counter("fabric_weights_bytes_total", kBytes, s.bytes.get(), l);
  s.seconds.write(w, "fabric_weights_update_seconds",
                  "Wall time of a training rank's completed weight update (WeightSender::update)",
                  l);
  w.gauge("fabric_weights_last_update_bytes",
          "Bytes this training rank wrote in its last completed update", s.last_bytes.get(), l);
  w.gauge("fabric_weights_last_update_bytes_per_second",
          "This training rank's last completed update: its bytes over its wall time",
          s.last_bytes_per_second.get(), l);
}

void write_metrics(MetricsWriter& w, const ReceiverStats& s, uint32_t rank) {
  const std::string r = std::to_string(rank);
  const std::array<MetricLabel, 2> l_{
      {{"side", "inference"}, {"rank", r}}};  // MetricLabels only views them
  const MetricLabels l = std::span<const MetricLabel>(l_);
  w.counter("fabric_weights_updates_total", kUpdates, s.updates.get(), l);
  w.counter("fabric_weights_failed_steps_total", kFailed, s.failed.get(), l);
  w.counter("fabric_weights_bytes_total", kBytes, s.bytes.get(), l);
}

}  // namespace fabric::weights::detail
