// Worker loop: requests first (the first WRITE of a new transfer is posted at once), then keep the
// NICs busy from pending work, then poll completions, aggregate them per transfer across NICs,
// and hand results to the callback thread. Nothing here takes a lock.
#include "worker/worker.h"

#include <pthread.h>
#include <sched.h>

#include <cstring>

#include "util/idle.h"
#include "util/log.h"

namespace fabric {

namespace {
enum OpKind : uint32_t { kOpWrite = 1, kOpSend = 2, kOpRecv = 3 };

// Scatters and barriers have one destination per WRITE; the other kinds one in all.
bool per_destination(TransferKind k) {
  return k == TransferKind::kScatter || k == TransferKind::kBarrier ||
         k == TransferKind::kGroupScatter || k == TransferKind::kGroupBarrier;
}
bool grouped(TransferKind k) { return k == TransferKind::kGroupScatter || k == TransferKind::kGroupBarrier; }
bool reads_source(TransferKind k) {
  return k != TransferKind::kSend && k != TransferKind::kBarrier && k != TransferKind::kGroupBarrier;
}
}  // namespace

struct Worker::RecvPool {
  std::vector<uint8_t> buffer;
  size_t len = 0;
  DomainRegion region;
  std::vector<OpContext> contexts;
  size_t next_unposted = 0;  // contexts from here on wait for room in the receive queue
  std::shared_ptr<TransferEngine::RecvCallback> on_recv;
};

Worker::Worker(const EngineConfig& config, size_t index, MrTable& mrs, RemoteTable& remotes,
               RequestBufferPool& buffers, CallbackThread& callbacks)
    : config_(config),
      index_(index),
      mrs_(mrs),
      remotes_(remotes),
      buffers_(buffers),
      callbacks_(callbacks),
      requests_(config.request_queue_capacity),
      expectations_(config.max_unexpected_imms, [this](OnDone& d, Status s) { report(d, std::move(s)); }) {
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
                           what, config_.worker_stall_timeout.count(), provider()));
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
    open_send_buffers();
  } catch (...) {
    domains_.close();
    opened.set_exception(std::current_exception());
    return;
  }
  opened.set_value();
  loop();
  shutdown();
  exited_.store(true, std::memory_order_release);
}

// Send buffers: a copy of each message waits here until its SEND completes.
void Worker::open_send_buffers() {
  send_buffer_.resize(config_.send_slots * config_.max_message_size);
  send_region_ = domains_.register_on(DomainGroup::kMessageDomain, send_buffer_.data(),
                                      send_buffer_.size(), Device::host());
  for (size_t s = config_.send_slots; s-- > 0;) free_send_slots_.push_back(static_cast<uint32_t>(s));
}

void Worker::loop() {
  util::Idle idle(config_.worker_poll, config_.idle_sleep);
  uint32_t rounds = 0;
  while (!stopping_) {
    heartbeat_.store(rounds, std::memory_order_relaxed);
    bool busy = take_requests();
    busy |= post_pending();
    busy |= post_recv_backlog();
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
    try {
      std::visit([this](auto&& req) { handle(std::move(req)); }, std::move(*r));
    } catch (const std::exception& e) {  // a bug or a provider throwing: never terminate
      log::error("worker: a request failed unexpectedly: {}", e.what());
    }
  }
  return any;
}

ResolvedTarget Worker::resolve(const NetAddr& peer) {
  auto it = peer_index_.find(peer);
  if (it != peer_index_.end()) return records_[it->second].target;
  ResolvedTarget t = domains_.insert_peer(peer);
  t.record = new_record(peer, t);
  return records_[t.record].target;
}

uint32_t Worker::new_record(const NetAddr& addr, const ResolvedTarget& t) {
  uint32_t r;
  if (!free_records_.empty()) {
    r = free_records_.back();
    free_records_.pop_back();
  } else {
    r = static_cast<uint32_t>(records_.size());
    records_.emplace_back();
  }
  PeerRecord& p = records_[r];
  p.state = PeerRecord::State::kLive;
  p.target = t;
  p.target.record = r;
  p.addr = addr;
  p.holders = p.outstanding = 0;
  peer_index_.emplace(addr, r);
  return r;
}

