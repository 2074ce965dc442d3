// The host proxy of one MoE rank (include/fabric/moe/all_to_all.h): a thread that watches the words its
// kernel side raises when rows for the other nodes are staged, posts them as scatters with
// immediates, and counts the other nodes' immediates into the words the receive halves wait on
// (layout.h has the protocol). Only ranks with peers on other nodes run one.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "fabric/moe/all_to_all.h"
#include "fabric/transfer_engine.h"
#include "kernel_side.h"
#include "memory.h"
#include "util/app_stats.h"

namespace fabric::moe::detail {

struct ProxyConfig {
  Views views{};                   // host pointers (recv, send, signals as the CPU sees them)
  std::shared_ptr<Block> signals;  // kept alive by every OnDone the proxy hands the engine
  MrHandle send_mr{};
  ImmReservation* imms = nullptr;  // the receive region's range: incoming immediates are counted there
  std::vector<RemoteMr> recv;      // [W]: every other rank's receive region (self: unused)
  bool busy_poll = false;          // spin without pause (a core of its own) or back off when idle
};

class Proxy {
 public:
  Proxy(TransferEngine& engine, ProxyConfig config);
  ~Proxy();  // stops the thread and cancels the expectations still pending
  Proxy(const Proxy&) = delete;
  Proxy& operator=(const Proxy&) = delete;
  ProxyStats stats() const;
  uint64_t dispatch_steps() const { return dispatches_.read(); }  // dispatch halves posted (stats().steps: combines)

 private:
  void run();
  void loop();
  void start_dispatch(uint64_t step);
  // Every remote rank's counter at `counter_offset` has reached `step` (its rows of the step counted).
  bool remotes_arrived(uint64_t counter_offset, uint64_t step) const;
  void start_combine(uint64_t seq);
  void expect(ImmKind kind, uint64_t step, uint32_t src, uint64_t count, uint64_t counter_offset);
  OnDone on_write();
  template <typename Request>
  void post(const Request& request);  // submits a scatter with on_write() and counts it
  // Shrink mode: every rank gets its own WRITEs, so that a failed one (or a refused submit)
  // masks that rank alone; a masked rank gets nothing. slices[i] goes to ranks[i].
  void post_each(const std::vector<uint32_t>& ranks, const std::vector<GroupSlice>& slices, uint32_t imm);
  bool masked(uint32_t rank) const;
  std::atomic<uint64_t>& signal(uint64_t offset) const;

  TransferEngine& engine_;
  ProxyConfig cfg_;
  const Dims dims_;
  std::vector<uint32_t> others_, remotes_;  // ranks other than this one; ranks on other nodes
  PeerGroupHandle others_group_{}, remotes_group_{};
  std::vector<GroupSlice> route_slices_, remote_slices_, shared_slices_;
  std::vector<ImmExpectation> pending_;  // this step's expectations (cancelled at shutdown)
  std::atomic<bool> stop_{false};
  // Written by the proxy thread alone (no locked instruction per step), read by stats() and the
  // AllToAll's metrics on other threads.
  util::Counter dispatches_, steps_, writes_, bytes_, work_ns_;
  util::Counter dispatch_wait_ns_, combine_wait_ns_;
  std::atomic<uint64_t> posted_{0};  // scatters submitted (each completes writes_done or failed once)
  std::thread thread_;
};

}  // namespace fabric::moe::detail
