// TransferEngine's calls, each done here on EngineImpl's state (engine_impl.h): submit-time
// validation (handles, bounds, NIC counts, peers), then a request to the worker; control calls
// run on each worker's component in Worker::call. Every error found here is thrown, with what to
// do about it.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <utility>

#include "engine/engine_impl.h"
#include "util/log.h"
#include "worker/sharding.h"

namespace fabric {

namespace {

// What closing leaves behind when a worker is wedged inside its provider: it may wake up and touch
// all of it. Held for the process's life and never destroyed, so it stays reachable (a deliberate
// leak, to leak checkers too) after the woken worker's thread has ended.
struct LeftBehind {
  std::unique_ptr<CallbackThread> callbacks;
  std::unique_ptr<MrTable> mrs;
  std::unique_ptr<RemoteTable> remotes;
  std::unique_ptr<RequestBufferPool> buffers;
  std::vector<std::unique_ptr<Worker>> workers;
};

void leave_behind(LeftBehind parts) {
  static auto* mu = new std::mutex;
  static auto* all = new std::vector<LeftBehind>;
  std::lock_guard l(*mu);
  all->push_back(std::move(parts));
}

// Engine ids: unique in the process, never 0 (a default-constructed handle names no engine).
std::atomic<uint32_t> next_engine_id{1};

// A handle of another engine, or none, is refused before its slot is read: its slot and generation
// may well name one of this engine's regions. `kind` is the handle's type, `made_by` the call
// that makes it.
void check_engine(uint32_t handle_engine, uint32_t ours, const char* what, const char* kind,
                  const char* made_by) {
  if (handle_engine == ours) return;
  if (handle_engine == 0)
    throw Error(ErrorCode::kNotFound,
                fmt::format("{}: unknown {} (made by no engine): use the handle that {} returned",
                            what, kind, made_by));
  throw Error(ErrorCode::kInvalidArgument,
              fmt::format("{}: this {} belongs to engine {}, not to this engine ({}): each engine "
                          "accepts only the handles its own {} returned",
                          what, kind, handle_engine, ours, made_by));
}

bool in_bounds(uint64_t offset, uint64_t len, uint64_t region_len) {
  return offset <= region_len && len <= region_len - offset;
}

__extension__ typedef unsigned __int128 u128;

// Highest byte (exclusive) touched by a page list, in 128 bits so nothing overflows.
u128 pages_end(const Pages& p, uint64_t page_len) {
  // Precondition: at least one index.
  uint32_t max_index = *std::max_element(p.indices.begin(), p.indices.end());
  return static_cast<u128>(p.offset) +
         static_cast<u128>(p.stride) * max_index + page_len;
}

std::string desc_key(const MrDesc& d) {
  auto b = d.to_bytes();
  return std::string(b.begin(), b.end());
}

// A WRITE's immediate is a local value of its destination region's range (MrDesc::imms).
void check_imm(const char* what, std::optional<size_t> dst, std::optional<uint32_t> imm, uint8_t bits) {
  if (!imm || bits >= 32 || *imm < (uint64_t{1} << bits)) return;
  throw Error(ErrorCode::kInvalidArgument,
              fmt::format("{}: immediate {:#x} does not fit the {}-bit immediate range of {} (its owner "
                          "reserved it: write local values below 2^{})",
                          what, *imm, bits, dst ? fmt::format("destination {}", *dst) : std::string("the destination"),
                          bits));
}

// Explicit shard counts: enough for any NIC layout, few enough that a mistake is caught.
constexpr uint32_t kMaxShards = 256;

// The message for a write whose [offset, offset + len) is outside its region: `side` is
// "source" or "destination", `slice` the slice of a scatter, `region` what the region is.
[[noreturn]] void out_of_bounds(const char* what, std::optional<size_t> slice, const char* side,
                                uint64_t offset, uint64_t len, std::string_view region,
                                uint64_t region_len) {
  throw Error(ErrorCode::kOutOfBounds,
              fmt::format("{}: {}{} [{}, {}+{}) is outside {} of {} bytes", what,
                          slice ? fmt::format("slice {}: ", *slice) : std::string(), side, offset,
                          offset, len, region, region_len));
}

// Each worker's own configuration: the engine's, with that worker's GPU, NICs and cores, and no
// worker list (what the worker, its domains and its GPU signals read).
std::vector<EngineConfig> split_workers(const EngineConfig& c) {
  if (c.max_message_size == 0 || c.max_message_size > UINT32_MAX)
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("EngineConfig::max_message_size must be 1 to 2^32-1 bytes, it is {}",
                            c.max_message_size));
  std::vector<WorkerConfig> workers = c.workers;
  if (workers.empty()) workers.push_back({c.cuda_device, c.nics, c.worker_cpu, c.watcher_cpu});
  if (workers.size() > kMaxWorkers)
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("EngineConfig::workers lists {} workers; an engine has 1 to {}",
                            workers.size(), kMaxWorkers));
  std::vector<EngineConfig> out;
  for (size_t w = 0; w < workers.size(); w++) {
    const WorkerConfig& wc = workers[w];
    if (wc.nics.empty() || wc.nics.size() > kMaxNics)
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("{} must list 1 to {} NICs, it lists {}",
                              c.workers.empty() ? std::string("EngineConfig::nics")
                                                : fmt::format("EngineConfig::workers[{}].nics", w),
                              kMaxNics, wc.nics.size()));
    if (wc.nics.size() != workers[0].nics.size())
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("worker {} has {} NICs and worker 0 {}: every worker needs the same "
                              "number (rail-aligned peers)",
                              w, wc.nics.size(), workers[0].nics.size()));
    for (size_t v = 0; v < w; v++)
      if (wc.cuda_device && workers[v].cuda_device == wc.cuda_device)
        throw Error(ErrorCode::kInvalidArgument,
                    fmt::format("workers {} and {} both serve GPU {}", v, w, *wc.cuda_device));
    EngineConfig e = c;
    e.workers.clear();
    e.cuda_device = wc.cuda_device;
    e.nics = wc.nics;
    e.worker_cpu = wc.worker_cpu;
    e.watcher_cpu = wc.watcher_cpu;
    out.push_back(std::move(e));
  }
  return out;
}

}  // namespace

