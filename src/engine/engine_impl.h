// EngineImpl: validation at submit time and routing to the worker. Application threads call in
// here; they meet the worker only at its request queue and at the region table.
#pragma once

#include <array>
#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_set>
#include <vector>

#include "cuda/gpu_signals.h"
#include "engine/callback_thread.h"
#include "engine/mr_table.h"
#include "fabric/transfer_engine.h"
#include "worker/worker.h"

namespace fabric {

struct PeerGroup {
  std::unordered_set<std::string> members;  // NetAddr bytes
};

class EngineImpl {
 public:
  explicit EngineImpl(EngineConfig config);
  ~EngineImpl();

  const EngineConfig& config() const { return config_; }
  const NetAddr& address() const { return address_; }
  size_t nic_count() const { return worker_->nic_count(); }

  std::pair<MrHandle, MrDesc> reg_mr(void* ptr, size_t len, Device device);
  void dereg_mr(MrHandle handle);
  void send(const NetAddr& dst, std::span<const std::byte> bytes, OnDone on_done);
  void recvs(size_t len, size_t count, TransferEngine::RecvCallback on_recv);
  ImmExpectation expect(uint32_t imm, uint64_t count, OnDone on_done, const ExpectOptions& opts);
  bool cancel_expectation(const ImmExpectation& e);
  void remove_peer(const NetAddr& peer);
  size_t peer_count();
  uint64_t imm_count(uint32_t imm);
  void single_write(uint64_t len, const MrHandle& src, uint64_t src_offset, const MrDesc& dst,
                    uint64_t dst_offset, OnDone on_done, const WriteOptions& opts);
  void paged_writes(uint64_t page_len, const MrHandle& src, const Pages& src_pages,
                    const MrDesc& dst, const Pages& dst_pages, OnDone on_done,
                    const WriteOptions& opts);
  PeerGroupHandle add_peer_group(const std::vector<NetAddr>& peers);
  void scatter(std::optional<PeerGroupHandle> group, const MrHandle& src,
               const std::vector<ScatterDst>& dsts, OnDone on_done, const WriteOptions& opts);
  void barrier(std::optional<PeerGroupHandle> group, uint32_t imm, const std::vector<MrDesc>& dsts,
               OnDone on_done, std::optional<uint8_t> nic);
  std::vector<NicStats> nic_stats() const;
  GpuSignals& signals();  // created on first use
  std::vector<PostTiming> take_post_timings() {
    check_open();
    return worker_->call([&] { return worker_->take_post_timings(); });
  }

 private:
  void check_open() const;  // throws kShutdown once destruction has begun
  const RegionSlot& source(const MrHandle& h) const;
  void check_peer(const NetAddr& peer, const char* what) const;
  void check_dst(const MrDesc& dst, uint64_t offset, uint64_t len, const char* what) const;
  bool reachable_locally(const MrDesc& dst) const;
  void check_route(const RegionSlot& src, const MrDesc& dst, const char* what) const;
  void check_group_member(std::optional<PeerGroupHandle> group, const NetAddr& peer) const;
  TransferRequest make_request(TransferKind kind, OnDone on_done, const WriteOptions& opts) const;

  EngineConfig config_;
  // Heap-held so that a wedged worker, abandoned at close, never sees them freed.
  std::unique_ptr<MrTable> mrs_owner_;
  MrTable& mrs_;
  std::unique_ptr<CallbackThread> callbacks_;
  std::unique_ptr<Worker> worker_;
  NetAddr address_;
  std::atomic<bool> closing_{false};
  std::atomic<uint64_t> next_expectation_id_{1};
  std::mutex control_mu_;  // registration and peer groups only (control path)
  static constexpr size_t kMaxGroups = 1024;
  std::array<std::atomic<const PeerGroup*>, kMaxGroups> groups_{};
  std::vector<std::unique_ptr<PeerGroup>> group_storage_;
  std::mutex signals_mu_;
  std::unique_ptr<GpuSignals> signals_;
};

}  // namespace fabric
