// EngineImpl: the engine's state (tables, workers, callback thread) and the checks its calls
// share: validation at submit time and routing to the workers (one per GPU; a request goes to the
// worker of its source region's device). Application threads call in through TransferEngine;
// they meet a worker only at its request queue, in Worker::call and at the region tables.
#pragma once

#include <array>
#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "cuda/gpu_signals.h"
#include "engine/imm_registry.h"
#include "engine/registration.h"
#include "fabric/transfer_engine.h"
#include "metrics/metrics_endpoint.h"
#include "metrics/metrics_sources.h"
#include "shared_state/callback_thread.h"
#include "shared_state/mr_table.h"
#include "shared_state/remote_table.h"
#include "worker/worker.h"

namespace fabric {

// What submitting threads check of a peer group (the worker holds its routes).
struct PeerGroup {
  std::vector<uint64_t> lens;  // each member region's length
  bool all_local = true;       // every member is reached through cuda_ipc
  uint8_t imm_bits = 32;       // the narrowest immediate range among the members
};

// The engine's state behind TransferEngine's pointer, and what its calls share. Each
// TransferEngine call does its work itself (transfer_engine.cpp), reaching the tables, the workers
// and their components (Worker::domains(), peers(), expectations(), ...) through these members;
// what stays here is used by several calls or by ImmReservation.
class EngineImpl {
 public:
  explicit EngineImpl(EngineConfig config);
  ~EngineImpl();

  // Both reg_mr overloads.
  std::pair<MrHandle, MrDesc> reg_mr(void* ptr, size_t len, Device device, ImmRange imms);
  // reg_mr and reg_mrs (registration.cpp): every region checked, then registered on its worker
  // (one call per worker), all or none; `what` names the call in errors.
  std::vector<std::pair<MrHandle, MrDesc>> register_all(std::span<const RegionEntry> entries,
                                                        const char* what);
  // The raw calls (TransferEngine's) refuse a reserved immediate, then do what these do for an
  // ImmReservation (its holder's calls).
  ImmReservation reserve_imms(const ImmReserveRequest& request);
  ImmExpectation expect_reserved(uint32_t imm, uint64_t count, OnDone on_done, const ExpectOptions& opts);
  uint64_t count_reserved(uint32_t imm);
  uint64_t discard_reserved(uint32_t imm);
  bool cancel_expectation(const ImmExpectation& e);
  // That GPU's worker's signals (none: the first worker's) and the worker; created on first use.
  std::pair<GpuSignals&, uint32_t> signals(std::optional<int> cuda_device);
  GpuSignals& signals_of(uint32_t worker);
  // TransferEngine::metrics_text (engine_metrics.cpp), and a submit refused at the call.
  std::string metrics_text();
  void count_refused(TransferKind kind, ErrorCode code);

 private:
  friend class TransferEngine;  // its calls are this object's (the public face of a pimpl)

  void check_open() const;  // throws kShutdown once destruction has begun
  void check_unreserved(uint32_t imm, const char* what) const;
  // The worker serving memory of `device` (host memory: the first). Throws kInvalidArgument for a
  // GPU no worker serves.
  uint32_t worker_index(Device device, const char* what) const;
  Worker& worker_of(const SourceView& src) const { return *workers_[src.worker]; }
  void remove_remote_locked(RemoteMr r);  // control_mu_ held
  SourceView source(const MrHandle& h) const;
  void check_peer(const NetAddr& peer, const char* what) const;
  RemoteView remote(const RemoteMr& r, const char* what) const;
  const PeerGroup& group(const PeerGroupHandle& g, const char* what) const;
  bool reachable_locally(const MrDesc& dst) const;
  void check_route(const SourceView& src, bool dst_local, const char* what) const;
  TransferRequest make_request(TransferKind kind, OnDone on_done, std::optional<uint32_t> imm,
                               std::optional<uint8_t> nic, const char* what) const;
  void submit_request(Worker& w, TransferRequest&& r);  // gives its buffer back if w refuses it

  EngineConfig config_;
  std::vector<EngineConfig> worker_configs_;  // each worker's own: its GPU, NICs and cores
  // Heap-held so that a wedged worker, abandoned at close, never sees them freed.
  std::unique_ptr<MrTable> mrs_owner_;
  MrTable& mrs_;
  std::unique_ptr<RemoteTable> remotes_owner_;
  RemoteTable& remotes_;
  std::unique_ptr<RequestBufferPool> buffers_owner_;
  RequestBufferPool& buffers_;
  std::unique_ptr<CallbackThread> callbacks_;
  std::vector<std::unique_ptr<Worker>> workers_;
  size_t nic_count_ = 0;  // NICs per worker (every worker has as many)
  NetAddr address_;
  std::atomic<bool> closing_{false};
  std::atomic<uint64_t> next_expectation_id_{1};
  std::shared_ptr<ImmRegistry> imm_registry_;
  const uint32_t engine_id_;  // what this engine's handles carry (MrHandle::engine)
  std::mutex control_mu_;  // registration, interning and peer groups only (control path)
  std::unordered_map<std::string, RemoteMr> remote_index_;  // MrDesc bytes: add_remote is idempotent
  static constexpr size_t kMaxGroups = 1024;
  std::array<std::atomic<const PeerGroup*>, kMaxGroups> groups_{};
  std::vector<std::unique_ptr<PeerGroup>> group_storage_;
  std::mutex signals_mu_;
  std::array<std::unique_ptr<GpuSignals>, kMaxWorkers> signals_;
  std::shared_ptr<MetricsSources> metrics_sources_ = std::make_shared<MetricsSources>();
  // Submits refused at the call, by kind and ErrorCode: counted on the caller's thread, off the
  // data path (only when a submit throws).
  std::array<std::array<std::atomic<uint64_t>, kCausePeerLost>, kTransferKinds> refused_{};
  // GET /metrics over HTTP where EngineConfig::metrics_port asks for it; stopped first at close.
  std::unique_ptr<MetricsEndpoint> metrics_endpoint_;
  RegistrationStats registrations_;  // registration.h: counted by register_all, rendered in metrics_text
};

}  // namespace fabric