EngineImpl::EngineImpl(EngineConfig config)
    : config_(std::move(config)),
      worker_configs_(split_workers(config_)),
      mrs_owner_(std::make_unique<MrTable>(config_.max_regions)),
      mrs_(*mrs_owner_),
      remotes_owner_(std::make_unique<RemoteTable>(config_.max_remotes, worker_configs_.size())),
      remotes_(*remotes_owner_),
      buffers_owner_(std::make_unique<RequestBufferPool>()),
      buffers_(*buffers_owner_),
      imm_registry_(std::make_shared<ImmRegistry>(this)),
      engine_id_(next_engine_id.fetch_add(1, std::memory_order_relaxed)) {
  callbacks_ = std::make_unique<CallbackThread>(config_.event_queue_capacity, config_.callback_poll);
  // A constructor that throws runs no destructor: what was started so far is stopped here.
  auto stop_started = [this] {
    for (auto& w : workers_) w->stop();
    workers_.clear();
    callbacks_->stop();
    callbacks_.reset();
  };
  try {
    for (size_t w = 0; w < worker_configs_.size(); w++)
      workers_.push_back(
          std::make_unique<Worker>(worker_configs_[w], w, mrs_, remotes_, buffers_, *callbacks_));
  } catch (...) {
    stop_started();
    throw;
  }
  std::vector<std::vector<std::string>> nics;
  std::vector<std::string> locals;
  for (auto& w : workers_) {
    nics.push_back(w->domains().nic_addresses());
    locals.push_back(w->domains().local_address());
  }
  nic_count_ = workers_[0]->domains().nic_count();  // every worker has as many
  // The longest message we accept travels in the address: senders refuse longer ones at submit.
  address_ = NetAddr(workers_[0]->domains().provider(), std::move(nics), std::move(locals),
                     static_cast<uint32_t>(config_.max_message_size));
  if (config_.metrics_port != 0) {
    try {  // last: it may render the metrics at once
      metrics_endpoint_ = std::make_unique<MetricsEndpoint>(config_.metrics_address, config_.metrics_port,
                                                            [this] { return metrics_text(); });
    } catch (...) {
      stop_started();
      throw;
    }
  }
}

EngineImpl::~EngineImpl() {
  metrics_endpoint_.reset();  // first: it reads the workers
  metrics_sources_->close();  // what the sources captured goes now, whoever holds a registration
  imm_registry_->close();  // reservations that outlive the engine throw kShutdown from now on
  for (auto& s : signals_) s.reset();  // watcher callbacks may submit: stop them while the engine still works
  // From here on every call throws kShutdown, callbacks of the failed transfers included (they
  // run below, after the workers are gone but before their objects are).
  closing_.store(true, std::memory_order_release);
  // Each fails what is pending (events queued), closes its NICs, joins.
  bool joined = true;
  for (auto& w : workers_) joined &= w->stop();
  callbacks_->stop();
  if (!joined) {
    // One is wedged inside its provider: it may still wake up and touch its own object, the
    // region tables and the callback queue, so all of them are left behind (a leak, not a crash).
    callbacks_->join();
    leave_behind({std::move(callbacks_), std::move(mrs_owner_), std::move(remotes_owner_),
                  std::move(buffers_owner_), std::move(workers_)});
    return;
  }
  callbacks_.reset();  // runs every queued callback, joins
  workers_.clear();
}

uint32_t EngineImpl::worker_index(Device device, const char* what) const {
  if (device.kind == Device::Kind::kHost) {
    if (device.index < 0) return 0;
    if (static_cast<size_t>(device.index) < workers_.size()) return static_cast<uint32_t>(device.index);
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("{}: host memory for worker {}, but this engine has {} workers", what,
                            device.index, workers_.size()));
  }
  if (workers_.size() == 1) return 0;  // a one-worker engine serves whatever its providers reach
  for (size_t w = 0; w < worker_configs_.size(); w++)
    if (worker_configs_[w].cuda_device == device.index) return static_cast<uint32_t>(w);
  throw Error(ErrorCode::kInvalidArgument,
              fmt::format("{}: no worker of this engine serves GPU {} (EngineConfig::workers)", what,
                          device.index));
}

void EngineImpl::check_open() const {
  if (closing_.load(std::memory_order_acquire))
    throw Error(ErrorCode::kShutdown, "the engine is shutting down (called from a completion callback "
                                      "during its destruction?)");
}

// EngineImpl::reg_mr: registration.cpp.

SourceView EngineImpl::source(const MrHandle& h) const {
  check_engine(h.engine, engine_id_, "MrHandle", "MrHandle", "reg_mr");
  std::optional<SourceView> s = mrs_.view(h);
  if (!s)
    throw Error(ErrorCode::kNotFound,
                fmt::format("unknown or deregistered MrHandle (slot {}, generation {}): use the "
                            "handle returned by reg_mr, and not after dereg_mr",
                            h.slot, h.generation));
  return *s;
}

void EngineImpl::check_peer(const NetAddr& peer, const char* what) const {
  if (peer.nic_count() != nic_count_)
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("{}: the peer has {} NICs and this engine {}; every peer must use the "
                            "same number of NICs per GPU (rail-aligned)",
                            what, peer.nic_count(), nic_count_));
  if (peer.provider() != address_.provider())
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("{}: the peer uses provider '{}' and this engine '{}'", what,
                            peer.provider(), address_.provider()));
}