// The domains forget the peer now; transfers still naming the record see its state at their
// next post (kReleased: re-resolve; kRemoved: fail). The record is reused once none holds it.
void Worker::release_record(uint32_t r) {
  PeerRecord& p = records_[r];
  domains_.remove_peer(p.target);
  auto it = peer_index_.find(p.addr);
  if (it != peer_index_.end() && it->second == r) peer_index_.erase(it);
  if (p.state != PeerRecord::State::kRemoved) p.state = PeerRecord::State::kReleased;
  maybe_free_record(r);
}

void Worker::unhold_record(uint32_t r) {
  PeerRecord& p = records_[r];
  if (p.holders > 0) p.holders--;
  if (p.state != PeerRecord::State::kLive) maybe_free_record(r);  // live: nothing to free
}

void Worker::maybe_free_record(uint32_t r) {
  PeerRecord& p = records_[r];
  bool gone = p.state == PeerRecord::State::kReleased || p.state == PeerRecord::State::kRemoved;
  if (gone && p.holders == 0 && p.outstanding == 0) {
    p.state = PeerRecord::State::kFree;
    p.addr = NetAddr{};
    free_records_.push_back(r);
  }
}

// An operation to the peer failed in a way that says its connection is gone.
void Worker::peer_failed(uint32_t r) {
  PeerRecord& p = records_[r];
  if (p.state != PeerRecord::State::kLive) return;
  p.state = PeerRecord::State::kFailed;
  log::info("a peer's connection failed; its resources go once nothing of it is in flight");
  if (p.outstanding == 0) release_record(r);
}

std::vector<RemoteMr> Worker::remove_peer(const NetAddr& peer) {
  std::vector<RemoteMr> removed;
  auto it = peer_index_.find(peer);
  if (it == peer_index_.end()) return removed;
  uint32_t r = it->second;
  records_[r].state = PeerRecord::State::kRemoved;
  release_record(r);  // first: the record must not be freed while the domains still hold it
  // Its interned regions go with it (a process at the same address later is another peer,
  // with other keys). Groups keep their member, which fails with kCancelled from now on.
  for (uint32_t s = 0; s < remotes_.allocated(); s++) {
    RemoteSlot& slot = remotes_.slot(s);
    uint32_t gen = slot.generation.load(std::memory_order_relaxed);
    if ((gen & 1) && slot.target(index_).record == r) removed.push_back(RemoteMr{s, gen});
  }
  return removed;
}

// A transfer's target whose peer record is no longer live: a released one (its connection
// failed) is resolved afresh, a removed one fails the transfer.
bool Worker::usable(Transfer& t, ResolvedTarget& target, uint32_t op) {
  PeerRecord::State s = records_[target.record].state;
  if (s == PeerRecord::State::kLive || s == PeerRecord::State::kFailed) return true;
  if (s == PeerRecord::State::kRemoved) {
    fail(t, Status(ErrorCode::kCancelled, "the destination peer was removed (remove_peer)"));
    return false;
  }
  try {
    if (t.group) {  // `target` is the member's own: refreshed in place, held by the group
      GroupMember& m = t.group->members[op];
      refresh(m.target, m.desc);
      return true;
    }
    rehold(target, target_of(t.req, per_destination(t.req.kind) ? op : 0));
  } catch (const Error& e) {
    fail(t, e.status());
    return false;
  }
  return true;
}

namespace {
RemoteSlot& live_remote(RemoteTable& table, const RemoteMr& r) {
  RemoteSlot* s = table.live(r);
  if (!s)
    throw Error(ErrorCode::kNotFound,
                "the destination remote region was removed (remove_remote) before the transfer ran");
  return *s;
}
}  // namespace

// Destination i of a scatter or barrier, or the one destination of the other kinds (not for
// group kinds: their targets are the group's).
ResolvedTarget Worker::target_of(const TransferRequest& q, size_t i) {
  switch (q.kind) {
    case TransferKind::kSend: return resolve(q.buf->send_dst);
    case TransferKind::kScatter: return current(q.buf->slices[i].dst.mr);
    case TransferKind::kBarrier: return current(q.buf->remotes[i]);
    default: return current(q.dst);
  }
}

