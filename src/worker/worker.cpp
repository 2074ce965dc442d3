// Worker loop: requests first (the first WRITE of a new transfer is posted at once), then keep the
// NICs busy from pending work, then poll completions, aggregate them per transfer across NICs,
// and hand results to the callback thread. Nothing here takes a lock.
#include "worker/worker.h"

#include <pthread.h>
#include <sched.h>

#include <cstring>

#include "util/idle.h"
#include "util/log.h"
#include "worker/sharding.h"

namespace fabric {

namespace {
enum OpKind : uint32_t { kOpWrite = 1, kOpSend = 2, kOpRecv = 3 };

std::string peer_key(const NetAddr& a) {
  std::string key = a.local();
  for (size_t i = 0; i < a.nic_count(); i++) {
    key += std::to_string(a.nic(i).size());
    key += ':';
    key += a.nic(i);
  }
  return key;
}
}  // namespace

struct Worker::RecvPool {
  std::vector<uint8_t> buffer;
  size_t len = 0;
  DomainRegion region;
  std::vector<OpContext> contexts;
  std::shared_ptr<TransferEngine::RecvCallback> on_recv;
};

Worker::Worker(const EngineConfig& config, MrTable& mrs, CallbackThread& callbacks)
    : config_(config),
      mrs_(mrs),
      callbacks_(callbacks),
      requests_(config.request_queue_capacity),
      stats_(std::make_unique<AtomicNicStats[]>(kMaxDomains)) {
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

void Worker::stop() {
  if (thread_.joinable()) {
    submit(StopRequest{});
    thread_.join();
  }
}

void Worker::submit(Request&& request) {
  while (!requests_.try_push(request)) std::this_thread::yield();
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
    open_domains();  // after pinning, so NIC state lands on this core's NUMA node
  } catch (...) {
    domains_.clear();
    opened.set_exception(std::current_exception());
    return;
  }
  opened.set_value();
  loop();
  shutdown();
}

void Worker::open_domains() {
  if (config_.nics.empty() || config_.nics.size() > kMaxNics)
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("an engine needs 1 to {} NICs, the configuration has {}", kMaxNics,
                            config_.nics.size()));
  for (size_t i = 0; i < config_.nics.size(); i++) {
    domains_.push_back(open_domain(config_, i));
    nic_addresses_.push_back(domains_.back()->address());
  }
  provider_ = domains_[0]->provider_name();
  if (config_.cuda_ipc) {
    domains_.push_back(open_local_domain(config_));
    local_address_ = domains_.back()->address();
  }
  for (size_t i = 0; i < domains_.size(); i++) {
    size_t limit = domains_[i]->max_in_flight();
    max_in_flight_[i] = limit ? limit : config_.max_in_flight_per_nic;
  }
  completions_.resize(config_.cq_batch);

  // Send buffers: a copy of each message waits here until its SEND completes.
  send_buffer_.resize(config_.send_slots * config_.max_message_size);
  send_region_ = domains_[0]->register_memory(send_buffer_.data(), send_buffer_.size(), Device::host());
  for (size_t s = config_.send_slots; s-- > 0;) free_send_slots_.push_back(static_cast<uint32_t>(s));
}