RemoteView EngineImpl::remote(const RemoteMr& r, const char* what) const {
  check_engine(r.engine, engine_id_, what, "RemoteMr", "add_remote");
  std::optional<RemoteView> v = remotes_.view(r);
  if (!v)
    throw Error(ErrorCode::kNotFound,
                fmt::format("{}: unknown or removed RemoteMr (slot {}, generation {}): use the "
                            "handle add_remote returned, and not after remove_remote",
                            what, r.slot, r.generation));
  return *v;
}

const PeerGroup& EngineImpl::group(const PeerGroupHandle& h, const char* what) const {
  check_engine(h.engine, engine_id_, what, "peer group", "add_peer_group");
  const PeerGroup* g = h.id < kMaxGroups ? groups_[h.id].load(std::memory_order_acquire) : nullptr;
  if (!g) throw Error(ErrorCode::kNotFound, fmt::format("{}: unknown peer group {}", what, h.id));
  return *g;
}

void EngineImpl::check_route(const SourceView& src, bool dst_local, const char* what) const {
  if (!src.on_nics && !dst_local)
    throw Error(ErrorCode::kUnsupported,
                fmt::format("{}: the source is GPU memory that this engine's NICs cannot read, and "
                            "the destination is not reachable through cuda_ipc",
                            what));
}

bool EngineImpl::reachable_locally(const MrDesc& dst) const {
  const std::string& ours = address_.local();
  return !ours.empty() && dst.local_key() &&
         local_scope(dst.owner().local(dst.worker())) == local_scope(ours);
}

TransferRequest EngineImpl::make_request(TransferKind kind, OnDone on_done,
                                         std::optional<uint32_t> imm, std::optional<uint8_t> nic,
                                         const char* what) const {
  if (nic && *nic >= nic_count_)
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("{}: nic {} but this engine has {} NICs", what, *nic, nic_count_));
  TransferRequest r;
  r.kind = kind;
  r.on_done = std::move(on_done);
  r.has_imm = imm.has_value();
  r.imm = imm.value_or(0);
  r.pinned_nic = nic ? *nic : -1;
  r.deadline = Clock::now() + config_.transfer_timeout;
  return r;
}

void EngineImpl::submit_request(Worker& w, TransferRequest&& r) {
  RequestBuffer* buf = r.buf;
  const TransferKind kind = r.kind;
  try {
    w.submit(std::move(r));
  } catch (...) {
    buffers_.give(kind, buf);  // never queued: nobody else will
    throw;
  }
}

void EngineImpl::check_unreserved(uint32_t imm, const char* what) const {
  if (auto holder = imm_registry_->holder_of(imm))
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("{}: immediate {:#x} belongs to the reserved range of {}; its holder counts it "
                            "through its ImmReservation",
                            what, imm, *holder));
}

ImmReservation EngineImpl::reserve_imms(const ImmReserveRequest& request) {
  check_open();
  auto [id, range] = imm_registry_->reserve(request);
  ImmReservation r;
  r.registry_ = imm_registry_;
  r.id_ = id;
  r.range_ = range;
  r.holder_ = request.holder;
  return r;
}

ImmExpectation EngineImpl::expect_reserved(uint32_t imm, uint64_t count, OnDone on_done,
                                           const ExpectOptions& opts) {
  check_open();
  const uint32_t w = worker_index(opts.device, "expect_imm_count");
  ExpectRequest r;
  r.imm = imm;
  r.count = count;
  r.id = next_expectation_id_.fetch_add(1, std::memory_order_relaxed);
  if (opts.timeout) r.deadline = Clock::now() + *opts.timeout;
  r.on_done = std::move(on_done);
  ImmExpectation handle{imm, r.id, w, engine_id_};
  workers_[w]->submit(std::move(r));
  return handle;
}

bool EngineImpl::cancel_expectation(const ImmExpectation& e) {
  check_open();
  check_engine(e.engine, engine_id_, "cancel_imm_expectation", "ImmExpectation", "expect_imm_count");
  if (e.worker >= workers_.size()) return false;
  Worker& w = *workers_[e.worker];
  return w.call([&] { return w.expectations().cancel(e.imm, e.id); });
}

uint64_t EngineImpl::count_reserved(uint32_t imm) {
  check_open();
  uint64_t n = 0;
  for (auto& w : workers_) n += w->call([&] { return w->expectations().count(imm); });
  return n;
}

uint64_t EngineImpl::discard_reserved(uint32_t imm) {
  check_open();
  uint64_t n = 0;
  for (auto& w : workers_) n += w->call([&] { return w->expectations().discard(imm); });
  return n;
}

void EngineImpl::remove_remote_locked(RemoteMr r) {
  RemoteSlot* slot = remotes_.live(r);
  if (!slot)
    throw Error(ErrorCode::kNotFound, "remove_remote: unknown or already removed RemoteMr");
  // Stale first, so no worker takes a new request naming it; then each drops its route.
  slot->generation.fetch_add(1, std::memory_order_release);
  for (auto& w : workers_) w->call([&] { w->peers().detach_remote(r.slot); });
  slot->desc = MrDesc{};
  remotes_.return_slot(r.slot);
  std::erase_if(remote_index_, [&](const auto& kv) { return kv.second == r; });
}

std::pair<GpuSignals&, uint32_t> EngineImpl::signals(std::optional<int> cuda_device) {
  uint32_t w = cuda_device ? worker_index(Device::cuda(*cuda_device), "GPU signals") : 0;
  return {signals_of(w), w};
}

