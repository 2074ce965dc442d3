// fabric-weights-plan: the RL weight-update plan for Kimi-K2 at full scale (256 training GPUs,
// BF16, FSDP 16 x PP 2 x EP 8, to 128 inference GPUs, FP8 with 128 x 128 block scales, 4 replicas
// of EP 32), built and checked without the hardware. Prints the WRITEs per training rank, the
// bytes per NIC (max / mean), the network's lower bound (bytes into the inference GPUs over their
// aggregate bandwidth), a predicted transfer time with the pipeline overlapping gather, quantize
// and send, and the measured CPU cost of posting the busiest rank's WRITEs through this machine's
// engine (64-byte stand-ins for each WRITE, shm). Ends with the `plan ...` line make bench-weights
// documents.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <numeric>
#include <thread>
#include <vector>

#include "fabric/fabric.h"
#include "fabric/weights/plan.h"
#include "fabric/weights/update.h"
#include "kimi_k2_manifest.h"

using namespace fabric;
using Clock = std::chrono::steady_clock;

namespace {

struct Options {
  double gbps = 400;          // link speed per GPU, all its NICs, Gbit/s (as NICs report it)
  double quantize_gbs = 1500;  // GB/s of BF16 a GPU quantizes (memory-bound: read 2 B, write 1 B)
  uint64_t owner_rows = 0;
  std::string provider = "shm";
  bool skip_post = false;
  bool busy = false;
  uint32_t window = 2;  // staging slots per training rank (WeightSenderConfig::window)
};

double ms_since(Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); }

