// TransferEngine: one-sided WRITEs with 32-bit immediates, two-sided messages, and order-independent
// completion counting, over 1 to 4 NICs. See docs/api.md for the semantics of every call.
#pragma once

#include <chrono>
#include <cstddef>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "fabric/config.h"
#include "fabric/error.h"
#include "fabric/imm_range.h"
#include "fabric/metrics.h"
#include "fabric/mr_request.h"
#include "fabric/on_done.h"
#include "fabric/requests.h"
#include "fabric/types.h"

namespace fabric {

class EngineImpl;
class ImmRegistry;

// A 64-bit word of pinned, device-mapped host memory: GPU kernels (also inside CUDA graphs) use
// `device`, the CPU uses `host`. Its 64-byte line is its own.
struct UvmWatcher {
  uint64_t* device = nullptr;
  volatile uint64_t* host = nullptr;
  uint32_t id = UINT32_MAX;
  uint32_t worker = 0;  // whose watcher thread polls it
};
// Runs on the engine's watcher thread on every change of the word: keep it short (submit work).
using UvmCallback = std::function<void(uint64_t old_value, uint64_t new_value)>;

// A completion counter in pinned, device-mapped host memory: give `host` to OnDone::counter and
// let a kernel spin on `device`, or a stream wait with gpu_stream_wait(), until it reaches a value.
struct GpuCounter {
  std::atomic<uint64_t>* host = nullptr;
  const uint64_t* device = nullptr;
  uint32_t id = UINT32_MAX;
  uint32_t worker = 0;  // whose GPU it lives on
};

// Counters of one NIC, as seen by this engine.
struct NicStats {
  uint64_t writes_posted = 0;
  uint64_t bytes_written = 0;
  uint64_t sends_posted = 0;
  uint64_t imms_received = 0;
  uint64_t messages_received = 0;
  uint64_t errors = 0;
  // Faults injected on this NIC by EngineConfig::faults (0 otherwise), and of those the
  // immediates reported twice: imms_received counts each arrival, duplicates included.
  uint64_t faults_injected = 0;
  uint64_t imms_duplicated = 0;
  // Immediates dropped because EngineConfig::max_unexpected_imms distinct values were already
  // counted with nobody waiting for them.
  uint64_t imms_dropped = 0;
  // Messages that reached this NIC and could not be delivered: longer than the receive buffers
  // (submit_recvs' len), or failed in the provider. Each is also logged (the first at warn).
  uint64_t messages_dropped = 0;
  // Which NIC: its name as the provider calls it (libfabric domain "rdmap16s27-rdm", verbs device
  // "mlx5_0", "cuda_ipc"), the worker it belongs to, and its link speed (0: the provider does not
  // say, as on loopback).
  std::string nic;
  uint32_t worker = 0;
  double link_gbps = 0;
};

// A pending expect_imm_count, to cancel it.
struct ImmExpectation {
  uint32_t imm = 0;
  uint64_t id = 0;
  uint32_t worker = 0;
  uint32_t engine = 0;  // the engine that made it (see MrHandle)
};

struct ExpectOptions {
  // Not met within this long: the expectation ends with kTimeout (its arrivals stay counted).
  // None: it waits until met, cancelled or the engine closes.
  std::optional<std::chrono::milliseconds> timeout;
  // Where the counted WRITEs land: immediates are counted by the worker whose NICs receive them,
  // the one serving the destination regions' device (host memory, and any one-worker engine: the
  // first).
  Device device{};
};

// A range of this engine's immediate space held by one user (TransferEngine::reserve_imms).
// Regions registered under it (reg_mr with the reservation) carry the range in their MrDesc, and
// every WRITE into them is given its immediate in the range's local values: a writer submits
// local value v (v < 2^bits, else kInvalidArgument at submit) and the immediate on the wire is
// base + v. The holder counts and discards local values here; nobody else can count or discard
// them (the engine's raw calls refuse a reserved value, naming the holder). Released when
// destroyed (or by release()); it must not outlive its engine's destruction (calls then throw
// kShutdown). Move-only.
class ImmReservation {
 public:
  ImmReservation() = default;  // holds nothing
  ~ImmReservation();
  ImmReservation(ImmReservation&& o) noexcept;
  ImmReservation& operator=(ImmReservation&& o) noexcept;
  ImmReservation(const ImmReservation&) = delete;
  ImmReservation& operator=(const ImmReservation&) = delete;

  bool held() const { return registry_ != nullptr; }
  const ImmRange& range() const { return range_; }
  const std::string& holder() const { return holder_; }
  uint32_t imm(uint64_t local) const { return range_.imm(local); }  // its value on the wire

  // TransferEngine::expect_imm_count, imm_count and discard_imm_count of local value `local`
  // (kInvalidArgument when it is outside the range, kNotFound once released).
  ImmExpectation expect(uint64_t local, uint64_t count, OnDone on_reached, ExpectOptions opts = {});
  uint64_t count(uint64_t local);
  uint64_t discard(uint64_t local);
  bool cancel(const ImmExpectation& expectation);
  void release();