GpuSignals& EngineImpl::signals_of(uint32_t w) {
  if (w >= workers_.size())
    throw Error(ErrorCode::kNotFound, fmt::format("GPU signals: no worker {}", w));
  std::lock_guard lock(signals_mu_);
  if (!signals_[w]) signals_[w] = make_gpu_signals(worker_configs_[w]);
  return *signals_[w];
}

// ---- TransferEngine: the public calls, each doing its own work ----

size_t single_write_imm_count(uint64_t len, size_t nic_count, bool pinned_to_one_nic) {
  return single_write_shards(len, nic_count, pinned_to_one_nic);
}

size_t single_write_imm_count(const SingleWrite& w, size_t nic_count) {
  return w.num_shards ? *w.num_shards : single_write_shards(w.len, nic_count, w.nic.has_value());
}

TransferEngine::TransferEngine(EngineConfig config)
    : impl_(std::make_unique<EngineImpl>(std::move(config))) {}
TransferEngine::~TransferEngine() = default;

NetAddr TransferEngine::main_address() const { return impl_->address_; }
size_t TransferEngine::nic_count() const { return impl_->nic_count_; }
size_t TransferEngine::worker_count() const { return impl_->workers_.size(); }

std::pair<MrHandle, MrDesc> TransferEngine::reg_mr(void* ptr, size_t len, Device device) {
  return impl_->reg_mr(ptr, len, device, ImmRange{});
}
std::pair<MrHandle, MrDesc> TransferEngine::reg_mr(void* ptr, size_t len, Device device,
                                                   const ImmReservation& imms) {
  if (!imms.held())
    throw Error(ErrorCode::kInvalidArgument, "reg_mr: the immediate reservation is not held");
  return impl_->reg_mr(ptr, len, device, imms.range());
}

ImmReservation TransferEngine::reserve_imms(const ImmReserveRequest& request) {
  return impl_->reserve_imms(request);  // EngineImpl is ImmReservation's friend
}

void TransferEngine::dereg_mr(MrHandle handle) {
  impl_->check_open();
  std::lock_guard lock(impl_->control_mu_);
  Worker& worker =
      impl_->worker_of(impl_->source(handle));  // throws for an unknown or stale handle
  RegionSlot* slot = &impl_->mrs_.slot(handle.slot);
  // One step on the worker: the handle turns stale (no transfer taken from now on reads the
  // region, and one being posted stops at its next WRITE), and the transfers reading it fail,
  // each reported once. The slot is not reused until the end, so nothing can read another
  // region's bytes through it.
  size_t in_flight = worker.call([&] {
    if (slot->generation.load(std::memory_order_relaxed) != handle.generation)
      throw Error(ErrorCode::kNotFound, "dereg_mr: the region was deregistered meanwhile");
    slot->generation.fetch_add(1, std::memory_order_release);  // even: stale from now on
    return worker.fail_transfers_from(slot);
  });
  // WRITEs already handed to a NIC may still be reading the memory: the region stays registered
  // until they complete (at most the transfer timeout: a WRITE that never completes is
  // abandoned there too).
  auto deadline = std::chrono::steady_clock::now() + impl_->config_.transfer_timeout;
  while (in_flight > 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::microseconds(200));
    in_flight = worker.call([&] { return worker.fail_transfers_from(slot); });
  }
  // The worker's part first; then this thread unpins what it may (as reg_mr pinned it), and only
  // then is the slot free for another region.
  using Part = DomainGroup::Part;
  std::array<DomainRegion, kMaxDomains> beside = worker.call([&] {
    worker.deregister_region(slot->per_nic, Part::kOnWorker);
    return std::exchange(slot->per_nic, {});
  });
  worker.deregister_region(beside, Part::kBesideWorker);
  worker.call([&] { impl_->mrs_.return_slot(handle.slot); });
}

void TransferEngine::submit_send(const NetAddr& dst, std::span<const std::byte> bytes,
                                 OnDone on_done) try {
  impl_->check_open();
  impl_->check_peer(dst, "submit_send");
  if (bytes.size() > impl_->config_.max_message_size)
    throw Error(
        ErrorCode::kInvalidArgument,
        fmt::format("submit_send: message of {} bytes exceeds EngineConfig::max_message_size "
                    "({}); use a WRITE for bulk data or raise the limit",
                    bytes.size(), impl_->config_.max_message_size));
  if (dst.max_message() != 0 && bytes.size() > dst.max_message())
    throw Error(
        ErrorCode::kInvalidArgument,
        fmt::format("submit_send: message of {} bytes is longer than the peer accepts ({} bytes, "
                    "its EngineConfig::max_message_size): it would be dropped there; raise the "
                    "peer's limit or send less",
                    bytes.size(), dst.max_message()));
  TransferRequest r =
      impl_->make_request(TransferKind::kSend, std::move(on_done), {}, {}, "submit_send");
  r.buf = impl_->buffers_.take(r.kind);
  // Messages go between first workers. Copy-assigned into kept capacity: no allocation after
  // warm-up (a several-worker address is cut down to its first worker's first).
  if (dst.worker_count() == 1)
    r.buf->send_dst = dst;
  else
    r.buf->send_dst = dst.worker(0);
  r.buf->payload.assign(bytes.begin(), bytes.end());
  impl_->submit_request(*impl_->workers_[0], std::move(r));
} catch (const Error& e) {
  impl_->count_refused(TransferKind::kSend, e.code());
  throw;
}