const ResolvedTarget& Worker::current(const RemoteMr& remote) {
  RemoteSlot& slot = live_remote(remotes_, remote);
  return refresh(slot.target(index_), slot.desc);
}

// Moves a hold from the record `held` names to the one `fresh` names.
void Worker::rehold(ResolvedTarget& held, const ResolvedTarget& fresh) {
  records_[fresh.record].holders++;
  uint32_t old = held.record;
  held = fresh;
  unhold_record(old);
}

// A held route whose peer was released (its connection failed) is resolved again, the hold
// moving to the new record; one whose peer was removed cannot be.
const ResolvedTarget& Worker::refresh(ResolvedTarget& held, const MrDesc& desc) {
  PeerRecord::State s = records_[held.record].state;
  if (s == PeerRecord::State::kRemoved)
    throw Error(ErrorCode::kCancelled, "the destination peer was removed (remove_peer)");
  if (s != PeerRecord::State::kLive && s != PeerRecord::State::kFailed) rehold(held, route(desc));
  return held;
}

ResolvedTarget Worker::route(const MrDesc& d) {
  ResolvedTarget t = resolve(d.endpoint());
  t.imm_base = d.imms().base;
  if (t.local && d.local_key()) {
    t.key[domains_.local_index()] = *d.local_key();
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

void Worker::attach_remote(uint32_t s) {
  RemoteSlot& slot = remotes_.slot(s);
  ResolvedTarget& target = slot.target(index_);
  target = route(slot.desc);
  records_[target.record].holders++;
}

void Worker::detach_remote(uint32_t s) {
  ResolvedTarget& target = remotes_.slot(s).target(index_);
  const uint32_t record = target.record;
  target = {};
  if (record != UINT32_MAX) unhold_record(record);
}

uint32_t Worker::add_group(std::span<const RemoteMr> members) {
  auto g = std::make_unique<GroupState>();
  for (const RemoteMr& m : members) {
    RemoteSlot& slot = live_remote(remotes_, m);
    g->members.push_back({refresh(slot.target(index_), slot.desc), slot.desc});
  }
  for (auto& m : g->members) records_[m.target.record].holders++;
  groups_.push_back(std::move(g));
  return static_cast<uint32_t>(groups_.size() - 1);
}

void Worker::handle(TransferRequest&& r) {
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
      if (q.group >= groups_.size()) throw Error(ErrorCode::kNotFound, "unknown peer group");
      t.group = groups_[q.group].get();
    } else {
      size_t destinations = per_destination(q.kind) ? t.total_ops : 1;
      for (size_t i = 0; i < destinations; i++) t.targets.push_back(target_of(q, i));
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
    fail(t, e.status());
  }
  for (auto& target : t.targets) records_[target.record].holders++;
  if (t.failed) {
    maybe_finish(t);
    return;
  }
  // FIFO under back-pressure: while older transfers wait to post, a new one waits behind them
  // (posting it first would let a stream of small writes starve a large pending one). When
  // nothing waits, its first WRITE goes out at once.
  if (!pending_.empty() || !pump(t)) {
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

// Builds and posts WRITE (or SEND, or batch of WRITEs) number t.next_op. Returns false on
// back-pressure.
bool Worker::post_next(Transfer& t) {
  const TransferRequest& q = t.req;
  const uint32_t i = t.next_op;
  ResolvedTarget* target = t.group                   ? &t.group->members[i].target
                           : per_destination(q.kind) ? &t.targets[i]
                                                     : &t.targets[0];
  if (records_[target->record].state != PeerRecord::State::kLive && !usable(t, *target, i))
    return true;  // failed: pump stops
  if (t.src && t.src->generation.load(std::memory_order_relaxed) != q.src.generation) {
    fail(t, Status(ErrorCode::kNotFound, "the source region was deregistered while this transfer "
                                         "was being posted"));
    return true;
  }
  const size_t nic = domains_.domain_for(q, *target, i);
  // The NIC pushed back or is full: wait for its completions.
  if (!domains_.may_post(nic, target->peer[nic])) return false;
  OpContext* ctx = contexts_.acquire();
  ctx->owner = &t;
  ctx->nic = static_cast<uint32_t>(nic);
  ctx->peer = target->record;

  PostResult result;
  if (q.kind == TransferKind::kSend) {
    if (t.send_slot == UINT32_MAX) {
      if (free_send_slots_.empty()) {
        contexts_.release(ctx);
        return false;
      }
      t.send_slot = free_send_slots_.back();
      free_send_slots_.pop_back();
      std::memcpy(&send_buffer_[t.send_slot * config_.max_message_size], q.buf->payload.data(),
                  q.buf->payload.size());
    }
    ctx->kind = kOpSend;
    result = domains_.post_send(nic, target->peer[nic],
                                &send_buffer_[t.send_slot * config_.max_message_size],
                                q.buf->payload.size(), send_region_.desc, ctx);
  } else {
    // The template: where this destination is reached through this NIC.
    WriteOp op;
    op.has_imm = q.has_imm;
    op.imm = target->imm_base + q.imm;  // fits: checked against the range at submit
    op.peer = target->peer[nic];
    op.rkey = target->key[nic].rkey;
    const uint64_t base = target->key[nic].base;
    const RequestBuffer* b = q.buf;
    uint64_t src_off = 0, dst_off = 0;
    switch (q.kind) {
      case TransferKind::kSingle: {
        Shard s = DomainGroup::shard(q.len, t.total_ops, i);
        src_off = q.src_offset + s.offset;
        dst_off = q.dst_offset + s.offset;
        op.len = s.len;
        break;
      }
      case TransferKind::kPaged:
        src_off = q.src_offset + q.src_stride * b->src_pages[i];
        dst_off = q.dst_offset + q.dst_stride * b->dst_pages[i];
        op.len = q.len;
        break;
      case TransferKind::kScatter:
        src_off = b->slices[i].src_offset;
        dst_off = b->slices[i].dst.offset;
        op.len = b->slices[i].len;
        break;
      case TransferKind::kGroupScatter:
        src_off = b->group_slices[i].src_offset;
        dst_off = b->group_slices[i].dst_offset;
        op.len = b->group_slices[i].len;
        break;
      default:  // barriers: immediate only
        break;
    }
    if (!reads_source(q.kind)) {
      op.src = domains_.scratch_buffer(nic);
      op.desc = domains_.scratch_desc(nic);  // EFA wants a valid descriptor even on zero-byte writes
    } else {
      op.src = t.src->ptr + src_off;
      op.desc = t.src->per_nic[nic].desc;
    }
    op.remote_addr = base + dst_off;
    ctx->kind = kOpWrite;
    if (t.batch > 0) {  // pages [i * batch, ...) in one post
      const uint64_t first = uint64_t{i} * t.batch;
      const uint64_t n = std::min<uint64_t>(t.batch, q.count - first);
      batch_ops_.clear();
      for (uint64_t p = first; p < first + n; p++) {
        op.src = t.src->ptr + q.src_offset + q.src_stride * b->src_pages[p];
        op.remote_addr = base + q.dst_offset + q.dst_stride * b->dst_pages[p];
        batch_ops_.push_back(op);
      }
      ctx->aux = n * q.len;
      ctx->writes = static_cast<uint32_t>(n);
      result = domains_.post_write_batch(nic, batch_ops_, ctx);
    } else {
      ctx->aux = op.len;
      result = domains_.post_write(nic, op, ctx);
    }
  }

  // The domain group booked the result (back-off, in-flight count, errors); the transfer and
  // the peer record count what was posted.
  if (result == PostResult::kRetry || result == PostResult::kRetryPeer) {
    contexts_.release(ctx);
    return false;
  }
  if (result == PostResult::kFailed) {
    contexts_.release(ctx);
    fail(t, Status(ErrorCode::kProvider, domains_.last_error(nic)));
    return true;
  }
  t.next_op++;
  t.outstanding++;
  t.outstanding_on[nic]++;
  records_[target->record].outstanding++;
  if (t.src) t.src->writes_in_flight++;
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

// Receive buffers the provider did not take when their pool was added (its receive queue was
// full): offered again every round until taken.
bool Worker::post_recv_backlog() {
  if (recvs_unposted_ == 0) return false;
  bool any = false;
  for (auto& pool : recv_pools_) {
    while (pool->next_unposted < pool->contexts.size()) {
      OpContext& ctx = pool->contexts[pool->next_unposted];
      PostResult res = domains_.post_recv(DomainGroup::kMessageDomain,
                                          pool->buffer.data() + ctx.aux * pool->len, pool->len,
                                          pool->region.desc, &ctx);
      if (res == PostResult::kRetry || res == PostResult::kRetryPeer) return any;
      if (res == PostResult::kFailed)
        log::error("posting receive buffer {} failed: {}", ctx.aux,
                   domains_.last_error(DomainGroup::kMessageDomain));
      pool->next_unposted++;
      recvs_unposted_--;
      any = true;
    }
  }
  return any;
}

bool Worker::poll_domains() {
  return domains_.poll([this](size_t nic, Completion& c) { on_completion(nic, c); });
}

void Worker::on_completion(size_t nic, Completion& c) {
  AtomicNicStats& st = domains_.stats(nic);
  switch (c.kind) {
    case Completion::Kind::kRemoteImm:
      st.imms_received.fetch_add(1, std::memory_order_relaxed);
      if (!expectations_.arrive(c.imm)) {
        st.imms_dropped.fetch_add(1, std::memory_order_relaxed);
        if (!warned_imm_drop_)
          log::warn("immediate {:#x} dropped: {} distinct immediates are already counted with no "
                    "expectation waiting (EngineConfig::max_unexpected_imms); NicStats::imms_dropped "
                    "counts further drops",
                    c.imm, config_.max_unexpected_imms);
        warned_imm_drop_ = true;
      }
      return;
    case Completion::Kind::kRecv: {
      auto* pool = static_cast<RecvPool*>(c.context->owner);
      uint8_t* buf = pool->buffer.data() + c.context->aux * pool->len;
      st.messages_received.fetch_add(1, std::memory_order_relaxed);
      Event e;
      e.on_recv = pool->on_recv;
      e.data = callbacks_.take_buffer();
      e.data->assign(reinterpret_cast<std::byte*>(buf), reinterpret_cast<std::byte*>(buf) + c.len);
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
          st.writes_posted.fetch_add(ctx->writes, std::memory_order_relaxed);
          st.bytes_written.fetch_add(ctx->aux, std::memory_order_relaxed);
        } else {
          st.sends_posted.fetch_add(1, std::memory_order_relaxed);
        }
      } else {
        fail(*t, Status(ErrorCode::kProvider, c.error));
      }
      // Reported with this WRITE outstanding means timed out: its budget was released then.
      const uint32_t op_domain = ctx->nic;  // read before the context goes back to the pool
      const uint32_t record = ctx->peer;
      contexts_.release(ctx);
      if (!t->reported) domains_.completed(op_domain);
      t->outstanding--;
      t->outstanding_on[op_domain]--;
      if (t->src) t->src->writes_in_flight--;
      PeerRecord& p = records_[record];
      p.outstanding--;
      if (c.kind == Completion::Kind::kError && c.peer_lost) peer_failed(record);
      else if (p.state == PeerRecord::State::kFailed && p.outstanding == 0) release_record(record);
      else if (p.state != PeerRecord::State::kLive) maybe_free_record(record);  // a released one may wait for its last completion
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
  if (domains_.post_recv(nic, buf, pool->len, pool->region.desc, ctx) != PostResult::kPosted)
    log::error("re-posting a receive buffer failed: {}", domains_.last_error(nic));
}

void Worker::fail(Transfer& t, Status status) {
  if (!t.failed) {
    t.failed = true;
    t.error = std::move(status);
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
    report(t.req.on_done, t.failed ? t.error : Status::ok_status());
  }
  if (t.reported && t.outstanding == 0 && !t.queued) {
    if (t.send_slot != UINT32_MAX) free_send_slots_.push_back(t.send_slot);
    for (auto& target : t.targets) unhold_record(target.record);
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
  if (!oldest_ && !expectations_.has_deadlines()) return;
  Clock::time_point now = Clock::now();
  expectations_.expire(now);
  while (oldest_ && oldest_->req.deadline <= now) {
    Transfer& t = *oldest_;
    // shm does not recover from a peer that died with operations in flight (measured: even
    // writes to live peers stop completing), so say what to do about it.
    const char* hint = provider() == "shm" ? "; with shm, a peer that died with WRITEs in flight "
                                             "can leave this endpoint unable to complete large "
                                             "writes: restart this process"
                                           : "";
    fail(t, Status(ErrorCode::kTimeout,
                   fmt::format("transfer not completed after {} ms ({} of {} WRITEs posted, {} "
                               "outstanding): is the peer alive? (EngineConfig::transfer_timeout){}",
                               config_.transfer_timeout.count(), t.next_op, t.total_ops,
                               t.outstanding, hint)));
    t.reported = true;
    unlink(t);
    report(t.req.on_done, t.error);
    // The peer it waited for is unreachable (its connection never came up, or its WRITEs never
    // complete): release it once nothing of it is in flight, so a restarted peer is met afresh.
    // Per-destination transfers post in order: the one it stopped at is the one to blame.
    size_t destinations = t.group ? t.group->members.size() : t.targets.size();
    if (destinations > 0) {
      size_t blocker = per_destination(t.req.kind) ? std::min<size_t>(t.next_op, destinations - 1) : 0;
      peer_failed(t.group ? t.group->members[blocker].target.record : t.targets[blocker].record);
    }
    // Outstanding WRITEs keep their context; the transfer is freed when they complete or at
    // shutdown. They stop counting against the in-flight limits.
    domains_.forget_in_flight(t.outstanding_on);
  }
}

void Worker::add_recv_pool(size_t len, size_t count,
                           std::shared_ptr<TransferEngine::RecvCallback> on_recv) {
  auto pool = std::make_unique<RecvPool>();
  pool->len = len;
  pool->buffer.resize(len * count);  // the engine checked len * count for overflow
  pool->on_recv = std::move(on_recv);
  pool->region = domains_.register_on(DomainGroup::kMessageDomain, pool->buffer.data(),
                                     pool->buffer.size(), Device::host());
  pool->contexts.resize(count);
  for (size_t i = 0; i < count; i++) {
    OpContext& ctx = pool->contexts[i];
    ctx.owner = pool.get();
    ctx.kind = kOpRecv;
    ctx.aux = i;
  }
  recvs_unposted_ += count;
  callbacks_.prepare_buffers(count, len);  // one copy per buffer can be queued without allocating
  recv_pools_.push_back(std::move(pool));
  post_recv_backlog();  // what the provider takes now; the rest as it frees room
}

size_t Worker::fail_transfers_from(const RegionSlot* src) {
  for (Transfer* t = oldest_; t;) {
    Transfer* next = t->next;  // maybe_finish may unlink and free t
    if (t->src == src) {
      fail(*t, Status(ErrorCode::kNotFound,
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
  for (uint32_t s = 0; s < mrs_.capacity(); s++) {
    RegionSlot& slot = mrs_.slot(s);
    // Only this worker's regions: the others' belong to domains this thread must not touch.
    const bool live = (slot.generation.load(std::memory_order_relaxed) & 1) == 1;
    if (!live || slot.worker.load(std::memory_order_relaxed) != index_) continue;
    domains_.deregister_region(slot.per_nic);
    heartbeat_.fetch_add(1, std::memory_order_relaxed);
    slot.generation.fetch_add(1, std::memory_order_release);
  }
  for (auto& pool : recv_pools_) domains_.deregister_on(DomainGroup::kMessageDomain, pool->region);
  domains_.deregister_on(DomainGroup::kMessageDomain, send_region_);
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