void Worker::loop() {
  util::Idle idle(config_.worker_poll, config_.idle_sleep);
  uint32_t rounds = 0;
  while (!stopping_) {
    bool busy = take_requests();
    busy |= post_pending();
    busy |= poll_domains();
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
  for (int i = 0; i < 64 && !stopping_; i++) {
    std::optional<Request> r = requests_.try_pop();
    if (!r) break;
    any = true;
    std::visit([this](auto&& req) { handle(std::move(req)); }, std::move(*r));
  }
  return any;
}

ResolvedTarget Worker::resolve(const NetAddr& peer) {
  std::string key = peer_key(peer);
  auto it = peers_.find(key);
  if (it != peers_.end()) return it->second;
  ResolvedTarget t;
  for (size_t i = 0; i < nic_count(); i++) t.peer[i] = domains_[i]->insert_peer(peer.nic(i));
  if (has_local() && !peer.local().empty() &&
      local_scope(peer.local()) == local_scope(local_address_)) {
    t.peer[nic_count()] = domains_[nic_count()]->insert_peer(peer.local());
    t.local = true;
  }
  peers_.emplace(std::move(key), t);
  return t;
}

ResolvedTarget Worker::route(const NetAddr& owner, const MrDesc& d) {
  ResolvedTarget t = resolve(owner);
  if (t.local && d.local_key()) {
    t.key[nic_count()] = *d.local_key();
    return t;
  }
  t.local = false;
  if (d.keys().empty())
    throw Error(ErrorCode::kUnsupported,
                "the destination region has no NIC keys (its owner's NICs cannot reach that memory) "
                "and is not reachable through cuda_ipc from this engine");
  for (size_t i = 0; i < d.keys().size(); i++) t.key[i] = d.keys()[i];
  return t;
}

void Worker::handle(TransferRequest&& r) {
  Transfer& t = *transfers_.acquire();
  t.req = std::move(r);
  link(t);
  const size_t nics = nic_count();
  const TransferRequest& q = t.req;
  try {
    if (q.kind != TransferKind::kSend && q.kind != TransferKind::kBarrier) {
      t.src = mrs_.find(q.src);
      if (!t.src)
        throw Error(ErrorCode::kNotFound, "source region was deregistered before the transfer ran");
    }
    switch (q.kind) {
      case TransferKind::kSingle:
        t.targets.push_back(route(q.dst.owner(), q.dst));
        t.total_ops = static_cast<uint32_t>(single_write_shards(q.len, nics, q.pinned_nic >= 0));
        break;
      case TransferKind::kPaged:
        t.targets.push_back(route(q.dst.owner(), q.dst));
        t.total_ops = static_cast<uint32_t>(q.src_pages.indices.size());
        break;
      case TransferKind::kScatter:
        for (auto& d : q.scatter) t.targets.push_back(route(d.dst.owner(), d.dst));
        t.total_ops = static_cast<uint32_t>(q.scatter.size());
        break;
      case TransferKind::kBarrier:
        for (auto& d : q.barrier) t.targets.push_back(route(d.owner(), d));
        t.total_ops = static_cast<uint32_t>(q.barrier.size());
        break;
      case TransferKind::kSend:
        t.targets.push_back(resolve(q.send_dst));
        t.total_ops = 1;
        break;
    }
  } catch (const Error& e) {
    fail(t, e.status());
    maybe_finish(t);
    return;
  }
  if (!pump(t)) {
    t.queued = true;
    pending_.push_back(&t);
  }
  maybe_finish(t);
}

bool Worker::pump(Transfer& t) {
  while (t.next_op < t.total_ops && !t.failed) {
    if (!post_next(t)) return false;
  }
  return true;
}

// Builds and posts WRITE (or SEND) number t.next_op. Returns false on back-pressure.
bool Worker::post_next(Transfer& t) {
  const TransferRequest& q = t.req;
  const uint32_t i = t.next_op;
  const bool per_destination = q.kind == TransferKind::kScatter || q.kind == TransferKind::kBarrier;
  const ResolvedTarget* target = per_destination ? &t.targets[i] : &t.targets[0];
  // Same-host GPU peers take the local domain (sharded writes keep their shard count, so the
  // receiver's immediate count does not depend on the route); others NIC by NIC.
  size_t nic = q.kind == TransferKind::kSend ? 0
               : target->local             ? nic_count()
                                           : nic_for_op(i, nic_count(), q.pinned_nic);
  // The NIC pushed back or is full: wait for its completions.
  if (backoff_[nic] > 0 || in_flight_[nic] >= max_in_flight_[nic]) return false;
  Domain& d = *domains_[nic];
  OpContext* ctx = contexts_.acquire();
  ctx->owner = &t;
  ctx->nic = static_cast<uint32_t>(nic);

  PostResult result;
  if (q.kind == TransferKind::kSend) {
    if (t.send_slot == UINT32_MAX) {
      if (free_send_slots_.empty()) {
        contexts_.release(ctx);
        return false;
      }
      t.send_slot = free_send_slots_.back();
      free_send_slots_.pop_back();
      std::memcpy(&send_buffer_[t.send_slot * config_.max_message_size], q.payload.data(),
                  q.payload.size());
    }
    ctx->kind = kOpSend;
    result = domains_[0]->post_send(t.targets[0].peer[0],
                                    &send_buffer_[t.send_slot * config_.max_message_size],
                                    q.payload.size(), send_region_.desc, ctx);
  } else {
    WriteOp op;
    op.has_imm = q.has_imm;
    op.imm = q.imm;
    uint64_t src_off = 0, dst_off = 0;
    switch (q.kind) {
      case TransferKind::kSingle: {
        Shard s = single_write_shard(q.len, t.total_ops, i);
        src_off = q.src_offset + s.offset;
        dst_off = q.dst_offset + s.offset;
        op.len = s.len;
        break;
      }
      case TransferKind::kPaged:
        src_off = q.src_pages.offset + q.src_pages.stride * q.src_pages.indices[i];
        dst_off = q.dst_pages.offset + q.dst_pages.stride * q.dst_pages.indices[i];
        op.len = q.len;
        break;
      case TransferKind::kScatter:
        src_off = q.scatter[i].src_offset;
        dst_off = q.scatter[i].dst_offset;
        op.len = q.scatter[i].len;
        break;
      default:  // barrier: immediate only
        break;
    }
    if (q.kind == TransferKind::kBarrier) {
      op.src = d.scratch_buffer();
      op.desc = d.scratch_desc();  // EFA wants a valid descriptor even on zero-byte writes
    } else {
      op.src = t.src->ptr + src_off;
      op.desc = t.src->per_nic[nic].desc;
    }
    op.peer = target->peer[nic];
    op.rkey = target->key[nic].rkey;
    op.remote_addr = target->key[nic].base + dst_off;
    ctx->kind = kOpWrite;
    ctx->aux = op.len;
    result = d.post_write(op, ctx);
  }

  if (result == PostResult::kRetry || result == PostResult::kRetryPeer) {
    // Retrying at once would only take the provider's locks again (shm shares one with the
    // peer): skip this NIC until it completes something or a few polls have passed.
    backoff_[nic] = kRetryBackoffPolls;
    contexts_.release(ctx);
    return false;
  }
  if (result == PostResult::kFailed) {
    contexts_.release(ctx);
    stats_[nic].errors.fetch_add(1, std::memory_order_relaxed);
    fail(t, Status(ErrorCode::kProvider, domains_[nic]->last_error()));
    return true;
  }
  t.next_op++;
  t.outstanding++;
  t.outstanding_on[nic]++;
  in_flight_[nic]++;
  if (config_.record_post_timings) record_post_timing(t);
  return true;
}

bool Worker::post_pending() {
  bool any = false;
  size_t n = pending_.size();
  for (size_t k = 0; k < n; k++) {
    Transfer* t = pending_.front();
    pending_.pop_front();
    uint32_t before = t->next_op;
    bool done = t->failed || pump(*t);
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
  bool any = false;
  for (size_t nic = 0; nic < domains_.size(); nic++) {
    size_t n = domains_[nic]->poll(completions_);
    for (size_t i = 0; i < n; i++) on_completion(nic, completions_[i]);
    any |= n > 0;
    if (n > 0) {
      backoff_[nic] = 0;
    } else if (backoff_[nic] > 0) {
      backoff_[nic]--;
    }
  }
  return any;
}

void Worker::on_completion(size_t nic, Completion& c) {
  AtomicNicStats& st = stats_[nic];
  switch (c.kind) {
    case Completion::Kind::kRemoteImm:
      st.imms_received.fetch_add(1, std::memory_order_relaxed);
      imms_.arrive(c.imm, met_);
      for (auto& w : met_) report(w, Status::ok_status());
      met_.clear();
      return;
    case Completion::Kind::kRecv: {
      auto* pool = static_cast<RecvPool*>(c.context->owner);
      uint8_t* buf = pool->buffer.data() + c.context->aux * pool->len;
      st.messages_received.fetch_add(1, std::memory_order_relaxed);
      Event e;
      e.on_recv = pool->on_recv;
      e.data.assign(reinterpret_cast<std::byte*>(buf), reinterpret_cast<std::byte*>(buf) + c.len);
      callbacks_.push(std::move(e), overflow_);
      repost_recv(nic, c.context);  // the bytes were copied: the buffer goes straight back
      return;
    }
    case Completion::Kind::kError:
      st.errors.fetch_add(1, std::memory_order_relaxed);
      if (!c.context) {  // not ours (e.g. a peer's connection failed): nothing to end
        log::warn("nic {}: {}", nic, c.error);
        return;
      }
      if (c.context->kind == kOpRecv) {  // a failed receive still owns its buffer: post it again
        log::warn("nic {}: receive failed: {}", nic, c.error);
        repost_recv(nic, c.context);
        return;
      }
      [[fallthrough]];
    case Completion::Kind::kLocal: {
      OpContext* ctx = c.context;
      auto* t = static_cast<Transfer*>(ctx->owner);
      if (c.kind == Completion::Kind::kLocal) {
        if (ctx->kind == kOpWrite) {
          st.writes_posted.fetch_add(1, std::memory_order_relaxed);
          st.bytes_written.fetch_add(ctx->aux, std::memory_order_relaxed);
        } else {
          st.sends_posted.fetch_add(1, std::memory_order_relaxed);
        }
      } else {
        fail(*t, Status(ErrorCode::kProvider, c.error));
      }
      // Reported with this WRITE outstanding means timed out: its budget was released then.
      const uint32_t op_domain = ctx->nic;  // read before the context goes back to the pool
      contexts_.release(ctx);
      if (!t->reported) in_flight_[op_domain]--;
      t->outstanding--;
      t->outstanding_on[op_domain]--;
      maybe_finish(*t);
      return;
    }
  }
}

// The submit time is the deadline minus the timeout: no clock read on the submit path.
void Worker::record_post_timing(Transfer& t) {
  if (t.next_op != 1 && t.next_op != t.total_ops) return;
  auto since_submit = Clock::now() - (t.req.deadline - config_.transfer_timeout);
  auto ns = static_cast<uint64_t>(std::chrono::nanoseconds(since_submit).count());
  if (t.next_op == 1) t.first_post_ns = ns;
  if (t.next_op != t.total_ops) return;
  if (post_timings_.size() >= 65536) post_timings_.erase(post_timings_.begin());
  post_timings_.push_back({t.first_post_ns, ns, t.total_ops});
}

void Worker::repost_recv(size_t nic, OpContext* ctx) {
  auto* pool = static_cast<RecvPool*>(ctx->owner);
  uint8_t* buf = pool->buffer.data() + ctx->aux * pool->len;
  if (domains_[nic]->post_recv(buf, pool->len, pool->region.desc, ctx) != PostResult::kPosted)
    log::error("re-posting a receive buffer failed: {}", domains_[nic]->last_error());
}

void Worker::fail(Transfer& t, Status status) {
  if (!t.failed) {
    t.failed = true;
    t.error = std::move(status);
  }
}

void Worker::maybe_finish(Transfer& t) {
  bool all_posted = t.failed || t.next_op == t.total_ops;
  if (!t.reported && all_posted && t.outstanding == 0) {
    t.reported = true;
    unlink(t);
    report(t.req.on_done, t.failed ? t.error : Status::ok_status());
  }
  if (t.reported && t.outstanding == 0 && !t.queued) {
    if (t.send_slot != UINT32_MAX) free_send_slots_.push_back(t.send_slot);
    transfers_.release(&t);
  }
}

void Worker::report(OnDone& on_done, Status status) {
  if (!status.ok() && on_done.kind() != OnDone::Kind::kCallback)
    log::warn("transfer failed: {}", status.message());
  switch (on_done.kind()) {
    case OnDone::Kind::kNone:
      break;
    case OnDone::Kind::kFlag:
      on_done.flag_ptr()->store(status.ok() ? kDoneSucceeded : kDoneFailed,
                                std::memory_order_release);
      on_done.flag_ptr()->notify_all();  // callers may block with std::atomic::wait
      break;
    case OnDone::Kind::kCounter:
      if (status.ok()) {
        on_done.done_counter()->fetch_add(1, std::memory_order_release);
        on_done.done_counter()->notify_all();
      } else if (on_done.failed_counter()) {
        on_done.failed_counter()->fetch_add(1, std::memory_order_release);
        on_done.failed_counter()->notify_all();
      }
      break;
    case OnDone::Kind::kCallback: {
      Event e;
      e.done = std::move(on_done.callback_fn());
      e.status = std::move(status);
      callbacks_.push(std::move(e), overflow_);
      break;
    }
  }
}

// Transfers are linked in submission order and share one timeout, so the oldest expires first.
void Worker::check_deadlines() {
  if (!oldest_) return;
  Clock::time_point now = Clock::now();
  while (oldest_ && oldest_->req.deadline <= now) {
    Transfer& t = *oldest_;
    fail(t, Status(ErrorCode::kTimeout,
                   fmt::format("transfer not completed after {} ms ({} of {} WRITEs posted, {} "
                               "outstanding): is the peer alive? (EngineConfig::transfer_timeout)",
                               config_.transfer_timeout.count(), t.next_op, t.total_ops,
                               t.outstanding)));
    t.reported = true;
    unlink(t);
    report(t.req.on_done, t.error);
    // Outstanding WRITEs keep their context; the transfer is freed when they complete or at
    // shutdown. They stop counting against the in-flight limits: a completion that never comes
    // (a stuck operation) must not take a NIC's budget for good.
    for (size_t d = 0; d < domains_.size(); d++) in_flight_[d] -= t.outstanding_on[d];
  }
}

void Worker::handle(ExpectRequest&& r) {
  imms_.expect(r.imm, r.count, std::move(r.on_done), met_);
  for (auto& w : met_) report(w, Status::ok_status());
  met_.clear();
}

void Worker::handle(RecvPoolRequest&& r) {
  auto pool = std::make_unique<RecvPool>();
  pool->len = r.len;
  pool->buffer.resize(r.len * r.count);
  pool->on_recv = std::move(r.on_recv);
  pool->region = domains_[0]->register_memory(pool->buffer.data(), pool->buffer.size(), Device::host());
  pool->contexts.resize(r.count);
  for (size_t i = 0; i < r.count; i++) {
    OpContext& ctx = pool->contexts[i];
    ctx.owner = pool.get();
    ctx.kind = kOpRecv;
    ctx.aux = i;
    PostResult res;
    while ((res = domains_[0]->post_recv(pool->buffer.data() + i * r.len, r.len, pool->region.desc,
                                         &ctx)) == PostResult::kRetry)
      poll_domains();
    if (res == PostResult::kFailed)
      log::error("posting receive buffer {} of {} failed: {}", i, r.count, domains_[0]->last_error());
  }
  recv_pools_.push_back(std::move(pool));
}

DomainRegion Worker::register_on(size_t nic, void* ptr, size_t len, Device device) {
  return domains_[nic]->register_memory(ptr, len, device);
}

void Worker::deregister_on(size_t nic, DomainRegion& region) {
  domains_[nic]->deregister_memory(region);
}

size_t Worker::fail_transfers_from(const RegionSlot* src) {
  size_t outstanding = 0;
  for (Transfer* t = oldest_; t;) {
    Transfer* next = t->next;  // maybe_finish may unlink and free t
    if (t->src == src) {
      fail(*t, Status(ErrorCode::kNotFound,
                      fmt::format("the source region was deregistered while this transfer was in "
                                  "flight ({} of {} WRITEs posted)",
                                  t->next_op, t->total_ops)));
      outstanding += t->outstanding;
      maybe_finish(*t);
    }
    t = next;
  }
  return outstanding;
}

void Worker::shutdown() {
  Status stopped(ErrorCode::kShutdown, "the engine was shut down before this finished");
  while (oldest_) {
    Transfer& t = *oldest_;
    t.reported = true;
    unlink(t);
    report(t.req.on_done, stopped);
  }
  for (auto& w : imms_.take_all_waiting()) report(w, stopped);
  // Requests that raced with the stop request.
  while (auto r = requests_.try_pop()) {
    if (auto* t = std::get_if<TransferRequest>(&*r)) report(t->on_done, stopped);
    if (auto* e = std::get_if<ExpectRequest>(&*r)) report(e->on_done, stopped);
    if (auto* c = std::get_if<ControlRequest>(&*r)) c->run();
  }
  while (!callbacks_.flush(overflow_)) std::this_thread::yield();
  for (uint32_t s = 0; s < mrs_.capacity(); s++) {
    RegionSlot& slot = mrs_.slot(s);
    if ((slot.generation.load(std::memory_order_relaxed) & 1) == 0) continue;
    for (size_t nic = 0; nic < domains_.size(); nic++) domains_[nic]->deregister_memory(slot.per_nic[nic]);
    slot.generation.fetch_add(1, std::memory_order_release);
  }
  for (auto& pool : recv_pools_) domains_[0]->deregister_memory(pool->region);
  domains_[0]->deregister_memory(send_region_);
  domains_.clear();  // closes endpoints: nothing refers to our contexts any more
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
