// predict_update (include/fabric/weights/update.h): the executor's cost model, from the schedule
// every rank builds (so requests are counted as the executor merges them into runs).
#include <algorithm>
#include <numeric>

#include "fabric/error.h"
#include "fabric/weights/update.h"
#include "schedule.h"

namespace fabric::weights {

UpdatePrediction predict_update(std::shared_ptr<const UpdatePlan> plan, const UpdateCost& cost) {
  if (!plan) throw Error(ErrorCode::kInvalidArgument, "predict_update: no plan");
  if (!(cost.link_gbs > 0)) throw Error(ErrorCode::kInvalidArgument, "predict_update: link_gbs must be positive");
  const double link = cost.link_gbs * 1e9, quant = (cost.quantize_gbs > 0 ? cost.quantize_gbs : cost.link_gbs) * 1e9;
  const detail::Schedule s = detail::schedule_update(plan, cost.window);
  const uint32_t srcs = plan->gather_manifest.src_ranks, dsts = plan->send_manifest.dst_ranks;
  const auto& tensors = plan->gather_manifest.tensors;
  // Per training rank: bytes out (gathers and sends) and in (gathers), requests, quantized input.
  std::vector<uint64_t> out(srcs, 0), in(srcs, 0), requests(srcs, 0), quantized(srcs, 0), dst_in(dsts, 0);
  for (const detail::ScheduledWrite& w : s.gather) {
    out[w.src_rank] += w.len;
    in[w.dst_rank] += w.len;
  }
  for (const detail::ScheduledWrite& w : s.send) {
    out[w.src_rank] += w.len;
    dst_in[w.dst_rank] += w.len;
  }
  // A unit's BF16 input bytes.
  const auto unit_bytes = [&](const detail::ScheduledUnit& u) {
    const TensorSpec& t = tensors[u.task.tensor];
    return (u.task.r1 - u.task.r0) * t.cols * t.elem_bytes;
  };
  UpdatePrediction p;
  double fill = 0;
  const double rtt = cost.write_rtt_us * 1e-6;
  const bool latency = cost.unit_us > 0 || cost.write_rtt_us > 0;
  for (uint32_t r = 0; r < srcs; r++) {
    const detail::RankSchedule& rs = s.ranks[r];
    // The requests the executor submits: its runs, and a credit barrier per gathered unit.
    requests[r] = detail::rank_runs(s, r, cost.nics).runs();
    // The latency chain: the rank's units in order, paced by the hook and the credit round trip.
    double chain = rs.units.empty() ? 0 : rtt;  // the first credit and gather
    for (const detail::ScheduledUnit& u : rs.units) {
      if (!u.contributors.empty()) requests[r]++;
      quantized[r] += unit_bytes(u);
      const double h = std::max(cost.unit_us * 1e-6, static_cast<double>(unit_bytes(u)) / quant);
      chain += u.contributors.empty() ? h : std::max(h, (h + rtt) / cost.window);
    }
    if (latency) p.chain_ms = std::max(p.chain_ms, (chain + rtt / 2) * 1e3);
    if (!rs.units.empty()) {  // the rank's first unit: its gather and quantizing come before any send
      const detail::ScheduledUnit& u = rs.units.front();
      const auto bytes = static_cast<double>(unit_bytes(u));
      fill = std::max(fill, (u.task.gathered ? bytes / link : 0) + bytes / quant);
    }
  }
  const auto sum = [](const std::vector<uint64_t>& v) { return std::accumulate(v.begin(), v.end(), uint64_t{0}); };
  const auto max = [](const std::vector<uint64_t>& v) { return v.empty() ? uint64_t{0} : *std::max_element(v.begin(), v.end()); };
  p.requests_max = max(requests);
  p.post_ms = static_cast<double>(p.requests_max) * cost.post_us / 1e3;
  p.fill_ms = fill * 1e3;
  if (cost.one_device) {
    // Every WRITE and every unit's quantizing go through the one GPU's memory, one after another
    // in bandwidth.
    p.busiest_bytes = sum(out);
    p.link_ms = static_cast<double>(p.busiest_bytes) / link * 1e3;
    p.quantize_ms = static_cast<double>(sum(quantized)) / quant * 1e3;
    p.lower_bound_ms = static_cast<double>(sum(dst_in)) / link * 1e3;
    p.predicted_ms = std::max({p.link_ms + p.quantize_ms + p.fill_ms, p.post_ms + p.fill_ms, p.chain_ms});
  } else {
    // Every NIC streams what it carries; the slowest sets the pace; the ranks quantize in parallel.
    p.busiest_bytes = std::max({max(dst_in), max(out), max(in)});
    p.link_ms = static_cast<double>(p.busiest_bytes) / link * 1e3;
    p.quantize_ms = static_cast<double>(max(quantized)) / quant * 1e3;
    p.lower_bound_ms = static_cast<double>(sum(dst_in)) / (dsts * link) * 1e3;
    p.predicted_ms = std::max(std::max({p.link_ms, p.quantize_ms, p.post_ms}) + p.fill_ms, p.chain_ms);
  }
  return p;
}

}  // namespace fabric::weights
