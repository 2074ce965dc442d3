// The short-lived peers of the churn test (churn_test.cpp), one process for several: each life
// opens an engine, hands its region's descriptor to the survivor over an inherited socket, checks
// the bytes written into it, then leaves (its engine closes), exits, or waits to be killed, as
// told. Exec'd, not forked from the threaded test, so each process starts clean.
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <random>
#include <thread>
#include <vector>

#include "fabric/fabric.h"
#include "process_pair.h"

int main(int argc, char** argv) {
  if (argc != 3) return 2;
  fabric::tools::Channel ch(std::atoi(argv[1]));
  const size_t len = static_cast<size_t>(std::atoll(argv[2]));
  // Each life is one engine: it opens, is written to and checked, and closes ("leave"), after
  // which the next life opens a new engine at a new address; a process costs libfabric's
  // start-up (about 0.3 s here), so several lives share one.
  for (;;) {
    const uint32_t seed = static_cast<uint32_t>(std::stoul(ch.recv()));
    std::vector<uint8_t> expected(len);
    std::mt19937 rng(seed);
    for (auto& b : expected) b = static_cast<uint8_t>(rng());
    std::vector<uint8_t> region(len, 0);
    std::atomic<int> landed{fabric::kDonePending};
    fabric::EngineConfig cfg;
    cfg.nics = {{"", "127.0.0.2"}};
    cfg.worker_poll = cfg.callback_poll = fabric::PollMode::kAdaptive;
    fabric::TransferEngine engine(cfg);
    auto [h, d] = engine.reg_mr(region.data(), region.size());
    engine.expect_imm_count(7, 1, fabric::OnDone::flag(&landed),
                            fabric::ExpectOptions{std::chrono::seconds(30)});
    ch.send(d.to_bytes());
    landed.wait(fabric::kDonePending);
    ch.send(landed.load() == fabric::kDoneSucceeded && region == expected ? "ok" : "bad");
    std::string next = ch.recv();
    if (next == "exit") return 0;
    if (next == "wait")
      for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));  // until killed
    engine.dereg_mr(h);  // "leave": this engine closes, the next life starts
  }
}
