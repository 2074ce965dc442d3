// The worker: one thread that owns the NICs (Domains) of one GPU through its DomainGroup, takes
// requests from a lock-free queue, posts WRITEs, polls completions, counts immediates and hands
// events to the callback thread.
#pragma once

#include <array>
#include <atomic>
#include <deque>
#include <chrono>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "domain/domain.h"
#include "engine/callback_thread.h"
#include "engine/mr_table.h"
#include "engine/remote_table.h"
#include "util/mpsc_queue.h"
#include "util/object_pool.h"
#include "util/ring.h"
#include "util/shared_pool.h"
#include "worker/domain_group.h"
#include "worker/expectations.h"
#include "worker/request.h"
#include "worker/transfer.h"

namespace fabric {

// Hash of an engine address, so peers are looked up by NetAddr without building a key.
struct NetAddrHash {
  size_t operator()(const NetAddr& a) const {
    size_t h = std::hash<std::string>{}(a.local());
    for (size_t i = 0; i < a.nic_count(); i++)
      h = h * 1099511628211ull ^ std::hash<std::string>{}(a.nic(i));
    return h;
  }
};

// One pool per kind of request, so that a buffer is always filled the same way and its warm
// capacity fits (a buffer that carried pages is never handed to a scatter).
class RequestBufferPool {
 public:
  RequestBuffer* take(TransferKind k) { return pools_[static_cast<size_t>(k)].take(); }
  void give(TransferKind k, RequestBuffer* b) { pools_[static_cast<size_t>(k)].give(b); }

 private:
  std::array<util::SharedPool<RequestBuffer>, 7> pools_;  // one per TransferKind
};

class Worker {
 public:
  // Starts the thread, which pins itself, opens every NIC and only then allocates its state.
  // Throws the error that opening a NIC raised.
  // `config` is this worker's alone (one GPU, its NICs, its cores); `index` is its place in the
  // engine (its route in each RemoteTable slot, the worker named in the MrDescs it registers).
  Worker(const EngineConfig& config, size_t index, MrTable& mrs, RemoteTable& remotes,
         RequestBufferPool& buffers, CallbackThread& callbacks);
  ~Worker();  // stop(), if not done
  // Fails everything pending with kShutdown, closes the NICs and joins the thread. The object
  // stays (other threads may still look at it) but takes no more work. False: the worker was
  // wedged (no progress for worker_stall_timeout) and its thread was abandoned; it may still
  // touch this object, the region table and the callback thread, which must then never be freed.
  bool stop();

  // Any thread: its domains (DomainGroup) as opened.
  const std::vector<std::string>& nic_addresses() const { return domains_.nic_addresses(); }
  const std::string& provider() const { return domains_.provider(); }
  size_t nic_count() const { return domains_.nic_count(); }
  // The local (cuda_ipc) domain: its address ("" without one) and its index after the NICs.
  const std::string& local_address() const { return domains_.local_address(); }
  bool has_local() const { return domains_.has_local(); }
  size_t domain_count() const { return domains_.domain_count(); }
  const AtomicNicStats& stats(size_t domain) const { return domains_.stats(domain); }
  // The domains live as long as the worker.
  Domain::InjectedFaults injected_faults(size_t domain) const { return domains_.injected_faults(domain); }
  const DomainCaps& caps(size_t domain) const { return domains_.caps(domain); }

  // Any thread. Waits (yielding) while the queue is full. Throws kShutdown once the worker has
  // stopped taking requests (nothing submitted is ever silently lost).
  void submit(Request&& request);

  // Runs fn on the worker thread and returns its result (or rethrows its exception). Throws
  // kTimeout if the worker makes no progress for worker_stall_timeout before it starts fn (a
  // wedged provider): fn is then never run.
  template <class F>
  auto call(F&& fn) -> decltype(fn()) {
    using R = decltype(fn());
    std::packaged_task<R()> task(std::forward<F>(fn));
    auto result = task.get_future();
    auto gate = std::make_shared<CallGate>();
    // The task lives on this stack: the worker touches it only after taking the gate, which an
    // abandoning caller has closed first.
    submit(ControlRequest{[gate, &task] {
      if (gate->enter()) task();
    }});
    while (result.wait_for(std::chrono::milliseconds(1)) != std::future_status::ready)
      if (stalled() && gate->abandon()) throw stall_error("a control call (registration, query)");
    return result.get();
  }
  // No loop round for worker_stall_timeout (checked from another thread; it keeps its own clock).
  bool stalled();
  Error stall_error(const char* what) const;

  // Worker thread only (through call()).
  // A region registered with every domain of this worker (DomainGroup::register_region), and
  // deregistered from all of them.
  DomainGroup::Registration register_region(void* ptr, size_t len, Device device) {
    return domains_.register_region(ptr, len, device);
  }
  void deregister_region(std::array<DomainRegion, kMaxDomains>& regions) {
    domains_.deregister_region(regions);
  }
  // Fails every unreported transfer that reads from `src` (it is being deregistered) and returns
  // how many WRITEs from it are still with the NICs, which may be reading the memory.
  size_t fail_transfers_from(const RegionSlot* src);
  ResolvedTarget resolve(const NetAddr& peer);
  // The route to one destination region: the local domain where both ends offer it, else NICs.
  ResolvedTarget route(const MrDesc& dst);
  // An interned remote region's route in this worker (it holds the owner's peer record), set from
  // the slot's descriptor while the engine interns it / dropped once the engine made it stale.
  void attach_remote(uint32_t slot);
  void detach_remote(uint32_t slot);
  // A peer group of interned regions; returns its id.
  uint32_t add_group(std::span<const RemoteMr> members);
  // Application says the peer (one worker of it) left: its pending transfers end with kCancelled
  // and its resources go; returns the remote regions interned for it, which the engine removes.
  std::vector<RemoteMr> remove_peer(const NetAddr& peer);
  size_t peer_count() const { return peer_index_.size(); }
  uint64_t imm_count(uint32_t imm) const { return expectations_.count(imm); }
  uint64_t discard_imm_count(uint32_t imm) { return expectations_.discard(imm); }
  bool cancel_expectation(uint32_t imm, uint64_t id) { return expectations_.cancel(imm, id); }
  // A pool of receive buffers: registered and posted here (as many as the provider takes now;
  // the rest as it frees room). Throws what registration throws.
  void add_recv_pool(size_t len, size_t count, std::shared_ptr<TransferEngine::RecvCallback> on_recv);
  std::vector<PostTiming> take_post_timings() { return std::exchange(post_timings_, {}); }

