// Cost of one submit(SingleWrite) call on the application thread (C++), the figure that the Python
// overhead benchmark (bench/python_submit_overhead.py) is compared against. One engine writes 64
// bytes to itself over loopback, in batches small enough never to fill the request queue.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <vector>

#include "fabric/fabric.h"

int main(int argc, char** argv) {
  int batches = 20, batch = 1000, scatter = 0;
  bool list = false;
  CLI::App app{"submit_overhead: application-thread cost of submit(SingleWrite), or of a scatter"};
  app.add_option("--batches", batches);
  app.add_option("--batch", batch);
  app.add_option("--scatter", scatter, "scatter to this many regions (of this engine) instead");
  app.add_flag("--list", list, "with --scatter: a plain Scatter, not a GroupScatter");
  CLI11_PARSE(app, argc, argv);

  // The buffers and the counter outlive the engine (declared first, destroyed last): on tcp a
  // local completion does not mean the target has written, so the worker may still touch both
  // while the engine shuts down.
  std::vector<uint8_t> buf(1 << 20);
  std::atomic<uint64_t> done{0};
  std::vector<std::vector<uint8_t>> regions(static_cast<size_t>(scatter), std::vector<uint8_t>(4096));
  fabric::EngineConfig cfg;
  cfg.nics = {{"", "127.0.0.1"}};
  cfg.worker_poll = fabric::PollMode::kAdaptive;
  fabric::TransferEngine engine(cfg);
  auto [h, d] = engine.reg_mr(buf.data(), buf.size());
  const fabric::RemoteMr dst = engine.add_remote(d);
  // Scatter: `scatter` regions of this engine, 64 bytes each from the same source bytes.
  std::vector<fabric::RemoteMr> members;
  for (auto& r : regions) members.push_back(engine.add_remote(engine.reg_mr(r.data(), r.size()).second));
  std::vector<fabric::ScatterSlice> slices;
  for (auto& m : members) slices.push_back({64, 0, {m, 0}});
  std::vector<fabric::GroupSlice> group_slices(members.size(), fabric::GroupSlice{64, 0, 0});
  fabric::PeerGroupHandle group;
  if (scatter > 0) group = engine.add_peer_group(members);

  std::vector<double> per_call_ns;
  uint64_t submitted = 0;
  for (int b = 0; b < batches; b++) {
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < batch; i++) {
      if (scatter == 0)
        engine.submit(fabric::SingleWrite{.len = 64, .src = {h, 0}, .dst = {dst, 4096}},
                      fabric::OnDone::counter(&done));
      else if (list)
        engine.submit(fabric::Scatter{.src = h, .slices = slices}, fabric::OnDone::counter(&done));
      else
        engine.submit(fabric::GroupScatter{.group = group, .src = h, .slices = group_slices},
                      fabric::OnDone::counter(&done));
    }
    auto t1 = std::chrono::steady_clock::now();
    submitted += batch;
    while (done.load() < submitted) done.wait(done.load());
    if (b > 0)  // the first batch warms up connections and pools
      per_call_ns.push_back(std::chrono::duration<double, std::nano>(t1 - t0).count() / batch);
  }
  std::sort(per_call_ns.begin(), per_call_ns.end());
  fmt::print("cpp {}: {:.2f} us/call (median of {} batches of {})\n",
             scatter == 0 ? "submit_single_write" : list ? "scatter" : "group scatter",
             per_call_ns[per_call_ns.size() / 2] / 1000, per_call_ns.size(), batch);
  return 0;
}