 private:
  friend class EngineImpl;
  uint32_t checked(uint64_t local, const char* what) const;
  std::shared_ptr<ImmRegistry> registry_;
  uint64_t id_ = 0;
  ImmRange range_{};
  std::string holder_;
};

// The immediate accounting rule: every WRITE carries the transfer's immediate, so a receiver
// expects exactly as many immediates as the initiator posts WRITEs:
//   SingleWrite:  num_shards if given; else single_write_imm_count(len, nic_count, pinned) (1 if
//                 pinned, if the engine has one NIC or if len <= 32 KiB; else
//                 min(nics, ceil(len / 32 KiB)))
//   PagedWrites:  one per page
//   Scatter, GroupScatter: one per slice (zero-length slices included)
//   Barrier, GroupBarrier: one per destination
// Both sides have the same NIC count (rail alignment), so the receiver can compute it.
size_t single_write_imm_count(uint64_t len, size_t nic_count, bool pinned_to_one_nic);
size_t single_write_imm_count(const SingleWrite& write, size_t nic_count);

// Posting cost of one transfer (EngineConfig::record_post_timings).
struct PostTiming {
  uint64_t first_post_ns = 0;  // submit call to the first WRITE handed to the provider
  uint64_t last_post_ns = 0;   // submit call to the last one
  uint32_t writes = 0;
};

class TransferEngine {
 public:
  // Opens every NIC, starts the worker and the callback thread. Throws fabric::Error.
  explicit TransferEngine(EngineConfig config = {});
  // Joins every thread; every transfer or expectation still pending ends with a kShutdown error.
  ~TransferEngine();
  TransferEngine(const TransferEngine&) = delete;
  TransferEngine& operator=(const TransferEngine&) = delete;

  // Every worker's NIC (and cuda_ipc) addresses.
  NetAddr main_address() const;
  size_t nic_count() const;     // NICs per worker (the rail width)
  size_t worker_count() const;  // one per GPU served (EngineConfig::workers), or 1

  // Registers [ptr, ptr+len) with every NIC for local use and remote writes.
  std::pair<MrHandle, MrDesc> reg_mr(void* ptr, size_t len, Device device = Device::host());
  // The same, for a region whose incoming immediates belong to `imms` (see ImmReservation).
  std::pair<MrHandle, MrDesc> reg_mr(void* ptr, size_t len, Device device, const ImmReservation& imms);
  // Registers every region of `regions` in one call (MrRequest: each one's memory, device,
  // reservation, prefault), with one round trip to each worker serving them instead of one per
  // region; handles and descriptors in the order given. All or nothing: every entry is checked
  // as reg_mr checks it before any is registered, and a failure part-way (the provider, the region
  // slots) deregisters those already done; the error names the entry (its index) that failed.
  std::vector<std::pair<MrHandle, MrDesc>> reg_mrs(std::span<const MrRequest> regions);

  // Reserves a range of this engine's immediate space for one user (ImmReservation). Throws
  // kInvalidArgument for bits outside 1..32, a misaligned base or a range that overlaps one
  // already held (the error names its holder), kResourceExhausted when no block that large is free.
  ImmReservation reserve_imms(const ImmReserveRequest& request);
  // Ends remote and local access. Throws kNotFound for an unknown or stale handle.
  void dereg_mr(MrHandle handle);

  // Two-sided message; bytes are copied before this returns (the caller may reuse its buffer).
  void submit_send(const NetAddr& dst, std::span<const std::byte> bytes, OnDone on_done);
  // A pool of `count` receive buffers of `len` bytes each, re-posted after each message.
  // on_recv runs on the callback thread with the message bytes (valid during the call only).
  using RecvCallback = std::function<void(std::span<const std::byte>)>;
  void submit_recvs(size_t len, size_t count, RecvCallback on_recv);

  // Calls on_reached once immediate `imm` has been received `count` times. Immediates that
  // arrived before this call count toward it. Arrivals beyond `count` stay counted for the next
  // expectation of the same immediate; several expectations of one immediate are met in order.
  // A value inside a reserved range is refused here and in imm_count and discard_imm_count
  // (kInvalidArgument naming the holder): its holder counts it through its ImmReservation.
  ImmExpectation expect_imm_count(uint32_t imm, uint64_t count, OnDone on_reached,
                                  ExpectOptions opts = {});
  // Ends a pending expectation: its OnDone gets kCancelled and what it had seen stays counted.
  // False when it had already ended (met, timed out or cancelled).
  bool cancel_imm_expectation(const ImmExpectation& expectation);
  // How many arrivals of `imm` are counted and not yet consumed by an expectation (for tests and
  // diagnostics; answered by the worker, so it costs a round trip).
  uint64_t imm_count(uint32_t imm);
  // Drops the arrivals of `imm` counted and not consumed (pending expectations stay, counting
  // from zero); returns how many. For a tag whose sender gave up: its late immediates must not
  // count toward the tag's next use (KvReceiver does this before it reuses a failed request's tag).
  uint64_t discard_imm_count(uint32_t imm);