void TransferEngine::submit_recvs(size_t len, size_t count, RecvCallback on_recv) {
  impl_->check_open();
  if (len == 0 || count == 0 || !on_recv)
    throw Error(ErrorCode::kInvalidArgument,
                "submit_recvs: needs len > 0, count > 0 and a callback");
  // Every buffer holds the longest message this engine accepts (what its address tells senders),
  // so none arrives truncated: a shorter len is raised to it.
  len = std::max(len, impl_->config_.max_message_size);
  constexpr size_t kMaxPoolBytes = size_t{1} << 34;  // 16 GiB of receive buffers is a mistake
  if (len > kMaxPoolBytes / count)
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("submit_recvs: {} buffers of {} bytes exceed the 16 GiB a receive pool "
                            "may hold; messages are at most EngineConfig::max_message_size ({})",
                            count, len, impl_->config_.max_message_size));
  auto cb = std::make_shared<TransferEngine::RecvCallback>(std::move(on_recv));
  // Registration runs on the worker; its errors reach the caller here.
  Worker& w = *impl_->workers_[0];
  w.call([&] { w.recv_pools().add(len, count, std::move(cb)); });
}

ImmExpectation TransferEngine::expect_imm_count(uint32_t imm, uint64_t count, OnDone on_done,
                                                ExpectOptions opts) {
  impl_->check_open();
  impl_->check_unreserved(imm, "expect_imm_count");
  return impl_->expect_reserved(imm, count, std::move(on_done), opts);
}

// Shared with ImmReservation::cancel.
bool TransferEngine::cancel_imm_expectation(const ImmExpectation& e) {
  return impl_->cancel_expectation(e);
}

uint64_t TransferEngine::imm_count(uint32_t imm) {
  impl_->check_open();
  impl_->check_unreserved(imm, "imm_count");
  return impl_->count_reserved(imm);
}

uint64_t TransferEngine::discard_imm_count(uint32_t imm) {
  impl_->check_open();
  impl_->check_unreserved(imm, "discard_imm_count");
  return impl_->discard_reserved(imm);
}

RemoteMr TransferEngine::add_remote(const MrDesc& desc) {
  impl_->check_open();
  impl_->check_peer(desc.owner(), "add_remote");
  if (!desc.keys().empty() && desc.keys().size() != impl_->nic_count_)
    throw Error(
        ErrorCode::kInvalidArgument,
        fmt::format("add_remote: the descriptor has keys for {} NICs and this engine has {}",
                    desc.keys().size(), impl_->nic_count_));
  if (desc.keys().empty() && !impl_->reachable_locally(desc))
    throw Error(ErrorCode::kUnsupported,
                "add_remote: the region has no NIC keys (its owner's NIC provider cannot reach "
                "that memory) and this engine cannot reach it through cuda_ipc (needs "
                "EngineConfig::cuda_ipc on both engines, one host)");
  std::string key = desc_key(desc);
  std::lock_guard lock(impl_->control_mu_);
  auto it = impl_->remote_index_.find(key);
  if (it != impl_->remote_index_.end()) return it->second;
  auto s = impl_->remotes_.take_free_slot();
  if (!s)
    throw Error(ErrorCode::kResourceExhausted,
                fmt::format("add_remote: all {} remote slots are in use; remove_remote regions "
                            "that are no longer written or raise EngineConfig::max_remotes",
                            impl_->remotes_.capacity()));
  RemoteSlot& slot = impl_->remotes_.slot(*s);
  slot.desc = desc;
  // Each worker resolves its own route to the owner (address-vector insertion, connection set-up).
  size_t attached = 0;
  try {
    for (; attached < impl_->workers_.size(); attached++) {
      Worker& w = *impl_->workers_[attached];
      w.call([&] { w.peers().attach_remote(*s); });
    }
  } catch (...) {
    while (attached-- > 0) {
      Worker& w = *impl_->workers_[attached];
      w.call([&] { w.peers().detach_remote(*s); });
    }
    slot.desc = MrDesc{};
    impl_->remotes_.return_slot(*s);
    throw;
  }
  // Release, as in reg_mr: a reader that sees these also sees the slot's last removal.
  slot.len.store(desc.len(), std::memory_order_release);
  slot.local.store(slot.target(0).local, std::memory_order_release);  // every worker shares one host
  slot.imm_bits.store(desc.imms().bits, std::memory_order_release);
  uint32_t gen = slot.generation.fetch_add(1, std::memory_order_release) + 1;  // odd: live
  RemoteMr r{*s, gen, impl_->engine_id_};
  impl_->remote_index_.emplace(std::move(key), r);
  return r;
}

void TransferEngine::remove_remote(RemoteMr r) {
  impl_->check_open();
  check_engine(r.engine, impl_->engine_id_, "remove_remote", "RemoteMr", "add_remote");
  std::lock_guard lock(impl_->control_mu_);
  impl_->remove_remote_locked(r);
}