// Posts `writes` (one rank's WRITEs) as 64-byte stand-ins from one engine to a peer engine's 8
// regions, an immediate each. Returns when every submit returned, when the worker had handed the
// last WRITE to the provider (the posting cost, from the engine's post timings), and when all had
// completed (the provider's delivery included), in ms from the first submit.
struct PostingTimes {
  double submitted = 0, posted = 0, completed = 0;
};
PostingTimes time_posting(const std::vector<weights::Write>& writes, const std::string& provider,
                                       bool busy) {
  EngineConfig cfg;
  cfg.provider = provider;
  cfg.worker_poll = busy ? PollMode::kBusy : PollMode::kAdaptive;
  cfg.record_post_timings = true;
  if (provider != "shm") cfg.nics = {NicConfig{"", "127.0.0.2"}};
  TransferEngine sender(cfg), receiver(cfg);
  constexpr uint64_t kRegion = 64 << 10, kPage = 64;
  std::vector<uint8_t> src(kRegion, 1);
  std::vector<std::vector<uint8_t>> dst(8, std::vector<uint8_t>(kRegion));
  auto [hs, ds] = sender.reg_mr(src.data(), src.size());
  std::vector<RemoteMr> remotes;
  for (auto& d : dst) remotes.push_back(sender.add_remote(receiver.reg_mr(d.data(), d.size()).second));
  std::atomic<uint64_t> done{0}, failed{0};
  std::vector<double> submit_at(writes.size());  // ms from t0 at which each submit was called
  sender.take_post_timings();
  const auto t0 = Clock::now();
  for (size_t i = 0; i < writes.size(); i++) {
    submit_at[i] = ms_since(t0);
    sender.submit(SingleWrite{.len = kPage, .src = {hs, 0}, .dst = {remotes[writes[i].dst_rank % remotes.size()], 0},
                              .imm = writes[i].dst_rank},
                  OnDone::counter(&done, &failed));
  }
  PostingTimes t;
  t.submitted = ms_since(t0);
  while (done.load() + failed.load() < writes.size()) std::this_thread::yield();
  t.completed = ms_since(t0);
  if (failed.load()) throw std::runtime_error(fmt::format("{} stand-in WRITEs failed", failed.load()));
  // The worker records transfers in the order they finished posting: for single WRITEs, posted
  // first-in first-out, the order they were submitted.
  const std::vector<PostTiming> timings = sender.take_post_timings();
  if (timings.size() != writes.size())
    throw std::runtime_error(fmt::format("{} post timings for {} WRITEs", timings.size(), writes.size()));
  for (size_t i = 0; i < timings.size(); i++) t.posted = std::max(t.posted, submit_at[i] + timings[i].last_post_ns / 1e6);
  return t;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"fabric-weights-plan: the Kimi-K2 weight-update plan at full scale"};
  app.add_option("--link-gbps,--gbps", o.gbps,
                 "link speed per GPU (all its NICs) in Gbit/s, as NICs report it (400: 400 Gbit/s = 50 GB/s)");
  app.add_option("--quantize-gbs", o.quantize_gbs, "BF16 GB/s one GPU quantizes");
  app.add_option("--owner-rows", o.owner_rows, "rows a rank quantizes as a unit (128 multiples; 0: whole tensors)");
  app.add_option("--provider", o.provider, "provider for the posting measurement");
  app.add_flag("--skip-post", o.skip_post, "leave out the posting measurement");
  app.add_option("--window", o.window, "staging slots per training rank, for the staging figure");
  app.add_flag("--busy", o.busy, "busy-polling worker for the posting measurement (default adaptive)");
  CLI11_PARSE(app, argc, argv);

  bench::KimiK2Layout layout;
  auto t = Clock::now();
  const weights::Manifest m = bench::kimi_k2_manifest({}, layout);
  uint64_t params = 0;
  for (const auto& spec : m.tensors) params += spec.rows * spec.cols;
  fmt::print("manifest: {} tensors, {:.3f} T parameters, {} source and {} destination placements ({:.0f} ms)\n",
             m.tensors.size(), params / 1e12, m.sources.size(), m.dests.size() + m.dest_scales.size(), ms_since(t));
  t = Clock::now();
  const weights::UpdatePlan up = weights::plan_update(m, {.owner_rows = o.owner_rows});
  const double plan_ms = ms_since(t);
  t = Clock::now();
  if (std::string e = weights::check_update(m, up); !e.empty()) {
    fmt::print(stderr, "plan check failed: {}\n", e);
    return 1;
  }
  fmt::print("plan: {} quantize units, {} gather and {} send copies ({:.0f} ms; checked in {:.0f} ms)\n",
             up.quantize.size(), up.gather.copies.size(), up.send.copies.size(), plan_ms, ms_since(t));

  // What each rank posts: the gather's and the send's WRITEs, continuations merged.
  std::vector<weights::Write> gather_writes = weights::writes_of(up.gather), send_writes = weights::writes_of(up.send);
  // Per training rank: bytes out (gather and send), bytes in (gather), WRITEs posted.
  std::vector<uint64_t> out(m.src_ranks, 0), in(m.src_ranks, 0), wrs(m.src_ranks, 0), dst_in(m.dst_ranks, 0);
  for (const auto& w : send_writes) {
    out[w.src_rank] += w.len;
    wrs[w.src_rank]++;
    dst_in[w.dst_rank] += w.len;
  }
  uint64_t gather_bytes = 0;
  for (const auto& w : gather_writes) {
    out[w.src_rank] += w.len;
    wrs[w.src_rank]++;
    in[w.dst_rank] += w.len;
    gather_bytes += w.len;
  }
  fmt::print("WRITEs: {} gather and {} send ({} send copies merged into them)\n", gather_writes.size(),
             send_writes.size(), up.send.copies.size());
  auto max_over_mean = [](const std::vector<uint64_t>& v) {
    const double mean = std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
    return mean > 0 ? static_cast<double>(*std::max_element(v.begin(), v.end())) / mean : 1.0;
  };
  const double bw = o.gbps / 8 * 1e9;  // bytes per second per GPU
  // The executor's cost model (weights/update.h predict_update, which the GPU example feeds with
  // a measured copy bandwidth): the slowest NIC, the quantizing or the posting, plus the fill.
  auto shared_plan = std::make_shared<const weights::UpdatePlan>(up);
  const weights::UpdatePrediction pred =
      weights::predict_update(shared_plan, {.link_gbs = o.gbps / 8, .quantize_gbs = o.quantize_gbs, .window = o.window});
  const double lower_bound_ms = pred.lower_bound_ms, predicted_ms = pred.predicted_ms, fill_ms = pred.fill_ms;
  const double busiest = static_cast<double>(pred.busiest_bytes);
  const uint64_t total_dst = std::accumulate(dst_in.begin(), dst_in.end(), uint64_t{0});
  const auto busiest_rank = static_cast<uint32_t>(std::max_element(wrs.begin(), wrs.end()) - wrs.begin());
  fmt::print("training ranks: WRITEs max {} (rank {}) mean {:.0f}; bytes out max {:.2f} GB mean {:.2f} GB "
             "(gather {:.2f} GB of it in all ranks: {:.1f} TB); in max {:.2f} GB\n",
             wrs[busiest_rank], busiest_rank, std::accumulate(wrs.begin(), wrs.end(), 0.0) / m.src_ranks,
             *std::max_element(out.begin(), out.end()) / 1e9, std::accumulate(out.begin(), out.end(), 0.0) / m.src_ranks / 1e9,
             gather_bytes / 1e9 / m.src_ranks, gather_bytes / 1e12, *std::max_element(in.begin(), in.end()) / 1e9);
  const std::vector<uint64_t> windowed = weights::staging_bytes_for(up, o.window);
  fmt::print("inference ranks: bytes in max {:.2f} GB mean {:.2f} GB (max / mean {:.3f})\n",
             *std::max_element(dst_in.begin(), dst_in.end()) / 1e9, static_cast<double>(total_dst) / m.dst_ranks / 1e9,
             max_over_mean(dst_in));
  fmt::print("training staging: every unit resident {:.2f} GB max; the executor's window of {} units {:.2f} GB max\n",
             *std::max_element(up.staging_bytes.begin(), up.staging_bytes.end()) / 1e9, o.window,
             *std::max_element(windowed.begin(), windowed.end()) / 1e9);
  fmt::print("time at {:.0f} Gbit/s links per GPU ({:.0f} GB/s): lower bound {:.1f} ms, predicted {:.1f} ms (busiest NIC {:.1f} ms + fill "
             "{:.1f} ms)\n",
             o.gbps, o.gbps / 8, lower_bound_ms, predicted_ms, busiest / bw * 1e3, fill_ms);

  double post_ms = 0;
  if (!o.skip_post) {
    std::vector<weights::Write> mine;
    for (const auto* list : {&gather_writes, &send_writes})
      for (const auto& w : *list)
        if (w.src_rank == busiest_rank) mine.push_back(w);
    const PostingTimes t = time_posting(mine, o.provider, o.busy);
    post_ms = t.posted;
    fmt::print("posting rank {}'s {} requests ({} WRITEs) on {} ({} polling, 64-byte stand-ins): submitted in "
               "{:.2f} ms, the last handed to the provider at {:.2f} ms, all completed in {:.2f} ms\n",
               busiest_rank, mine.size(), wrs[busiest_rank], o.provider, o.busy ? "busy" : "adaptive", t.submitted,
               t.posted, t.completed);
  }
  fmt::print("plan params={} src={} dst={} wrs_per_rank_max={} nic_bytes_max_over_mean={:.3f} lower_bound_ms={:.1f} "
             "predicted_ms={:.1f} post_ms_per_rank={:.2f}\n",
             params, m.src_ranks, m.dst_ranks, wrs[busiest_rank], max_over_mean(out), lower_bound_ms, predicted_ms, post_ms);
  return 0;
}