 private:
  struct RecvPool;
  // Between a caller that may give up and the worker that may start its task: whoever comes
  // first decides.
  struct CallGate {
    std::mutex mu;
    bool started = false, abandoned = false;
    bool enter() {
      std::lock_guard l(mu);
      started = !abandoned;
      return started;
    }
    bool abandon() {
      std::lock_guard l(mu);
      abandoned = !started;
      return abandoned;
    }
  };

  void run(std::promise<void> opened);
  void open_send_buffers();
  void loop();
  bool take_requests();
  void handle(TransferRequest&& r);
  void handle(ExpectRequest&& r) { expectations_.expect(std::move(r)); }
  void handle(ControlRequest&& r) { r.run(); }
  void handle(StopRequest&&) { stopping_ = true; }

  bool pump(Transfer& t);  // posts what it can; false if a NIC pushed back
  bool post_next(Transfer& t);
  bool post_pending();
  bool post_recv_backlog();
  bool poll_domains();
  // Peer records: what the domains hold for one remote engine, shared by the transfers to it.
  uint32_t new_record(const NetAddr& addr, const ResolvedTarget& t);
  void release_record(uint32_t r);     // the domains forget the peer (the record may stay held)
  void unhold_record(uint32_t r);      // a transfer let go of it
  void maybe_free_record(uint32_t r);  // reused once released, unheld and with nothing in flight
  bool usable(Transfer& t, ResolvedTarget& target, uint32_t op);  // re-resolves a failed peer
  ResolvedTarget target_of(const TransferRequest& q, size_t destination);
  // A live route for an interned region or a group member, resolved again if its peer was
  // released; throws (kNotFound, kCancelled) when there is none.
  const ResolvedTarget& current(const RemoteMr& remote);
  const ResolvedTarget& refresh(ResolvedTarget& held, const MrDesc& desc);
  void rehold(ResolvedTarget& held, const ResolvedTarget& fresh);
  void peer_failed(uint32_t r);
  void on_completion(size_t nic, Completion& c);
  void repost_recv(size_t nic, OpContext* ctx);
  void record_post_timing(Transfer& t);
  void fail(Transfer& t, Status status);
  void maybe_finish(Transfer& t);
  void report(OnDone& on_done, Status status);
  void check_deadlines();
  void shutdown();

  void link(Transfer& t);
  void unlink(Transfer& t);

  EngineConfig config_;
  const size_t index_;
  MrTable& mrs_;
  RemoteTable& remotes_;
  RequestBufferPool& buffers_;
  CallbackThread& callbacks_;
  util::MpscQueue<Request> requests_;
  // Opened by the worker thread before the constructor returns; then only its addresses, stats
  // and faults are read from other threads.
  DomainGroup domains_;
  std::thread thread_;

  // Owned by the worker thread.
  struct PeerRecord {
    enum class State : uint8_t { kFree, kLive, kFailed, kReleased, kRemoved };
    State state = State::kFree;
    ResolvedTarget target;
    NetAddr addr;
    uint32_t holders = 0;      // transfers whose targets name this record
    uint32_t outstanding = 0;  // operations posted to it, not completed
  };
  std::vector<PeerRecord> records_;
  std::vector<uint32_t> free_records_;
  std::unordered_map<NetAddr, uint32_t, NetAddrHash> peer_index_;  // live and failed records
  std::vector<std::unique_ptr<GroupState>> groups_;
  std::vector<WriteOp> batch_ops_;  // a batch being posted (capacity kept)
  Expectations expectations_;  // immediates counted here and the expectations waiting for them
  bool warned_imm_drop_ = false;
  util::ObjectPool<Transfer> transfers_{256};
  util::ObjectPool<OpContext> contexts_{1024};
  util::Ring<Transfer*> pending_;       // transfers with WRITEs left to post, FIFO
  Transfer* oldest_ = nullptr;          // unreported transfers, oldest first (deadline order)
  Transfer* newest_ = nullptr;
  std::vector<std::unique_ptr<RecvPool>> recv_pools_;
  size_t recvs_unposted_ = 0;  // receive buffers the provider did not take yet
  std::vector<uint8_t> send_buffer_;
  DomainRegion send_region_;
  std::vector<uint32_t> free_send_slots_;
  std::deque<Event> overflow_;
  std::vector<PostTiming> post_timings_;
  bool stopping_ = false;
  // Submitters inside submit(), and whether the worker still takes requests: the last drain
  // waits for the first to reach zero after the second turned false, so none is lost.
  std::atomic<uint32_t> submitters_{0};
  std::atomic<bool> accepting_{true};
  // Progress, for wedge detection: the loop bumps heartbeat_; waiters remember when they last
  // saw it move (under watch_mu_, off the data path).
  std::atomic<uint64_t> heartbeat_{0};
  std::atomic<bool> exited_{false};
  std::mutex watch_mu_;
  uint64_t watched_beat_ = 0;
  Clock::time_point watched_since_{};
};

}  // namespace fabric
