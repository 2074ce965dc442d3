// TransferEngine and EngineImpl: submit-time validation (handles, bounds, NIC counts, peers), then
// a request to the worker. Every error found here is thrown, with what to do about it.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "engine/engine_impl.h"
#include "util/log.h"
#include "worker/sharding.h"

namespace fabric {

namespace {

bool in_bounds(uint64_t offset, uint64_t len, uint64_t region_len) {
  return offset <= region_len && len <= region_len - offset;
}

__extension__ typedef unsigned __int128 u128;

// Highest byte (exclusive) touched by a page list, in 128 bits so nothing overflows.
u128 pages_end(const Pages& p, uint64_t page_len) {
  uint32_t max_index = *std::max_element(p.indices.begin(), p.indices.end());
  return static_cast<u128>(p.offset) +
         static_cast<u128>(p.stride) * max_index + page_len;
}

std::string addr_key(const NetAddr& a) {
  auto b = a.to_bytes();
  return std::string(b.begin(), b.end());
}

}  // namespace

EngineImpl::EngineImpl(EngineConfig config)
    : config_(std::move(config)),
      mrs_owner_(std::make_unique<MrTable>(config_.max_regions)),
      mrs_(*mrs_owner_) {
  if (config_.nics.empty() || config_.nics.size() > kMaxNics)
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("EngineConfig::nics must list 1 to {} NICs, it lists {}", kMaxNics,
                            config_.nics.size()));
  callbacks_ = std::make_unique<CallbackThread>(config_.event_queue_capacity, config_.callback_poll);
  try {
    worker_ = std::make_unique<Worker>(config_, mrs_, *callbacks_);
  } catch (...) {
    callbacks_->stop();
    callbacks_.reset();
    throw;
  }
  address_ = NetAddr(worker_->provider(), worker_->nic_addresses(), worker_->local_address());
}

EngineImpl::~EngineImpl() {
  signals_.reset();  // watcher callbacks may submit: stop them while the engine still works
  // From here on every call throws kShutdown, callbacks of the failed transfers included (they
  // run below, after the worker is gone but before its object is).
  closing_.store(true, std::memory_order_release);
  // Fails what is pending (events queued), closes NICs, joins.
  bool joined = worker_->stop();
  callbacks_->stop();
  if (!joined) {
    // Wedged inside its provider: the worker may still wake up and touch its own object, the
    // region table and the callback queue, so all three are left behind (a leak, not a crash).
    callbacks_->join();
    (void)callbacks_.release();
    (void)mrs_owner_.release();
    (void)worker_.release();
    return;
  }
  callbacks_.reset();  // runs every queued callback, joins
  worker_.reset();
}

void EngineImpl::check_open() const {
  if (closing_.load(std::memory_order_acquire))
    throw Error(ErrorCode::kShutdown, "the engine is shutting down (called from a completion callback "
                                      "during its destruction?)");
}

std::pair<MrHandle, MrDesc> EngineImpl::reg_mr(void* ptr, size_t len, Device device) {
  check_open();
  if (!ptr || len == 0)
    throw Error(ErrorCode::kInvalidArgument, "reg_mr: pointer must be non-null and length > 0");
  std::lock_guard lock(control_mu_);
  return worker_->call([&]() -> std::pair<MrHandle, MrDesc> {
    auto s = mrs_.take_free_slot();
    if (!s)
      throw Error(ErrorCode::kResourceExhausted,
                  fmt::format("reg_mr: all {} region slots are in use; deregister regions or raise "
                              "EngineConfig::max_regions",
                              mrs_.capacity()));
    RegionSlot& slot = mrs_.slot(*s);
    // Every domain registers the region. A NIC provider that cannot reach GPU memory is skipped
    // when the local domain can serve it: the region is then writable by same-host peers only.
    std::string nic_refusal;
    size_t done = 0;
    try {
      for (; done < worker_->domain_count(); done++) {
        try {
          slot.per_nic[done] = worker_->register_on(done, ptr, len, device);
        } catch (const Error& e) {
          if (e.code() != ErrorCode::kUnsupported || done >= nic_count() || !worker_->has_local())
            throw;
          nic_refusal = e.what();
          slot.per_nic[done] = {};
        }
      }
    } catch (...) {
      while (done-- > 0) worker_->deregister_on(done, slot.per_nic[done]);
      mrs_.return_slot(*s);
      throw;
    }
    if (!nic_refusal.empty())
      log::info("reg_mr: {}; the region is reachable through cuda_ipc only", nic_refusal);
    slot.ptr = static_cast<uint8_t*>(ptr);
    slot.len = len;
    slot.device = device;
    slot.on_nics = nic_refusal.empty();
    uint32_t gen = slot.generation.fetch_add(1, std::memory_order_release) + 1;  // now odd: live
    std::vector<RemoteKey> keys;
    if (nic_refusal.empty())
      for (size_t i = 0; i < nic_count(); i++) keys.push_back(slot.per_nic[i].remote);
    std::optional<RemoteKey> local_key;
    if (worker_->has_local() && slot.per_nic[nic_count()].remote_access)
      local_key = slot.per_nic[nic_count()].remote;
    return {MrHandle{*s, gen},
            MrDesc(address_, reinterpret_cast<uint64_t>(ptr), len, keys, local_key)};
  });
}

