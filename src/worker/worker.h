// The worker: one thread that owns the NICs (Domains) of one GPU through its DomainGroup, takes
// requests from a lock-free queue, posts transfers (Poster), polls completions, counts immediates
// and hands events to the callback thread. Peer records: PeerTable; receive buffers: RecvPools.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <deque>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "domain/domain.h"
#include "shared_state/callback_thread.h"
#include "shared_state/mr_table.h"
#include "shared_state/remote_table.h"
#include "util/mpsc_queue.h"
#include "util/object_pool.h"
#include "util/ring.h"
#include "util/round_clock.h"
#include "util/shared_pool.h"
#include "worker/domain_group.h"
#include "worker/expectations.h"
#include "worker/peer_table.h"
#include "worker/poster.h"
#include "worker/recv_pools.h"
#include "worker/request.h"
#include "worker/transfer.h"
#include "worker/worker_metrics.h"

namespace fabric {

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

  // Its components, for the engine's control calls. The DomainGroup's addresses, counts,
  // statistics and capabilities: any thread once opened (they live as long as the worker). The
  // rest, and everything else of theirs: the worker thread only, i.e. inside call().
  DomainGroup& domains() { return domains_; }
  const DomainGroup& domains() const { return domains_; }
  PeerTable& peers() { return peers_; }  // peer records, routes, groups (peer_table.h)
  Expectations& expectations() { return expectations_; }  // immediate counts and expectations
  RecvPools& recv_pools() { return recv_pools_; }         // receive buffers (RecvPools::add)
  Poster& poster() { return poster_; }                    // posting (its post timings)
  // Its transfer metrics: any thread (single-writer counters).
  const WorkerMetrics& metrics() const { return metrics_; }

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
  // As call(), but for a reader that must not wait long (metrics): nullopt when the worker has
  // not started fn within `patience` (fn is then never run) or takes no more requests.
  template <class F>
  auto try_call(F&& fn, std::chrono::milliseconds patience) -> std::optional<decltype(fn())> {
    using R = decltype(fn());
    std::packaged_task<R()> task(std::forward<F>(fn));
    auto result = task.get_future();
    auto gate = std::make_shared<CallGate>();
    try {
      submit(ControlRequest{[gate, &task] {
        if (gate->enter()) task();
      }});
    } catch (const Error&) {
      return std::nullopt;
    }
    const auto give_up = std::chrono::steady_clock::now() + patience;
    while (result.wait_for(std::chrono::milliseconds(1)) != std::future_status::ready)
      if (std::chrono::steady_clock::now() > give_up && gate->abandon()) return std::nullopt;
    return result.get();
  }
  // No loop round for worker_stall_timeout (checked from another thread; it keeps its own clock).
  bool stalled();
  Error stall_error(const char* what) const;

  // A region registered with this worker's domains, one part at a time
  // (DomainGroup::register_region): Part::kOnWorker on the worker thread only (through call());
  // Part::kBesideWorker on any thread, counted as a submitter, so that shutdown waits for it
  // before closing the domains (and once the worker takes no more requests it throws
  // kShutdown). Deregistered the same way.
  void register_region(void* ptr, size_t len, Device device, DomainGroup::Part part,
                       DomainGroup::Registration& r);
  void deregister_region(std::array<DomainRegion, kMaxDomains>& regions, DomainGroup::Part part);

  // Worker thread only (through call()).
  // Fails every unreported transfer that reads from `src` (it is being deregistered) and returns
  // how many WRITEs from it are still with the NICs, which may be reading the memory.
  size_t fail_transfers_from(const RegionSlot* src);

 private:
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
  void loop();
  bool take_requests();
  void handle(TransferRequest&& r);
  void handle(ExpectRequest&& r) { expectations_.expect(std::move(r)); }
  void handle(ControlRequest&& r) { r.run(); }
  void handle(StopRequest&&) { stopping_ = true; }

  bool post_pending();
  bool poll_domains();
  void on_completion(size_t nic, Completion& c);
  void maybe_finish(Transfer& t);
  void report(OnDone& on_done, Status status);
  // A transfer's end in its metrics: completed (with its submit -> complete time) or failed.
  void count_completed(const Transfer& t);
  void count_failed(const Transfer& t, ErrorCode code);
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
  WorkerMetrics metrics_;      // written here, read by any thread
  util::RoundClock clock_;     // the metrics' timestamps, read once per phase of a round
  PeerTable peers_;            // peer records, the routes and groups that hold them
  Expectations expectations_;  // immediates counted here and the expectations waiting for them
  bool warned_imm_drop_ = false;
  bool warned_message_drop_ = false;
  util::ObjectPool<Transfer> transfers_{256};
  Poster poster_;                   // a transfer's operations posted, their contexts, send slots
  util::Ring<Transfer*> pending_;   // transfers with WRITEs left to post, FIFO
  Transfer* oldest_ = nullptr;      // unreported transfers, oldest first (deadline order)
  Transfer* newest_ = nullptr;
  std::deque<Event> overflow_;      // events the callback thread's full queue did not take yet
  RecvPools recv_pools_;            // receive buffers for messages
  bool stopping_ = false;
  // Submitters inside submit(), and whether the worker still takes requests: the last drain
  // waits for the first to reach zero after the second turned false, so none is lost.
  std::atomic<uint32_t> submitters_{0};
  std::atomic<bool> accepting_{true};
  // Progress, for wedge detection: the loop bumps heartbeat_; waiters remember when they last
  // saw it move (under watch_mu_, off the data path).
  std::atomic<uint64_t> heartbeat_{0};
  std::atomic<bool> exited_{false};
  // stop() gave up on this thread: once it gets out of the provider it touches nothing more.
  bool abandoned() const { return domains_.abandoned(); }
  std::mutex watch_mu_;
  uint64_t watched_beat_ = 0;
  Clock::time_point watched_since_{};
};

}  // namespace fabric
