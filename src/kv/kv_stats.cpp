// The fabric_kv_* metrics of KvSender and KvReceiver (kv_stats.h; docs/api.md lists them).
#include "kv/kv_stats.h"

#include <array>
#include <span>
#include <string>

namespace fabric::kv {

namespace {

// HELP texts: one per family, the same from both sides.
constexpr const char* kCompleted =
    "KV requests that ended with every write completed (prefill) or landed (decode)";
constexpr const char* kFailed =
    "KV requests that ended with an error (timeout, cancelled, refused, peer gone)";
constexpr const char* kLayers =
    "KV layers handed to the engine (prefill: sent) or landed whole (decode: received)";
constexpr const char* kBytes =
    "KV bytes written by this rank (prefill) or landed in it (decode), extras included";

}  // namespace

void write_metrics(MetricsWriter& w, const KvSenderStats& s, const KvRank& rank) {
  const std::string group = std::to_string(rank.group), tp = std::to_string(rank.tp.rank);
  const std::array<MetricLabel, 3> l_{
      {{"side", "prefill"}, {"group", group}, {"tp_rank", tp}}};  // MetricLabels only views them
  const MetricLabels l = std::span<const MetricLabel>(l_);
  w.counter("fabric_kv_requests_begun_total", "KV requests a prefill rank began (KvSender::begin)",
            s.begun.get(), l);
  w.counter("fabric_kv_requests_completed_total", kCompleted, s.completed.get(), l);
  w.counter("fabric_kv_requests_failed_total", kFailed, s.failed.get(), l);
  w.counter("fabric_kv_layers_total", kLayers, s.layers.get(), l);
  w.counter("fabric_kv_bytes_total", kBytes, s.bytes.get(), l);
  s.exposed.write(
      w, "fabric_kv_exposed_seconds",
      "Time from a request's last layer_done to its last write completing: the transfer not hidden "
      "behind the prefill's compute (completed requests with something to send)",
      l);
}

void write_metrics(MetricsWriter& w, const KvReceiverStats& s, const KvRank& rank) {
  const std::string group = std::to_string(rank.group), tp = std::to_string(rank.tp.rank);
  const std::array<MetricLabel, 3> l_{
      {{"side", "decode"}, {"group", group}, {"tp_rank", tp}}};  // MetricLabels only views them
  const MetricLabels l = std::span<const MetricLabel>(l_);
  w.counter("fabric_kv_requests_admitted_total",
            "KV requests a decode rank admitted (KvReceiver::admit)", s.admitted.get(), l);
  w.counter("fabric_kv_requests_completed_total", kCompleted, s.completed.get(), l);
  w.counter("fabric_kv_requests_failed_total", kFailed, s.failed.get(), l);
  w.counter("fabric_kv_layers_total", kLayers, s.layers.get(), l);
  w.counter("fabric_kv_bytes_total", kBytes, s.bytes.get(), l);
}

}  // namespace fabric::kv