void TransferEngine::connect(RemoteMr r) {
  constexpr const char* what = "connect";
  impl_->check_open();
  impl_->remote(r, what);  // this engine's, and live
  // Counted by the WRITEs' OnDones, which keep it alive: a wait that gives up leaves it to them.
  struct Progress {
    std::atomic<uint64_t> done{0}, failed{0};
    DoneStatus status;
  };
  auto p = std::make_shared<Progress>();
  uint64_t posted = 0;
  for (auto& w : impl_->workers_)
    for (size_t k = 0; k < impl_->nic_count_; k++) {
      OnDone d = OnDone::counter(&p->done, &p->failed, &p->status).keep_alive(p);
      TransferRequest q = impl_->make_request(TransferKind::kBarrier, std::move(d), std::nullopt,
                                              static_cast<uint8_t>(k), what);
      q.count = 1;
      q.buf = impl_->buffers_.take(q.kind);
      q.buf->remotes.assign(1, r);
      impl_->submit_request(*w, std::move(q));
      posted++;
    }
  // Every WRITE ends by its deadline (transfer_timeout); the margin covers a worker's last poll.
  const auto deadline = Clock::now() + impl_->config_.transfer_timeout + std::chrono::seconds(5);
  while (p->done.load(std::memory_order_acquire) + p->failed.load(std::memory_order_acquire) < posted) {
    if (Clock::now() > deadline)
      throw Error(ErrorCode::kTimeout, "connect: the peer's WRITEs did not complete within transfer_timeout");
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  if (auto failure = p->status.first_failure())
    throw Error(failure->code(), fmt::format("connect: {}", failure->message()));
}

// Each submit is a function try block: a refused submit is counted
// (fabric_submits_refused_total) and rethrown; nothing is added to the path that succeeds.
void TransferEngine::submit(const SingleWrite& w, OnDone on_done) try {
  constexpr const char* what = "submit(SingleWrite)";
  impl_->check_open();
  const SourceView s = impl_->source(w.src.mr);
  if (!in_bounds(w.src.offset, w.len, s.len))
    out_of_bounds(what, {}, "source", w.src.offset, w.len, "the registered region", s.len);
  RemoteView d = impl_->remote(w.dst.mr, what);
  if (!in_bounds(w.dst.offset, w.len, d.len))
    out_of_bounds(what, {}, "destination", w.dst.offset, w.len, "the remote region", d.len);
  impl_->check_route(s, d.local, what);
  check_imm(what, {}, w.imm, d.imm_bits);
  if (w.num_shards && (*w.num_shards == 0 || *w.num_shards > kMaxShards))
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("{}: num_shards must be 1 to {}, got {}", what, kMaxShards, *w.num_shards));
  TransferRequest r =
      impl_->make_request(TransferKind::kSingle, std::move(on_done), w.imm, w.nic, what);
  r.src = w.src.mr;
  r.len = w.len;
  r.src_offset = w.src.offset;
  r.dst_offset = w.dst.offset;
  r.dst = w.dst.mr;
  r.shards = static_cast<uint32_t>(single_write_imm_count(w, impl_->nic_count_));
  impl_->submit_request(impl_->worker_of(s), std::move(r));
} catch (const Error& e) {
  impl_->count_refused(TransferKind::kSingle, e.code());
  throw;
}

void TransferEngine::submit(const PagedWrites& w, OnDone on_done) try {
  constexpr const char* what = "submit(PagedWrites)";
  impl_->check_open();
  const SourceView s = impl_->source(w.src);
  RemoteView d = impl_->remote(w.dst, what);
  if (w.page_len == 0) throw Error(ErrorCode::kInvalidArgument, fmt::format("{}: page_len must be > 0", what));
  if (w.src_pages.indices.size() != w.dst_pages.indices.size())
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("{}: {} source pages but {} destination pages", what,
                            w.src_pages.indices.size(), w.dst_pages.indices.size()));
  if (w.src_pages.indices.size() > UINT32_MAX)
    throw Error(ErrorCode::kInvalidArgument, fmt::format("{}: too many pages", what));
  if (!w.src_pages.indices.empty()) {
    if (pages_end(w.src_pages, w.page_len) > s.len)
      throw Error(ErrorCode::kOutOfBounds,
                  fmt::format("{}: a source page ends beyond the registered region of {} bytes "
                              "(offset + stride * max index + page_len)",
                              what, s.len));
    if (pages_end(w.dst_pages, w.page_len) > d.len)
      throw Error(ErrorCode::kOutOfBounds,
                  fmt::format("{}: a destination page ends beyond the remote region of {} bytes "
                              "(offset + stride * max index + page_len)",
                              what, d.len));
  }
  impl_->check_route(s, d.local, what);
  check_imm(what, {}, w.imm, d.imm_bits);
  TransferRequest r =
      impl_->make_request(TransferKind::kPaged, std::move(on_done), w.imm, w.nic, what);
  r.src = w.src;
  r.len = w.page_len;
  r.dst = w.dst;
  r.src_offset = w.src_pages.offset;
  r.src_stride = w.src_pages.stride;
  r.dst_offset = w.dst_pages.offset;
  r.dst_stride = w.dst_pages.stride;
  r.count = static_cast<uint32_t>(w.src_pages.indices.size());
  r.buf = impl_->buffers_.take(r.kind);
  r.buf->src_pages.assign(w.src_pages.indices.begin(), w.src_pages.indices.end());
  r.buf->dst_pages.assign(w.dst_pages.indices.begin(), w.dst_pages.indices.end());
  impl_->submit_request(impl_->worker_of(s), std::move(r));
} catch (const Error& e) {
  impl_->count_refused(TransferKind::kPaged, e.code());
  throw;
}

void TransferEngine::submit(const Scatter& w, OnDone on_done) try {
  constexpr const char* what = "submit(Scatter)";
  impl_->check_open();
  const SourceView s = impl_->source(w.src);
  if (w.slices.size() > UINT32_MAX)
    throw Error(ErrorCode::kInvalidArgument, fmt::format("{}: too many slices", what));
  for (size_t i = 0; i < w.slices.size(); i++) {
    const ScatterSlice& sl = w.slices[i];
    if (!in_bounds(sl.src_offset, sl.len, s.len))
      out_of_bounds(what, i, "source", sl.src_offset, sl.len, "the registered region", s.len);
    RemoteView d = impl_->remote(sl.dst.mr, what);
    if (!in_bounds(sl.dst.offset, sl.len, d.len))
      out_of_bounds(what, i, "destination", sl.dst.offset, sl.len, "the remote region", d.len);
    impl_->check_route(s, d.local, what);
    check_imm(what, i, w.imm, d.imm_bits);
  }
  TransferRequest r =
      impl_->make_request(TransferKind::kScatter, std::move(on_done), w.imm, w.nic, what);
  r.src = w.src;
  r.count = static_cast<uint32_t>(w.slices.size());
  r.buf = impl_->buffers_.take(r.kind);
  r.buf->slices.assign(w.slices.begin(), w.slices.end());
  impl_->submit_request(impl_->worker_of(s), std::move(r));
} catch (const Error& e) {
  impl_->count_refused(TransferKind::kScatter, e.code());
  throw;
}