void EngineImpl::dereg_mr(MrHandle handle) {
  check_open();
  std::lock_guard lock(control_mu_);
  source(handle);  // throws for an unknown or stale handle
  RegionSlot* slot = &mrs_.slot(handle.slot);
  // One step on the worker: the handle turns stale (no transfer taken from now on reads the
  // region, and one being posted stops at its next WRITE), and the transfers reading it fail,
  // each reported once. The slot is not reused until the end, so nothing can read another
  // region's bytes through it.
  size_t in_flight = worker_->call([&] {
    if (slot->generation.load(std::memory_order_relaxed) != handle.generation)
      throw Error(ErrorCode::kNotFound, "dereg_mr: the region was deregistered meanwhile");
    slot->generation.fetch_add(1, std::memory_order_release);  // even: stale from now on
    return worker_->fail_transfers_from(slot);
  });
  // WRITEs already handed to a NIC may still be reading the memory: the region stays registered
  // until they complete (at most the transfer timeout: a WRITE that never completes is
  // abandoned there too).
  auto deadline = std::chrono::steady_clock::now() + config_.transfer_timeout;
  while (in_flight > 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::microseconds(200));
    in_flight = worker_->call([&] { return worker_->fail_transfers_from(slot); });
  }
  worker_->call([&] {
    for (size_t i = 0; i < worker_->domain_count(); i++) worker_->deregister_on(i, slot->per_nic[i]);
    mrs_.return_slot(handle.slot);
  });
}

const RegionSlot& EngineImpl::source(const MrHandle& h) const {
  const RegionSlot* s = mrs_.find(h);
  if (!s)
    throw Error(ErrorCode::kNotFound,
                fmt::format("unknown or deregistered MrHandle (slot {}, generation {}): use the "
                            "handle returned by reg_mr, and not after dereg_mr",
                            h.slot, h.generation));
  return *s;
}

void EngineImpl::check_peer(const NetAddr& peer, const char* what) const {
  if (peer.nic_count() != nic_count())
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("{}: the peer has {} NICs and this engine {}; every peer must use the "
                            "same number of NICs per GPU (rail-aligned)",
                            what, peer.nic_count(), nic_count()));
  if (peer.provider() != address_.provider())
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("{}: the peer uses provider '{}' and this engine '{}'", what,
                            peer.provider(), address_.provider()));
}

void EngineImpl::check_dst(const MrDesc& dst, uint64_t offset, uint64_t len, const char* what) const {
  check_peer(dst.owner(), what);
  if (dst.keys().empty() && !reachable_locally(dst))
    throw Error(ErrorCode::kUnsupported,
                fmt::format("{}: the destination region has no NIC keys (its owner's NIC provider "
                            "cannot reach that memory) and this engine cannot reach it through "
                            "cuda_ipc (needs EngineConfig::cuda_ipc on both engines, one host)",
                            what));
  if (!in_bounds(offset, len, dst.len()))
    throw Error(ErrorCode::kOutOfBounds,
                fmt::format("{}: destination [{}, {}+{}) is outside the remote region of {} bytes",
                            what, offset, offset, len, dst.len()));
}

