// EngineImpl::metrics_text: the engine's metrics gathered where the workers keep them (NIC counters
// in each DomainGroup, transfer counters and histograms in WorkerMetrics, both single-writer
// counters read here; per-peer counters in the PeerTable's records, asked of each worker), then
// every metrics source's, rendered by one MetricsWriter. docs/api.md, "Metrics reference".
#include <string>
#include <string_view>

#include "engine/engine_impl.h"

namespace fabric {

namespace {

constexpr std::array<std::string_view, kTransferKinds> kKindNames = {
    "single", "paged", "scatter", "group_scatter", "barrier", "group_barrier", "send"};

// ErrorCode's values by index, then kCausePeerLost.
constexpr std::array<std::string_view, kFailureCauses> kCauseNames = {
    "ok",      "invalid_argument", "out_of_bounds",      "not_found",   "malformed", "provider",
    "timeout", "shutdown",         "resource_exhausted", "unsupported", "cancelled", "peer_lost"};

// Failure series written (as 0) for every kind in use, so a first failure is a rate and not a new
// series; other causes appear at their first failure.
constexpr std::array<size_t, 6> kUsualCauses = {
    static_cast<size_t>(ErrorCode::kTimeout), kCausePeerLost, static_cast<size_t>(ErrorCode::kProvider),
    static_cast<size_t>(ErrorCode::kCancelled), static_cast<size_t>(ErrorCode::kNotFound),
    static_cast<size_t>(ErrorCode::kShutdown)};

bool usual(size_t cause) {
  for (size_t c : kUsualCauses)
    if (c == cause) return true;
  return false;
}

void write_histogram(MetricsWriter& w, std::string_view name, std::string_view help,
                     const util::DurationCounters& h, MetricLabels labels) {
  std::array<uint64_t, DurationHistogram::kBuckets> counts;
  for (size_t i = 0; i < counts.size(); i++) counts[i] = h.counts[i].read();
  w.histogram(name, help, DurationHistogram::upper_bounds(), counts,
              static_cast<double>(h.sum_ns.read()) / 1e9, labels);
}

void write_nics(MetricsWriter& w, const std::string& worker, const DomainGroup& g) {
  for (size_t d = 0; d < g.domain_count(); d++) {
    const NicCounters& c = g.stats(d);
    const std::string rail = d < g.nic_count() ? std::to_string(d) : "local";
    const MetricLabel l[] = {{"worker", worker}, {"rail", rail}, {"nic", g.caps(d).nic_name}};
    w.counter("fabric_nic_writes_total", "WRITEs completed successfully on this NIC", c.writes.read(), l);
    w.counter("fabric_nic_write_bytes_total", "Bytes of the WRITEs counted in fabric_nic_writes_total",
              c.bytes.read(), l);
    w.counter("fabric_nic_sends_total", "SENDs (messages) completed successfully on this NIC",
              c.sends.read(), l);
    w.counter("fabric_nic_immediates_received_total",
              "Immediates that arrived on this NIC (duplicates included)", c.imms_received.read(), l);
    w.counter("fabric_nic_immediates_dropped_total",
              "Immediates dropped: EngineConfig::max_unexpected_imms distinct values already counted",
              c.imms_dropped.read(), l);
    w.counter("fabric_nic_messages_received_total", "Messages received on this NIC",
              c.messages_received.read(), l);
    w.counter("fabric_nic_messages_dropped_total",
              "Messages that reached this NIC and could not be delivered", c.messages_dropped.read(), l);
    w.counter("fabric_nic_errors_total",
              "Operations on this NIC that failed: refused at post, or completed with an error",
              c.errors.read(), l);
    w.counter("fabric_nic_retries_total",
              "Posts the NIC pushed back (kRetry: the NIC backs off; kRetryPeer: one peer of it does)",
              c.retries.read(),
              {{"worker", worker}, {"rail", rail}, {"nic", g.caps(d).nic_name}, {"scope", "nic"}});
    w.counter("fabric_nic_retries_total",
              "Posts the NIC pushed back (kRetry: the NIC backs off; kRetryPeer: one peer of it does)",
              c.peer_retries.read(),
              {{"worker", worker}, {"rail", rail}, {"nic", g.caps(d).nic_name}, {"scope", "peer"}});
    w.gauge("fabric_nic_in_flight", "Operations posted on this NIC and not completed yet",
            static_cast<int64_t>(c.in_flight.read()), l);
  }
}

void write_transfers(MetricsWriter& w, const std::string& worker, const WorkerMetrics& m) {
  for (size_t k = 0; k < kTransferKinds; k++) {
    const uint64_t taken = m.taken[k].read();
    if (taken == 0) continue;  // a kind never used has no series
    const MetricLabel l[] = {{"worker", worker}, {"kind", kKindNames[k]}};
    const uint64_t completed = m.completed[k].read();
    uint64_t failed = 0;
    w.counter("fabric_transfers_total", "Transfers (submitted requests) the worker took", taken, l);
    w.counter("fabric_transfers_completed_total", "Transfers that completed successfully", completed, l);
    for (size_t c = 1; c < kFailureCauses; c++) {
      const uint64_t n = m.failed[k][c].read();
      failed += n;
      if (n == 0 && !usual(c)) continue;
      w.counter("fabric_transfer_failures_total",
                "Transfers that ended with an error, by cause: the ErrorCode reported, or peer_lost "
                "(an operation's peer connection is gone; reported as provider error)",
                n, {{"worker", worker}, {"kind", kKindNames[k]}, {"code", kCauseNames[c]}});
    }
    // Counters read one by one: a transfer ending meanwhile may show in neither or both.
    const int64_t in_flight = static_cast<int64_t>(taken) - static_cast<int64_t>(completed + failed);
    w.gauge("fabric_transfers_in_flight", "Transfers taken by the worker and not ended yet",
            in_flight > 0 ? in_flight : 0, l);
    write_histogram(w, "fabric_transfer_first_post_seconds",
                    "Time from the submit call to the transfer's first operation handed to a NIC",
                    m.first_post[k], l);
    write_histogram(w, "fabric_transfer_duration_seconds",
                    "Time from the submit call to the successful completion of the transfer",
                    m.duration[k], l);
  }
}

}  // namespace

void EngineImpl::count_refused(TransferKind kind, ErrorCode code) {
  refused_[static_cast<size_t>(kind)][static_cast<size_t>(code)].fetch_add(1, std::memory_order_relaxed);
}

std::string EngineImpl::metrics_text() {
  MetricsWriter w;
  w.gauge("fabric_engine_info", "The engine: its provider, workers and NICs per worker (always 1)", 1,
          {{"provider", address_.provider()},
           {"workers", std::to_string(workers_.size())},
           {"nics", std::to_string(nic_count_)}});
  uint64_t writes = 0, bytes = 0, sends = 0, imms = 0, errors = 0;
  for (const auto& wk : workers_)
    for (size_t d = 0; d < wk->domains().domain_count(); d++) {
      const NicCounters& c = wk->domains().stats(d);
      writes += c.writes.read();
      bytes += c.bytes.read();
      sends += c.sends.read();
      imms += c.imms_received.read();
      errors += c.errors.read();
    }
  w.counter("fabric_writes_total", "WRITEs completed successfully, all NICs of the engine", writes);
  w.counter("fabric_write_bytes_total", "Bytes of the WRITEs in fabric_writes_total", bytes);
  w.counter("fabric_sends_total", "SENDs completed successfully, all NICs of the engine", sends);
  w.counter("fabric_immediates_received_total", "Immediates that arrived, all NICs of the engine", imms);
  w.counter("fabric_nic_errors_all_total", "Failed operations, all NICs of the engine", errors);
  for (size_t k = 0; k < kTransferKinds; k++)
    for (size_t c = 1; c < kCausePeerLost; c++)
      if (uint64_t n = refused_[k][c].load(std::memory_order_relaxed))
        w.counter("fabric_submits_refused_total",
                  "Submits refused at the call (thrown to the caller), by kind and ErrorCode", n,
                  {{"kind", kKindNames[k]}, {"code", kCauseNames[c]}});
  registrations_.write(w);  // registration.cpp

  for (size_t i = 0; i < workers_.size(); i++) {
    Worker& wk = *workers_[i];
    const std::string worker = std::to_string(i);
    write_nics(w, worker, wk.domains());
    write_transfers(w, worker, wk.metrics());
    w.counter("fabric_peers_lost_total",
              "Peers given up: an operation's connection failed, or a transfer to them timed out",
              wk.peers().peers_lost().read(), {{"worker", worker}});
    // The records live on the worker's thread: a round trip, bounded so a wedged worker cannot
    // hold up the scrape.
    auto peers = wk.try_call([&] { return std::make_pair(wk.peers().peer_count(), wk.peers().metrics()); },
                             std::chrono::milliseconds(1000));
    w.gauge("fabric_worker_stalled",
            "1 when the worker did not answer for its per-peer metrics within a second", !peers,
            {{"worker", worker}});
    if (!peers) continue;
    w.gauge("fabric_peers", "Peers this worker holds NIC resources for", peers->first, {{"worker", worker}});
    for (const PeerMetrics& p : peers->second) {
      const MetricLabel l[] = {{"worker", worker}, {"peer", p.peer}};
      w.counter("fabric_peer_writes_total", "WRITEs to this peer completed successfully", p.writes, l);
      w.counter("fabric_peer_write_bytes_total", "Bytes of the WRITEs in fabric_peer_writes_total", p.bytes, l);
      w.counter("fabric_peer_sends_total", "SENDs to this peer completed successfully", p.sends, l);
      w.counter("fabric_peer_errors_total", "Operations to this peer that completed with an error", p.errors, l);
      w.gauge("fabric_peer_in_flight", "Operations to this peer posted and not completed", p.in_flight, l);
    }
  }
  metrics_sources_->collect(w);
  return w.text();
}

}  // namespace fabric