void TransferEngine::submit(const GroupScatter& w, OnDone on_done) try {
  constexpr const char* what = "submit(GroupScatter)";
  impl_->check_open();
  const SourceView s = impl_->source(w.src);
  const PeerGroup& g = impl_->group(w.group, what);
  if (w.slices.size() != g.lens.size())
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("{}: {} slices for a group of {} members (one slice per member)", what,
                            w.slices.size(), g.lens.size()));
  for (size_t i = 0; i < w.slices.size(); i++) {
    const GroupSlice& sl = w.slices[i];
    if (!in_bounds(sl.src_offset, sl.len, s.len))
      out_of_bounds(what, i, "source", sl.src_offset, sl.len, "the registered region", s.len);
    if (!in_bounds(sl.dst_offset, sl.len, g.lens[i]))
      out_of_bounds(what, i, "destination", sl.dst_offset, sl.len,
                    fmt::format("member {}'s region", i), g.lens[i]);
  }
  impl_->check_route(s, g.all_local, what);
  check_imm(what, {}, w.imm, g.imm_bits);
  TransferRequest r =
      impl_->make_request(TransferKind::kGroupScatter, std::move(on_done), w.imm, w.nic, what);
  r.src = w.src;
  r.group = w.group.id;
  r.count = static_cast<uint32_t>(w.slices.size());
  r.buf = impl_->buffers_.take(r.kind);
  r.buf->group_slices.assign(w.slices.begin(), w.slices.end());
  impl_->submit_request(impl_->worker_of(s), std::move(r));
} catch (const Error& e) {
  impl_->count_refused(TransferKind::kGroupScatter, e.code());
  throw;
}

void TransferEngine::submit(const Barrier& w, OnDone on_done) try {
  constexpr const char* what = "submit(Barrier)";
  impl_->check_open();
  if (w.dsts.size() > UINT32_MAX)
    throw Error(ErrorCode::kInvalidArgument, fmt::format("{}: too many destinations", what));
  for (size_t i = 0; i < w.dsts.size(); i++)
    check_imm(what, i, w.imm, impl_->remote(w.dsts[i], what).imm_bits);
  Worker& worker = *impl_->workers_[impl_->worker_index(w.device, what)];
  TransferRequest r =
      impl_->make_request(TransferKind::kBarrier, std::move(on_done), w.imm, w.nic, what);
  r.count = static_cast<uint32_t>(w.dsts.size());
  r.buf = impl_->buffers_.take(r.kind);
  r.buf->remotes.assign(w.dsts.begin(), w.dsts.end());
  impl_->submit_request(worker, std::move(r));
} catch (const Error& e) {
  impl_->count_refused(TransferKind::kBarrier, e.code());
  throw;
}

void TransferEngine::submit(const GroupBarrier& w, OnDone on_done) try {
  constexpr const char* what = "submit(GroupBarrier)";
  impl_->check_open();
  const PeerGroup& g = impl_->group(w.group, what);
  check_imm(what, {}, w.imm, g.imm_bits);
  Worker& worker = *impl_->workers_[impl_->worker_index(w.device, what)];
  TransferRequest r =
      impl_->make_request(TransferKind::kGroupBarrier, std::move(on_done), w.imm, w.nic, what);
  r.group = w.group.id;
  r.count = static_cast<uint32_t>(g.lens.size());
  impl_->submit_request(worker, std::move(r));
} catch (const Error& e) {
  impl_->count_refused(TransferKind::kGroupBarrier, e.code());
  throw;
}

PeerGroupHandle TransferEngine::add_peer_group(std::span<const RemoteMr> members) {
  impl_->check_open();
  auto g = std::make_unique<PeerGroup>();
  for (const RemoteMr& m : members) {
    RemoteView v = impl_->remote(m, "add_peer_group");
    g->lens.push_back(v.len);
    g->all_local &= v.local;
    g->imm_bits = std::min(g->imm_bits, v.imm_bits);
  }
  std::lock_guard lock(impl_->control_mu_);
  if (impl_->group_storage_.size() >= EngineImpl::kMaxGroups)
    throw Error(ErrorCode::kResourceExhausted,
                fmt::format("add_peer_group: at most {} peer groups", EngineImpl::kMaxGroups));
  // Every worker builds the group's routes from its own NICs; they number groups alike (each takes
  // every group, in this order, under this lock).
  uint32_t id = UINT32_MAX;
  for (auto& w : impl_->workers_) {
    uint32_t got = w->call([&] { return w->peers().add_group(members); });
    if (id != UINT32_MAX && got != id)
      throw Error(
          ErrorCode::kProvider,
          fmt::format("add_peer_group: workers disagree on the group id ({} and {})", id, got));
    id = got;
  }
  impl_->groups_[id].store(g.get(), std::memory_order_release);
  impl_->group_storage_.push_back(std::move(g));
  return PeerGroupHandle{id, static_cast<uint32_t>(members.size()), impl_->engine_id_};
}

void TransferEngine::remove_peer(const NetAddr& peer) {
  impl_->check_open();
  impl_->check_peer(peer, "remove_peer");
  std::lock_guard lock(impl_->control_mu_);
  // Every worker of ours holds its own record of every worker of the peer.
  std::vector<RemoteMr> removed;
  for (size_t g = 0; g < peer.worker_count(); g++) {
    const NetAddr one = peer.worker(g);
    for (auto& w : impl_->workers_)
      for (RemoteMr r : w->call([&] { return w->peers().remove_peer(one); })) {
        r.engine = impl_->engine_id_;  // the worker knows slots, not engines
        if (std::find(removed.begin(), removed.end(), r) == removed.end()) removed.push_back(r);
      }
  }
  // Its interned regions go with it (a process at the same address later is another peer, with
  // other keys). Groups keep their member, which fails with kCancelled from now on.
  for (const RemoteMr& r : removed) impl_->remove_remote_locked(r);
}