void EngineImpl::check_route(const RegionSlot& src, const MrDesc& dst, const char* what) const {
  if (!src.on_nics && !reachable_locally(dst))
    throw Error(ErrorCode::kUnsupported,
                fmt::format("{}: the source is GPU memory that this engine's NICs cannot read, and "
                            "the destination is not reachable through cuda_ipc",
                            what));
}

bool EngineImpl::reachable_locally(const MrDesc& dst) const {
  const std::string& ours = address_.local();
  return !ours.empty() && dst.local_key() &&
         local_scope(dst.owner().local()) == local_scope(ours);
}

void EngineImpl::check_group_member(std::optional<PeerGroupHandle> group, const NetAddr& peer) const {
  if (!group) return;
  const PeerGroup* g = group->id < kMaxGroups ? groups_[group->id].load(std::memory_order_acquire)
                                              : nullptr;
  if (!g) throw Error(ErrorCode::kNotFound, fmt::format("unknown peer group {}", group->id));
  if (!g->members.count(addr_key(peer)))
    throw Error(ErrorCode::kInvalidArgument,
                "a destination's owner is not a member of the given peer group; add it to the "
                "group or pass no group");
}

TransferRequest EngineImpl::make_request(TransferKind kind, OnDone on_done,
                                         const WriteOptions& opts) const {
  if (opts.nic && *opts.nic >= nic_count())
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("WriteOptions::nic {} but this engine has {} NICs", *opts.nic, nic_count()));
  TransferRequest r;
  r.kind = kind;
  r.on_done = std::move(on_done);
  r.has_imm = opts.imm.has_value();
  r.imm = opts.imm.value_or(0);
  r.pinned_nic = opts.nic ? *opts.nic : -1;
  r.deadline = Clock::now() + config_.transfer_timeout;
  return r;
}

void EngineImpl::send(const NetAddr& dst, std::span<const std::byte> bytes, OnDone on_done) {
  check_open();
  check_peer(dst, "submit_send");
  if (bytes.size() > config_.max_message_size)
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("submit_send: message of {} bytes exceeds EngineConfig::max_message_size "
                            "({}); use a WRITE for bulk data or raise the limit",
                            bytes.size(), config_.max_message_size));
  TransferRequest r = make_request(TransferKind::kSend, std::move(on_done), {});
  r.send_dst = dst;
  r.payload.assign(bytes.begin(), bytes.end());
  worker_->submit(std::move(r));
}

void EngineImpl::recvs(size_t len, size_t count, TransferEngine::RecvCallback on_recv) {
  check_open();
  if (len == 0 || count == 0 || !on_recv)
    throw Error(ErrorCode::kInvalidArgument,
                "submit_recvs: needs len > 0, count > 0 and a callback");
  constexpr size_t kMaxPoolBytes = size_t{1} << 34;  // 16 GiB of receive buffers is a mistake
  if (len > kMaxPoolBytes / count)
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("submit_recvs: {} buffers of {} bytes exceed the 16 GiB a receive pool "
                            "may hold; messages are at most EngineConfig::max_message_size ({})",
                            count, len, config_.max_message_size));
  auto cb = std::make_shared<TransferEngine::RecvCallback>(std::move(on_recv));
  // Registration runs on the worker; its errors reach the caller here.
  worker_->call([&] { worker_->add_recv_pool(len, count, std::move(cb)); });
}

ImmExpectation EngineImpl::expect(uint32_t imm, uint64_t count, OnDone on_done,
                                  const ExpectOptions& opts) {
  check_open();
  ExpectRequest r;
  r.imm = imm;
  r.count = count;
  r.id = next_expectation_id_.fetch_add(1, std::memory_order_relaxed);
  if (opts.timeout) r.deadline = Clock::now() + *opts.timeout;
  r.on_done = std::move(on_done);
  ImmExpectation handle{imm, r.id};
  worker_->submit(std::move(r));
  return handle;
}

