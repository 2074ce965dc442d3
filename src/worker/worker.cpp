// Worker loop: requests first (the first WRITE of a new transfer is posted at once), then keep the
// NICs busy from pending work, then poll completions, aggregate them per transfer across NICs,
// and hand results to the callback thread. Nothing here takes a lock.
#include "worker/worker.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>

#include "util/idle.h"
#include "util/log.h"

namespace fabric {

Worker::Worker(const EngineConfig& config, size_t index, MrTable& mrs, RemoteTable& remotes,
               RequestBufferPool& buffers, CallbackThread& callbacks)
    : config_(config),
      index_(index),
      mrs_(mrs),
      remotes_(remotes),
      buffers_(buffers),
      callbacks_(callbacks),
      requests_(config.request_queue_capacity),
      peers_(domains_, remotes, index),
      expectations_(config.max_unexpected_imms,
                    [this](OnDone& d, Status s) { report(d, std::move(s)); }),
      poster_(config, metrics_, clock_),
      recv_pools_(domains_, callbacks, overflow_) {
  std::promise<void> opened;
  auto ready = opened.get_future();
  thread_ = std::thread([this, p = std::move(opened)]() mutable { run(std::move(p)); });
  try {
    ready.get();
  } catch (...) {
    thread_.join();
    throw;
  }
}

Worker::~Worker() { stop(); }

bool Worker::stop() {
  if (!thread_.joinable()) return true;
  try {
    submit(StopRequest{});
  } catch (const Error&) {  // wedged with a full queue: the stop request cannot even be queued
  }
  while (!exited_.load(std::memory_order_acquire)) {
    if (stalled()) {
      log::error("{}; closing the engine without it: its thread and memory are left behind and "
                 "its pending transfers will not report",
                 stall_error("closing the engine").what());
      // Before letting go: once the provider lets it go on, the thread must not call into the
      // provider again, since this process may be exiting and tearing the provider down.
      domains_.abandon();
      thread_.detach();
      return false;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  thread_.join();
  return true;
}

bool Worker::stalled() {
  std::lock_guard l(watch_mu_);
  uint64_t beat = heartbeat_.load(std::memory_order_relaxed);
  Clock::time_point now = Clock::now();
  if (beat != watched_beat_ || watched_since_ == Clock::time_point{}) {
    watched_beat_ = beat;
    watched_since_ = now;
    return false;
  }
  return now - watched_since_ > config_.worker_stall_timeout;
}

Error Worker::stall_error(const char* what) const {
  return Error(ErrorCode::kTimeout,
               fmt::format("{}: the engine's worker has made no progress for {} ms, stuck inside "
                           "the '{}' provider (shm does this after a peer died holding its lock); "
                           "restart this process (EngineConfig::worker_stall_timeout)",
                           what, config_.worker_stall_timeout.count(), domains_.provider()));
}

void Worker::submit(Request&& request) {
  // Pairs with shutdown(): either this sees accepting_ false, or shutdown sees this submitter
  // and drains until it has pushed (seq_cst on both sides).
  submitters_.fetch_add(1, std::memory_order_seq_cst);
  if (!accepting_.load(std::memory_order_seq_cst)) {
    submitters_.fetch_sub(1, std::memory_order_seq_cst);
    throw Error(ErrorCode::kShutdown, "the engine is shutting down and takes no more requests");
  }
  for (uint32_t spins = 0; !requests_.try_push(request); spins++) {
    if ((spins & 1023) == 1023 && stalled()) {  // full and nobody takes from it
      submitters_.fetch_sub(1, std::memory_order_seq_cst);
      throw stall_error("submitting");
    }
    std::this_thread::yield();
  }
  submitters_.fetch_sub(1, std::memory_order_seq_cst);
}

namespace {
// A caller's thread inside the worker's domains (a registration beside the worker): counted as a
// submitter, as in submit().
class BesideWorker {
 public:
  BesideWorker(std::atomic<uint32_t>& submitters, const std::atomic<bool>& accepting) : submitters_(submitters) {
    submitters_.fetch_add(1, std::memory_order_seq_cst);
    if (!accepting.load(std::memory_order_seq_cst)) {
      submitters_.fetch_sub(1, std::memory_order_seq_cst);
      throw Error(ErrorCode::kShutdown, "the engine is shutting down and registers no more regions");
    }
  }
  ~BesideWorker() { submitters_.fetch_sub(1, std::memory_order_seq_cst); }
  BesideWorker(const BesideWorker&) = delete;
  BesideWorker& operator=(const BesideWorker&) = delete;

 private:
  std::atomic<uint32_t>& submitters_;
};
}  // namespace

void Worker::register_region(void* ptr, size_t len, Device device, DomainGroup::Part part,
                             DomainGroup::Registration& r) {
  if (part == DomainGroup::Part::kOnWorker) return domains_.register_region(ptr, len, device, part, r);
  BesideWorker inside(submitters_, accepting_);
  domains_.register_region(ptr, len, device, part, r);
}

void Worker::deregister_region(std::array<DomainRegion, kMaxDomains>& regions, DomainGroup::Part part) {
  if (part == DomainGroup::Part::kOnWorker) return domains_.deregister_region(regions, part);
  BesideWorker inside(submitters_, accepting_);
  domains_.deregister_region(regions, part);
}

void Worker::run(std::promise<void> opened) {
  try {
    if (config_.worker_cpu) {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(*config_.worker_cpu, &set);
      if (pthread_setaffinity_np(pthread_self(), sizeof set, &set) != 0)
        throw Error(ErrorCode::kInvalidArgument,
                    fmt::format("cannot pin the worker to CPU {}", *config_.worker_cpu));
    }
    domains_.open(config_);  // after pinning, so NIC state lands on this core's NUMA node
    poster_.open(domains_);
  } catch (...) {
    domains_.close();
    opened.set_exception(std::current_exception());
    return;
  }
  opened.set_value();
  loop();
  // Abandoned: its owner has given up on it and left everything behind (stop()); closing the
  // NICs now would race with a process exit tearing the provider down.
  if (abandoned()) return;
  shutdown();
  exited_.store(true, std::memory_order_release);
}

void Worker::loop() {
  util::Idle idle(config_.worker_poll, config_.idle_sleep);
  uint32_t rounds = 0;
  while (!stopping_) {
    heartbeat_.store(rounds, std::memory_order_relaxed);
    clock_.next_phase();  // posting
    bool busy = take_requests();
    busy |= post_pending();
    busy |= recv_pools_.post_backlog();
    clock_.next_phase();  // completions
    busy |= poll_domains();
    // Any call into the provider may spin past stop()'s patience (shm on a dead peer's lock).
    // Once stop() gave up on this thread, its DomainGroup posts and polls nothing more, and the
    // thread goes no further, reporting nothing to anyone.
    if (abandoned()) return;
    if (!overflow_.empty()) callbacks_.flush(overflow_);
    // Reading the clock costs as much as a post (7% of a busy worker's time when read every
    // round): look at deadlines every 256 rounds, i.e. every few microseconds to milliseconds.
    if ((++rounds & 255) == 0) check_deadlines();
    if (busy) {
      idle.reset();
    } else {
      idle.wait();
    }
  }
}

bool Worker::take_requests() {
  bool any = false;
  for (int i = 0; i < 64 && !stopping_ && !abandoned(); i++) {
    std::optional<Request> r = requests_.try_pop();
    if (!r) break;
    any = true;
    try {
      std::visit([this](auto&& req) { handle(std::move(req)); }, std::move(*r));
    } catch (const std::exception& e) {  // a bug or a provider throwing: never terminate
      log::error("worker: a request failed unexpectedly: {}", e.what());
    }
  }
  return any;
}

void Worker::handle(TransferRequest&& r) {
  metrics_.taken[WorkerMetrics::kind(r.kind)].add();
  Transfer& t = *transfers_.acquire();
  t.req = std::move(r);
  link(t);
  const TransferRequest& q = t.req;
  try {
    if (reads_source(q.kind)) {
      t.src = mrs_.find(q.src);
      if (!t.src)
        throw Error(ErrorCode::kNotFound, "source region was deregistered before the transfer ran");
    }
    switch (q.kind) {
      case TransferKind::kSingle: t.total_ops = q.shards; break;
      case TransferKind::kSend: t.total_ops = 1; break;
      default: t.total_ops = q.count; break;  // pages, slices, destinations
    }
    if (grouped(q.kind)) {
      t.group = peers_.group(q.group);
      if (!t.group) throw Error(ErrorCode::kNotFound, "unknown peer group");
    } else {
      size_t destinations = per_destination(q.kind) ? t.total_ops : 1;
      for (size_t i = 0; i < destinations; i++) t.targets.push_back(peers_.target_of(q, i));
    }
    // Pages to a same-host GPU peer go as batches where the local domain takes them (one
    // gather kernel and one completion for many pages).
    if (q.kind == TransferKind::kPaged && t.targets[0].local && q.pinned_nic < 0) {
      size_t batch = domains_.local_write_batch();
      if (batch > 1) {
        t.batch = static_cast<uint32_t>(batch);
        t.total_ops = static_cast<uint32_t>((q.count + batch - 1) / batch);
      }
    }
  } catch (const Error& e) {
    t.fail(e.status());
  }
  for (auto& target : t.targets) peers_.hold(target.record);
  if (t.failed) {
    maybe_finish(t);
    return;
  }
  // FIFO under back-pressure: while older transfers wait to post, a new one waits behind them
  // (posting it first would let a stream of small writes starve a large pending one). When
  // nothing waits, its first WRITE goes out at once.
  if (!pending_.empty() || !poster_.pump(t, domains_, peers_)) {
    t.queued = true;
    pending_.push_back(&t);
  }
  maybe_finish(t);
}

bool Worker::post_pending() {
  bool any = false;
  size_t n = pending_.size();
  for (size_t k = 0; k < n; k++) {
    Transfer* t = pending_.front();
    pending_.pop_front();
    uint32_t before = t->next_op;
    bool done = t->failed || poster_.pump(*t, domains_, peers_);
    any |= t->next_op != before;
    if (done) {
      t->queued = false;
      maybe_finish(*t);
    } else {
      pending_.push_back(t);
    }
  }
  return any;
}

bool Worker::poll_domains() {
  return domains_.poll([this](size_t nic, Completion& c) { on_completion(nic, c); });
}

void Worker::on_completion(size_t nic, Completion& c) {
  NicCounters& st = domains_.stats(nic);
  switch (c.kind) {
    case Completion::Kind::kRemoteImm:
      st.imms_received.add();
      if (!expectations_.arrive(c.imm)) {
        st.imms_dropped.add();
        if (!warned_imm_drop_)
          log::warn("immediate {:#x} dropped: {} distinct immediates are already counted with no "
                    "expectation waiting (EngineConfig::max_unexpected_imms); NicStats::imms_dropped "
                    "counts further drops",
                    c.imm, config_.max_unexpected_imms);
        warned_imm_drop_ = true;
      }
      return;
    case Completion::Kind::kRecv:
      st.messages_received.add();
      recv_pools_.received(nic, c.context, c.len);
      return;
    case Completion::Kind::kError:
      st.errors.add();
      if (!c.context) {  // not ours (e.g. a peer's connection failed): nothing to end
        log::warn("nic {}: {}", nic, c.error);
        return;
      }
      if (c.context->kind == kOpRecv) {  // a failed receive still owns its buffer: post it again
        // The message is lost to the application: counted, and said once loudly (a sender that
        // keeps sending too-long messages would flood the log), then at debug.
        st.messages_dropped.add();
        if (!warned_message_drop_)
          log::warn("nic {}: a message was dropped: {}. A message longer than the receive buffers "
                    "(submit_recvs' len) cannot be delivered: give the buffers the senders' "
                    "EngineConfig::max_message_size. NicStats::messages_dropped counts further drops",
                    nic, c.error);
        else
          log::debug("nic {}: a message was dropped: {}", nic, c.error);
        warned_message_drop_ = true;
        recv_pools_.repost(nic, c.context);
        return;
      }
      [[fallthrough]];
    case Completion::Kind::kLocal: {
      OpContext* ctx = c.context;
      auto* t = static_cast<Transfer*>(ctx->owner);
      if (c.kind == Completion::Kind::kLocal) {
        if (ctx->kind == kOpWrite) {
          st.writes.add(ctx->writes);
          st.bytes.add(ctx->aux);
          peers_.count_writes(ctx->peer, ctx->writes, ctx->aux);
        } else {
          st.sends.add();
          peers_.count_send(ctx->peer);
        }
      } else {
        peers_.count_error(ctx->peer);
        if (!t->failed) t->peer_lost = c.peer_lost;
        t->fail(Status(ErrorCode::kProvider, c.error));
      }
      poster_.complete(ctx, c.kind == Completion::Kind::kError && c.peer_lost, domains_, peers_);
      maybe_finish(*t);
      return;
    }
  }
}

void Worker::maybe_finish(Transfer& t) {
  bool all_posted = t.failed || t.next_op == t.total_ops;
  bool done_now = !t.reported && all_posted && t.outstanding == 0;
  // The request's buffer goes back before the caller hears of the end, so a caller that waits
  // for its transfers never sees more buffers taken than it has transfers open (the pool stops
  // growing after warm-up).
  if ((done_now || t.reported) && t.outstanding == 0 && !t.queued)
    buffers_.give(t.req.kind, std::exchange(t.req.buf, nullptr));
  if (done_now) {
    t.reported = true;
    unlink(t);
    if (t.failed) {
      count_failed(t, t.error.code());
      report(t.req.on_done, t.error);
    } else {
      count_completed(t);
      report(t.req.on_done, Status::ok_status());
    }
  }
  if (t.reported && t.outstanding == 0 && !t.queued) {
    if (t.send_slot != UINT32_MAX) poster_.free_send_slot(t.send_slot);
    for (auto& target : t.targets) peers_.unhold(target.record);
    transfers_.release(&t);
  }
}

// A flag or counter is set here, by the worker (OnDone::fire: no callback cost); a callback runs
// on the callback thread, never on a worker.
void Worker::report(OnDone& on_done, Status status) {
  if (on_done.kind() == OnDone::Kind::kCallback) {
    Event e;
    e.done = std::move(on_done.callback_fn());
    e.status = std::move(status);
    callbacks_.push(std::move(e), overflow_);
    return;
  }
  if (!status.ok()) log::warn("transfer failed: {}", status.message());
  on_done.fire(status);
}

// The submit time is the deadline minus the timeout; now is the round clock's.
void Worker::count_completed(const Transfer& t) {
  const size_t k = WorkerMetrics::kind(t.req.kind);
  const int64_t ns = std::chrono::nanoseconds(clock_.now() - (t.req.deadline - config_.transfer_timeout)).count();
  metrics_.duration[k].observe(ns > 0 ? static_cast<uint64_t>(ns) : 0);
  metrics_.completed[k].add();
}

void Worker::count_failed(const Transfer& t, ErrorCode code) {
  const size_t cause = t.peer_lost && code == ErrorCode::kProvider ? kCausePeerLost : static_cast<size_t>(code);
  metrics_.failed[WorkerMetrics::kind(t.req.kind)][cause].add();
}

// Transfers are linked in submission order and share one timeout, so the oldest expires first.
void Worker::check_deadlines() {
  if (!oldest_ && !expectations_.has_deadlines()) return;
  Clock::time_point now = Clock::now();
  expectations_.expire(now);
  while (oldest_ && oldest_->req.deadline <= now) {
    Transfer& t = *oldest_;
    t.fail(Status(ErrorCode::kTimeout,
                  fmt::format("transfer not completed after {} ms ({} of {} WRITEs posted, {} "
                              "outstanding): is the peer alive? (EngineConfig::transfer_timeout)",
                              config_.transfer_timeout.count(), t.next_op, t.total_ops,
                              t.outstanding)));
    t.reported = true;
    unlink(t);
    count_failed(t, ErrorCode::kTimeout);
    report(t.req.on_done, t.error);
    // The peer it waited for is unreachable (its connection never came up, or its WRITEs never
    // complete): release it once nothing of it is in flight, so a restarted peer is met afresh.
    // Per-destination transfers post in order: the one it stopped at is the one to blame.
    size_t destinations = t.group ? t.group->members.size() : t.targets.size();
    if (destinations > 0) {
      size_t blocker =
          per_destination(t.req.kind) ? std::min<size_t>(t.next_op, destinations - 1) : 0;
      peers_.peer_failed(t.group ? t.group->members[blocker].target.record
                                 : t.targets[blocker].record);
    }
    // Outstanding WRITEs keep their context; the transfer is freed when they complete or at
    // shutdown. They stop counting against the in-flight limits.
    domains_.forget_in_flight(t.outstanding_on);
  }
}

size_t Worker::fail_transfers_from(const RegionSlot* src) {
  for (Transfer* t = oldest_; t;) {
    Transfer* next = t->next;  // maybe_finish may unlink and free t
    if (t->src == src) {
      t->fail(Status(ErrorCode::kNotFound,
                     fmt::format("the source region was deregistered while this transfer was in "
                                 "flight ({} of {} WRITEs posted)",
                                 t->next_op, t->total_ops)));
      maybe_finish(*t);
    }
    t = next;
  }
  return src->writes_in_flight;  // timed-out transfers' WRITEs still with a NIC included
}

void Worker::shutdown() {
  Status stopped(ErrorCode::kShutdown, "the engine was shut down before this finished");
  while (oldest_) {
    Transfer& t = *oldest_;
    t.reported = true;
    unlink(t);
    count_failed(t, ErrorCode::kShutdown);
    report(t.req.on_done, stopped);
  }
  expectations_.end_all(stopped);
  // Requests that raced with the stop request. No submitter may push after the last drain: stop
  // accepting, then drain until none is inside submit() (one may be waiting for queue room).
  accepting_.store(false, std::memory_order_seq_cst);
  for (bool last = false; !last;) {
    last = submitters_.load(std::memory_order_seq_cst) == 0;
    while (auto r = requests_.try_pop()) {
      if (auto* t = std::get_if<TransferRequest>(&*r)) report(t->on_done, stopped);
      if (auto* e = std::get_if<ExpectRequest>(&*r)) report(e->on_done, stopped);
      if (auto* c = std::get_if<ControlRequest>(&*r)) c->run();
    }
    heartbeat_.fetch_add(1, std::memory_order_relaxed);  // still making progress
    if (!last) std::this_thread::yield();
  }
  while (!callbacks_.flush(overflow_)) std::this_thread::yield();
  for (uint32_t s = 0; s < mrs_.allocated(); s++) {
    RegionSlot& slot = mrs_.slot(s);
    // Only this worker's regions: the others' belong to domains this thread must not touch.
    const bool live = (slot.generation.load(std::memory_order_relaxed) & 1) == 1;
    if (!live || slot.worker.load(std::memory_order_relaxed) != index_) continue;
    domains_.deregister_region(slot.per_nic);
    heartbeat_.fetch_add(1, std::memory_order_relaxed);
    slot.generation.fetch_add(1, std::memory_order_release);
  }
  recv_pools_.close();
  poster_.close(domains_);
  domains_.close();  // closes endpoints: nothing refers to our contexts any more
}

void Worker::link(Transfer& t) {
  t.prev = newest_;
  t.next = nullptr;
  if (newest_) newest_->next = &t;
  newest_ = &t;
  if (!oldest_) oldest_ = &t;
}

void Worker::unlink(Transfer& t) {
  if (t.prev) t.prev->next = t.next;
  else oldest_ = t.next;
  if (t.next) t.next->prev = t.prev;
  else newest_ = t.prev;
  t.prev = t.next = nullptr;
}

}  // namespace fabric