  // Interns a remote region: resolves its owner's addresses (address-vector insertion,
  // connection set-up starts) and copies its keys, once. Idempotent: the same descriptor gives
  // the same handle until remove_remote. Throws kInvalidArgument for a descriptor of another
  // provider or NIC count, kResourceExhausted when EngineConfig::max_remotes are interned.
  RemoteMr add_remote(const MrDesc& desc);
  // Forgets an interned region (requests naming it afterwards fail with kNotFound; those already
  // taken by the worker finish). The peer stays connected for its other regions.
  void remove_remote(RemoteMr remote);
  // Connects to the owner of an interned region now, so that the first transfer to it pays no
  // connection set-up (tcp;ofi_rxm: ~30 ms; verbs: the queue pair handshake): one zero-byte WRITE
  // without an immediate into the region, through every NIC of every worker, and returns when
  // all completed. Nothing is written and the owner counts nothing. Throws what a WRITE to the
  // peer would report (kProvider for a peer that is gone, kTimeout after transfer_timeout).
  void connect(RemoteMr remote);

  // Write requests (fabric/requests.h). Validated here: errors found now are thrown
  // (kNotFound for stale handles, kOutOfBounds, kInvalidArgument, kUnsupported for a route that
  // cannot carry the memory); later ones reach on_done exactly once. No heap allocation.
  void submit(const SingleWrite& write, OnDone on_done);
  void submit(const PagedWrites& write, OnDone on_done);
  void submit(const Scatter& write, OnDone on_done);
  void submit(const GroupScatter& write, OnDone on_done);
  void submit(const Barrier& write, OnDone on_done);
  void submit(const GroupBarrier& write, OnDone on_done);

  // Prebuilds, per member and NIC, the WRITE a scatter or barrier to the group posts (peer,
  // remote key, base address). Members are interned remote regions; the group holds their peers
  // until the engine closes.
  PeerGroupHandle add_peer_group(std::span<const RemoteMr> members);
  // Forgets a peer that left: transfers to it still waiting to be posted end with kCancelled, and
  // what every NIC holds for it (address-vector entries, queue pairs, IPC mappings) is released.
  // Its interned regions are removed with it (their handles turn stale: kNotFound); a new
  // process at the same address is reached through the descriptors it publishes. A peer whose
  // operations fail is released by the engine itself once nothing of it is in flight, and
  // reached afresh by the next write. Unknown peers are ignored.
  void remove_peer(const NetAddr& peer);
  // Peers this engine holds NIC resources for (diagnostics and tests; a worker round trip).
  size_t peer_count();

  // Per worker in order: one entry per NIC, then one for the cuda_ipc domain where
  // EngineConfig::cuda_ipc is on.
  std::vector<NicStats> nic_stats();

  // Every metric of this engine (docs/api.md, "Metrics reference"), then every metrics source's
  // samples, in the Prometheus text exposition format 0.0.4. Any thread. Counters are read where
  // the workers keep them; the per-peer ones are asked of each worker (a round trip): a worker that
  // does not answer within a second is left out of them (fabric_worker_stalled says so).
  std::string metrics_text();
  // Adds `source` to every metrics_text() (and the metrics endpoint, EngineConfig::metrics_port)
  // until the returned registration is destroyed or removed. Throws kShutdown once the engine
  // closes.
  MetricsRegistration add_metrics_source(MetricsSource source);

  // GPU signals (CUDA builds, EngineConfig::cuda_device set; kUnsupported otherwise). Each
  // worker has its own watcher thread; `cuda_device` picks the GPU's worker (none: the first).
  // The word starts at 0; cb(old, new) runs once per change the watcher thread observes (a GPU
  // that writes faster than the thread polls may have intermediate values coalesced).
  UvmWatcher alloc_uvm_watcher(UvmCallback cb, std::optional<int> cuda_device = std::nullopt);
  void free_uvm_watcher(const UvmWatcher& watcher);  // also allowed from inside a callback
  GpuCounter alloc_gpu_counter(std::optional<int> cuda_device = std::nullopt);  // starts at 0
  void free_gpu_counter(const GpuCounter& counter);
  // Makes CUDA stream `cuda_stream` (a cudaStream_t) wait until *counter.device >= at_least, so a
  // kernel queued behind it starts the moment its data has landed (cuStreamWaitValue64).
  static void gpu_stream_wait(void* cuda_stream, const GpuCounter& counter, uint64_t at_least);
  // Timings recorded since the last call (at most the latest 65536).
  std::vector<PostTiming> take_post_timings();

 private:
  std::unique_ptr<EngineImpl> impl_;
};

}  // namespace fabric