bool EngineImpl::cancel_expectation(const ImmExpectation& e) {
  check_open();
  return worker_->call([&] { return worker_->cancel_expectation(e.imm, e.id); });
}

void EngineImpl::remove_peer(const NetAddr& peer) {
  check_open();
  check_peer(peer, "remove_peer");
  worker_->call([&] { worker_->remove_peer(peer); });
}

size_t EngineImpl::peer_count() {
  check_open();
  return worker_->call([&] { return worker_->peer_count(); });
}

uint64_t EngineImpl::imm_count(uint32_t imm) {
  check_open();
  return worker_->call([&] { return worker_->imm_count(imm); });
}

void EngineImpl::single_write(uint64_t len, const MrHandle& src, uint64_t src_offset,
                              const MrDesc& dst, uint64_t dst_offset, OnDone on_done,
                              const WriteOptions& opts) {
  check_open();
  const RegionSlot& s = source(src);
  if (!in_bounds(src_offset, len, s.len))
    throw Error(ErrorCode::kOutOfBounds,
                fmt::format("submit_single_write: source [{}, {}+{}) is outside the registered "
                            "region of {} bytes",
                            src_offset, src_offset, len, s.len));
  check_dst(dst, dst_offset, len, "submit_single_write");
  check_route(s, dst, "submit_single_write");
  TransferRequest r = make_request(TransferKind::kSingle, std::move(on_done), opts);
  r.src = src;
  r.len = len;
  r.src_offset = src_offset;
  r.dst_offset = dst_offset;
  r.dst = dst;
  worker_->submit(std::move(r));
}

void EngineImpl::paged_writes(uint64_t page_len, const MrHandle& src, const Pages& src_pages,
                              const MrDesc& dst, const Pages& dst_pages, OnDone on_done,
                              const WriteOptions& opts) {
  check_open();
  const RegionSlot& s = source(src);
  check_dst(dst, 0, 0, "submit_paged_writes");  // peer and route; pages are bounded below
  if (page_len == 0)
    throw Error(ErrorCode::kInvalidArgument, "submit_paged_writes: page_len must be > 0");
  if (src_pages.indices.size() != dst_pages.indices.size())
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("submit_paged_writes: {} source pages but {} destination pages",
                            src_pages.indices.size(), dst_pages.indices.size()));
  if (src_pages.indices.size() > UINT32_MAX)
    throw Error(ErrorCode::kInvalidArgument, "submit_paged_writes: too many pages");
  if (!src_pages.indices.empty()) {
    if (pages_end(src_pages, page_len) > s.len)
      throw Error(ErrorCode::kOutOfBounds,
                  fmt::format("submit_paged_writes: a source page ends beyond the registered "
                              "region of {} bytes (offset + stride * max index + page_len)",
                              s.len));
    if (pages_end(dst_pages, page_len) > dst.len())
      throw Error(ErrorCode::kOutOfBounds,
                  fmt::format("submit_paged_writes: a destination page ends beyond the remote "
                              "region of {} bytes (offset + stride * max index + page_len)",
                              dst.len()));
  }
  check_route(s, dst, "submit_paged_writes");
  TransferRequest r = make_request(TransferKind::kPaged, std::move(on_done), opts);
  r.src = src;
  r.len = page_len;
  r.dst = dst;
  r.src_pages = src_pages;
  r.dst_pages = dst_pages;
  worker_->submit(std::move(r));
}

PeerGroupHandle EngineImpl::add_peer_group(const std::vector<NetAddr>& peers) {
  check_open();
  for (auto& p : peers) check_peer(p, "add_peer_group");
  std::lock_guard lock(control_mu_);
  if (group_storage_.size() >= kMaxGroups)
    throw Error(ErrorCode::kResourceExhausted,
                fmt::format("add_peer_group: at most {} peer groups", kMaxGroups));
  auto g = std::make_unique<PeerGroup>();
  for (auto& p : peers) g->members.insert(addr_key(p));
  // Resolve every address now so the first scatter pays no address-vector insertion.
  worker_->call([&] {
    for (auto& p : peers) worker_->resolve(p);
  });
  uint32_t id = static_cast<uint32_t>(group_storage_.size());
  groups_[id].store(g.get(), std::memory_order_release);
  group_storage_.push_back(std::move(g));
  return PeerGroupHandle{id};
}

