// The fabric_moe_* metrics of an AllToAll (moe_stats.h; docs/api.md lists them).
#include "moe_stats.h"

#include <array>
#include <span>
#include <string>

namespace fabric::moe::detail {

void write_metrics(MetricsWriter& w, const MoeStats& s, const MoeReading& r,
                   const AllToAllConfig& cfg) {
  const std::string rank = std::to_string(cfg.rank);
  const std::array<MetricLabel, 2> l_{
      {{"moe_job", cfg.job}, {"rank", rank}}};  // MetricLabels only views them
  const MetricLabels l = std::span<const MetricLabel>(l_);
  w.counter("fabric_moe_dispatches_total",
            "MoE dispatches this rank started (dispatch_send calls accepted)", s.dispatches.read(),
            l);
  w.counter("fabric_moe_combines_total",
            "MoE combines this rank started (combine_send calls accepted)", s.combines.read(), l);
  s.dispatch_seconds.write(
      w, "fabric_moe_dispatch_seconds",
      "Time in a dispatch's send and receive halves on this rank (host kernels)", l);
  s.combine_seconds.write(w, "fabric_moe_combine_seconds",
                          "Time in a combine's send and receive halves on this rank (host kernels)",
                          l);
  w.counter("fabric_moe_timeouts_total",
            "MoE receive halves that timed out waiting for another rank's rows (host kernels; in "
            "shrink mode the "
            "rank is masked instead: fabric_moe_masked_ranks)",
            s.timeouts.read(), l);
  w.gauge("fabric_moe_masked_ranks",
          "Ranks this rank masks (shrink mode): nothing is sent to them or awaited", r.masked, l);
  w.gauge(
      "fabric_moe_failed",
      "1 once this AllToAll failed (a timeout, a kernel's or the proxy's error): build a new one",
      r.failed, l);
  for (const char* half : {"dispatch", "combine"}) {
    const std::array<MetricLabel, 3> lh_{
        {{"moe_job", cfg.job}, {"rank", rank}, {"half", half}}};  // MetricLabels only views them
    const MetricLabels lh = std::span<const MetricLabel>(lh_);
    const bool d = half[0] == 'd';
    w.counter("fabric_moe_proxy_steps_total", "Halves the proxy thread posted to the other nodes",
              d ? r.proxy_dispatches : r.proxy.steps, lh);
    w.counter("fabric_moe_proxy_wait_seconds_total",
              "Proxy time from this rank's first post of a half to the other nodes' last immediate "
              "of it, summed",
              (d ? r.proxy.dispatch_wait_ms : r.proxy.combine_wait_ms) * 1e-3, lh);
  }
  w.counter("fabric_moe_proxy_writes_total",
            "WRITEs the proxy thread posted to other nodes (counts rows included)", r.proxy.writes,
            l);
  w.counter("fabric_moe_proxy_bytes_total", "Bytes the proxy thread posted to other nodes",
            r.proxy.bytes, l);
  w.counter("fabric_moe_proxy_busy_seconds_total",
            "Proxy thread time spent handling halves (expectations, scatters; not its polling)",
            r.proxy.cpu_ms * 1e-3, l);
}

}  // namespace fabric::moe::detail
