// Options shared by the fabric-bench server and client.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "fabric/fabric.h"
#include "progress.h"

namespace fabric::bench {

struct Options {
  std::string provider = "tcp;ofi_rxm";
  // One entry per NIC: a source address (tcp), "" (shm), a device name or "" (verbs).
  std::vector<std::string> nics = {"127.0.0.1"};
  bool busy = false;         // the client's worker busy-polls
  bool server_busy = false;  // the server's first engine busy-polls (the others never do)
  size_t peers = 8;               // server engines for scatter and barrier
  uint64_t buffer_mib = 1024;     // destination region of the first server engine
  uint64_t peer_buffer_mib = 16;  // of the other server engines
  double link_gbps = 0;           // Gbit/s, for "% of link" (0: what the NICs report)
  uint64_t target_mib = 512;      // bytes per bandwidth measurement
  uint64_t min_iters = 2, max_iters = 20000;
  uint64_t warmup = 2;
  size_t window = 16;             // transfers in flight in bandwidth passes
  bool verify = false;
  uint64_t timeout_ms = 0;        // EngineConfig::transfer_timeout and control replies (0: defaults)
  std::string json;
  std::vector<std::string> only;  // test families to run (single, paged, scatter, barrier, imm, msg, post)
  std::vector<uint64_t> single_sizes;
  std::vector<uint64_t> page_sizes;
  std::vector<uint64_t> page_counts = {100, 10000};
  uint64_t scatter_len = 16384;
  uint64_t peer_idle_us = 50;  // idle sleep of the server's extra engines (many peers, few cores)
  ProgressMode progress = ProgressMode::kAuto;  // the client's progress line on stderr

  EngineConfig server_engine_config(size_t index) const {
    EngineConfig c = engine_config();
    c.worker_poll = index == 0 && server_busy ? PollMode::kBusy : PollMode::kAdaptive;
    if (index > 0) c.idle_sleep = std::chrono::microseconds(peer_idle_us);
    return c;
  }
  EngineConfig engine_config() const {
    EngineConfig c;
    c.provider = provider;
    c.nics.clear();
    for (auto& n : nics) c.nics.push_back(provider == "verbs" ? NicConfig{n, ""} : NicConfig{"", n});
    c.worker_poll = busy ? PollMode::kBusy : PollMode::kAdaptive;
    c.callback_poll = PollMode::kAdaptive;
    c.max_message_size = 65536;
    c.send_slots = 64;
    c.record_post_timings = true;
    if (timeout_ms) c.transfer_timeout = std::chrono::milliseconds(timeout_ms);
    return c;
  }
  bool wants(const std::string& family) const {
    if (only.empty()) return true;
    for (auto& o : only)
      if (o == family) return true;
    return false;
  }
};

// Serves until the client says "bye". on_ready gets the server's address (hex) once it listens.
int run_server(const Options& o, const std::function<void(const std::string&)>& on_ready);
int run_client(const Options& o, const std::string& server_hex);

}  // namespace fabric::bench