void EngineImpl::scatter(std::optional<PeerGroupHandle> group, const MrHandle& src,
                         const std::vector<ScatterDst>& dsts, OnDone on_done,
                         const WriteOptions& opts) {
  check_open();
  const RegionSlot& s = source(src);
  for (size_t i = 0; i < dsts.size(); i++) {
    const ScatterDst& d = dsts[i];
    if (!in_bounds(d.src_offset, d.len, s.len))
      throw Error(ErrorCode::kOutOfBounds,
                  fmt::format("submit_scatter: destination {}: source [{}, {}+{}) is outside the "
                              "registered region of {} bytes",
                              i, d.src_offset, d.src_offset, d.len, s.len));
    check_dst(d.dst, d.dst_offset, d.len, "submit_scatter");
    check_route(s, d.dst, "submit_scatter");
    check_group_member(group, d.dst.owner());
  }
  TransferRequest r = make_request(TransferKind::kScatter, std::move(on_done), opts);
  r.src = src;
  r.scatter = dsts;
  worker_->submit(std::move(r));
}

void EngineImpl::barrier(std::optional<PeerGroupHandle> group, uint32_t imm,
                         const std::vector<MrDesc>& dsts, OnDone on_done,
                         std::optional<uint8_t> nic) {
  check_open();
  for (auto& d : dsts) {
    check_dst(d, 0, 0, "submit_barrier");
    check_group_member(group, d.owner());
  }
  TransferRequest r = make_request(TransferKind::kBarrier, std::move(on_done), {imm, nic});
  r.barrier = dsts;
  worker_->submit(std::move(r));
}

std::vector<NicStats> EngineImpl::nic_stats() const {
  check_open();
  std::vector<NicStats> out;
  for (size_t i = 0; i < worker_->domain_count(); i++) {
    const AtomicNicStats& a = worker_->stats(i);
    Domain::InjectedFaults f = worker_->injected_faults(i);
    out.push_back({a.writes_posted.load(), a.bytes_written.load(), a.sends_posted.load(),
                   a.imms_received.load(), a.messages_received.load(), a.errors.load(), f.total,
                   f.duplicated_imms, a.imms_dropped.load()});
  }
  return out;
}

GpuSignals& EngineImpl::signals() {
  std::lock_guard lock(signals_mu_);
  if (!signals_) signals_ = make_gpu_signals(config_);
  return *signals_;
}

// ---- TransferEngine: the public face ----

size_t single_write_imm_count(uint64_t len, size_t nic_count, bool pinned_to_one_nic) {
  return single_write_shards(len, nic_count, pinned_to_one_nic);
}

TransferEngine::TransferEngine(EngineConfig config)
    : impl_(std::make_unique<EngineImpl>(std::move(config))) {}
TransferEngine::~TransferEngine() = default;