size_t TransferEngine::peer_count() {
  impl_->check_open();
  size_t n = 0;
  for (auto& w : impl_->workers_) n += w->call([&] { return w->peers().peer_count(); });
  return n;
}

std::vector<NicStats> TransferEngine::nic_stats() {
  impl_->check_open();
  std::vector<NicStats> out;
  for (uint32_t w = 0; w < impl_->workers_.size(); w++) {
    const DomainGroup& domains = impl_->workers_[w]->domains();  // read by any thread
    for (size_t i = 0; i < domains.domain_count(); i++) {
      const NicCounters& a = domains.stats(i);
      const auto [injected, duplicated_imms] = domains.injected_faults(i);
      const DomainCaps& caps = domains.caps(i);
      out.push_back({a.writes.read(), a.bytes.read(), a.sends.read(), a.imms_received.read(),
                     a.messages_received.read(), a.errors.read(), injected, duplicated_imms,
                     a.imms_dropped.read(), a.messages_dropped.read(), caps.nic_name, w,
                     caps.link_gbps});
    }
  }
  return out;
}

std::string TransferEngine::metrics_text() {
  impl_->check_open();
  return impl_->metrics_text();
}

MetricsRegistration TransferEngine::add_metrics_source(MetricsSource source) {
  impl_->check_open();
  return impl_->metrics_sources_->add(std::move(source));
}

UvmWatcher TransferEngine::alloc_uvm_watcher(UvmCallback cb, std::optional<int> cuda_device) {
  auto [signals, worker] = impl_->signals(cuda_device);
  UvmWatcher w = signals.add_watcher(std::move(cb));
  w.worker = worker;
  return w;
}
void TransferEngine::free_uvm_watcher(const UvmWatcher& w) { impl_->signals_of(w.worker).remove_watcher(w); }
GpuCounter TransferEngine::alloc_gpu_counter(std::optional<int> cuda_device) {
  auto [signals, worker] = impl_->signals(cuda_device);
  GpuCounter c = signals.add_counter();
  c.worker = worker;
  return c;
}
void TransferEngine::free_gpu_counter(const GpuCounter& c) { impl_->signals_of(c.worker).remove_counter(c); }
void TransferEngine::gpu_stream_wait(void* cuda_stream, const GpuCounter& counter, uint64_t at_least) {
  fabric::gpu_stream_wait(cuda_stream, counter, at_least);
}

std::vector<PostTiming> TransferEngine::take_post_timings() {
  impl_->check_open();
  std::vector<PostTiming> out;
  for (auto& w : impl_->workers_) {
    auto t = w->call([&] { return w->poster().take_post_timings(); });
    out.insert(out.end(), t.begin(), t.end());
  }
  return out;
}

// ---- configuration from the environment ----

namespace {
uint8_t env_byte(const char* name, const char* value) {
  char* end = nullptr;
  const long v = std::strtol(value, &end, 0);
  if (end == value || *end != '\0' || v < 0 || v > 255)
    throw Error(ErrorCode::kInvalidArgument, fmt::format("{}='{}' is not a number from 0 to 255", name, value));
  return static_cast<uint8_t>(v);
}
}  // namespace

NicConfig NicConfig::parse(const std::string& provider, const std::string& text) {
  const auto at = text.find('@');
  if (at != std::string::npos) return NicConfig{text.substr(0, at), text.substr(at + 1)};
  return provider == "verbs" ? NicConfig{text, ""} : NicConfig{"", text};
}

std::vector<NicConfig> NicConfig::parse_list(const std::string& provider, const std::string& list) {
  std::vector<NicConfig> out;
  for (size_t start = 0; start <= list.size();) {
    size_t end = list.find(',', start);
    if (end == std::string::npos) end = list.size();
    if (end > start) out.push_back(parse(provider, list.substr(start, end - start)));
    start = end + 1;
  }
  return out;
}

EngineConfig EngineConfig::from_env() {
  EngineConfig c;
  if (const char* p = std::getenv("FABRIC_PROVIDER")) c.provider = p;
  c.nics.clear();
  if (const char* n = std::getenv("FABRIC_NICS")) c.nics = NicConfig::parse_list(c.provider, n);
  if (c.nics.empty())
    c.nics.push_back(c.provider.rfind("tcp", 0) == 0 ? NicConfig{"", "127.0.0.1"} : NicConfig{});
  if (const char* g = std::getenv("FABRIC_GID_INDEX")) c.verbs.gid_index = std::atoi(g);
  if (const char* t = std::getenv("FABRIC_VERBS_TC")) c.verbs.traffic_class = env_byte("FABRIC_VERBS_TC", t);
  if (const char* l = std::getenv("FABRIC_VERBS_SL")) c.verbs.service_level = env_byte("FABRIC_VERBS_SL", l);
  if (const char* d = std::getenv("FABRIC_CUDA_DEVICE")) c.cuda_device = std::atoi(d);
  if (const char* i = std::getenv("FABRIC_CUDA_IPC")) c.cuda_ipc = std::strcmp(i, "1") == 0;
  if (const char* i = std::getenv("FABRIC_HOST_IPC")) c.host_ipc = std::strcmp(i, "1") == 0;
  if (const char* m = std::getenv("FABRIC_POLL"))
    c.worker_poll = c.callback_poll = std::strcmp(m, "busy") == 0 ? PollMode::kBusy : PollMode::kAdaptive;
  return c;
}

}  // namespace fabric