NetAddr TransferEngine::main_address() const { return impl_->address(); }
size_t TransferEngine::nic_count() const { return impl_->nic_count(); }
std::pair<MrHandle, MrDesc> TransferEngine::reg_mr(void* ptr, size_t len, Device device) {
  return impl_->reg_mr(ptr, len, device);
}
void TransferEngine::dereg_mr(MrHandle handle) { impl_->dereg_mr(handle); }
void TransferEngine::submit_send(const NetAddr& dst, std::span<const std::byte> bytes, OnDone on_done) {
  impl_->send(dst, bytes, std::move(on_done));
}
void TransferEngine::submit_recvs(size_t len, size_t count, RecvCallback on_recv) {
  impl_->recvs(len, count, std::move(on_recv));
}
ImmExpectation TransferEngine::expect_imm_count(uint32_t imm, uint64_t count, OnDone on_reached,
                                                ExpectOptions opts) {
  return impl_->expect(imm, count, std::move(on_reached), opts);
}
bool TransferEngine::cancel_imm_expectation(const ImmExpectation& e) {
  return impl_->cancel_expectation(e);
}
void TransferEngine::remove_peer(const NetAddr& peer) { impl_->remove_peer(peer); }
size_t TransferEngine::peer_count() { return impl_->peer_count(); }
uint64_t TransferEngine::imm_count(uint32_t imm) { return impl_->imm_count(imm); }
void TransferEngine::submit_single_write(uint64_t len, const MrHandle& src, uint64_t src_offset,
                                         const MrDesc& dst, uint64_t dst_offset, OnDone on_done,
                                         WriteOptions opts) {
  impl_->single_write(len, src, src_offset, dst, dst_offset, std::move(on_done), opts);
}
void TransferEngine::submit_paged_writes(uint64_t page_len, const MrHandle& src,
                                         const Pages& src_pages, const MrDesc& dst,
                                         const Pages& dst_pages, OnDone on_done, WriteOptions opts) {
  impl_->paged_writes(page_len, src, src_pages, dst, dst_pages, std::move(on_done), opts);
}
PeerGroupHandle TransferEngine::add_peer_group(const std::vector<NetAddr>& peers) {
  return impl_->add_peer_group(peers);
}
void TransferEngine::submit_scatter(std::optional<PeerGroupHandle> group, const MrHandle& src,
                                    const std::vector<ScatterDst>& dsts, OnDone on_done,
                                    WriteOptions opts) {
  impl_->scatter(group, src, dsts, std::move(on_done), opts);
}
void TransferEngine::submit_barrier(std::optional<PeerGroupHandle> group, uint32_t imm,
                                    const std::vector<MrDesc>& dsts, OnDone on_done,
                                    std::optional<uint8_t> nic) {
  impl_->barrier(group, imm, dsts, std::move(on_done), nic);
}
std::vector<NicStats> TransferEngine::nic_stats() { return impl_->nic_stats(); }
UvmWatcher TransferEngine::alloc_uvm_watcher(UvmCallback cb) {
  return impl_->signals().add_watcher(std::move(cb));
}
void TransferEngine::free_uvm_watcher(const UvmWatcher& w) { impl_->signals().remove_watcher(w); }
GpuCounter TransferEngine::alloc_gpu_counter() { return impl_->signals().add_counter(); }
void TransferEngine::free_gpu_counter(const GpuCounter& c) { impl_->signals().remove_counter(c); }
void TransferEngine::gpu_stream_wait(void* cuda_stream, const GpuCounter& counter, uint64_t at_least) {
  fabric::gpu_stream_wait(cuda_stream, counter, at_least);
}
std::vector<PostTiming> TransferEngine::take_post_timings() { return impl_->take_post_timings(); }

// ---- configuration from the environment ----

EngineConfig EngineConfig::from_env() {
  EngineConfig c;
  if (const char* p = std::getenv("FABRIC_PROVIDER")) c.provider = p;
  c.nics.clear();
  if (const char* n = std::getenv("FABRIC_NICS")) {
    std::string s = n;
    size_t start = 0;
    while (start <= s.size()) {
      size_t end = s.find(',', start);
      if (end == std::string::npos) end = s.size();
      std::string name = s.substr(start, end - start);
      if (end > start) c.nics.push_back(c.provider == "verbs" ? NicConfig{name, ""} : NicConfig{"", name});
      start = end + 1;
    }
  }
  if (c.nics.empty())
    c.nics.push_back(c.provider.rfind("tcp", 0) == 0 ? NicConfig{"", "127.0.0.1"} : NicConfig{});
  if (const char* g = std::getenv("FABRIC_GID_INDEX")) c.verbs.gid_index = std::atoi(g);
  if (const char* d = std::getenv("FABRIC_CUDA_DEVICE")) c.cuda_device = std::atoi(d);
  if (const char* i = std::getenv("FABRIC_CUDA_IPC")) c.cuda_ipc = std::strcmp(i, "1") == 0;
  if (const char* m = std::getenv("FABRIC_POLL"))
    c.worker_poll = c.callback_poll = std::strcmp(m, "busy") == 0 ? PollMode::kBusy : PollMode::kAdaptive;
  return c;
}

}  // namespace fabric
