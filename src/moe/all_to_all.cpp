// AllToAll (include/fabric/moe/all_to_all.h): allocates and shares the buffer sets once, then runs
// each half of a handle's dispatch on the chosen kernel side, in the order dispatch send, dispatch
// receive, combine send, combine receive, refusing calls out of that order.
#include "fabric/moe/all_to_all.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "fabric/error.h"
#include "kernel_side.h"
#include "memory.h"
#include "moe_stats.h"
#include "proxy.h"
#include "util/log.h"

namespace fabric::moe {

using namespace detail;

namespace {

enum class Phase { kIdle, kDispatchSent, kDispatched, kCombineSent };

const char* phase_name(Phase p) {
  switch (p) {
    case Phase::kIdle:
      return "unused";
    case Phase::kDispatchSent:
      return "dispatch sent";
    case Phase::kDispatched:
      return "dispatched";
    case Phase::kCombineSent:
      return "combine sent";
  }
  return "?";
}

constexpr uint32_t kBlobMagic = 0x4D6F4532;  // "MoE2"
constexpr uint32_t kMaxBuffers = 4;          // 2^28 immediates each: the whole space holds 16

void fail_config(const std::string& what) {
  throw Error(ErrorCode::kInvalidArgument, "AllToAllConfig: " + what);
}

void check_config(const AllToAllConfig& c) {
  if (c.ranks == 0 || c.ranks > (1u << 16))
    fail_config(fmt::format("ranks {} (1 to 65536)", c.ranks));
  if (c.rank >= c.ranks) fail_config(fmt::format("rank {} of {} ranks", c.rank, c.ranks));
  if (c.node_size == 0 || c.node_size > kMaxNodeSize || c.ranks % c.node_size != 0)
    fail_config(fmt::format("node_size {}: 1 to {} and dividing ranks {}", c.node_size,
                            kMaxNodeSize, c.ranks));
  if (c.experts == 0 || c.experts % c.ranks != 0)
    fail_config(fmt::format("experts {}: a positive multiple of ranks {}", c.experts, c.ranks));
  if (c.topk == 0 || c.topk > kMaxTopk) fail_config(fmt::format("topk {} (1 to {})", c.topk, kMaxTopk));
  if (c.hidden == 0 || c.hidden % kScaleBlock != 0)
    fail_config(fmt::format("hidden {}: a positive multiple of 128", c.hidden));
  if (c.max_tokens == 0) fail_config("max_tokens 0");
  // The kernels index rows of a dispatch (tokens x topk) and of an expert's output (ranks x
  // max_tokens) in 32 bits.
  if (uint64_t{c.ranks} * c.max_tokens * c.topk >= (uint64_t{1} << 31))
    fail_config(fmt::format("ranks {} x max_tokens {} x topk {} must stay below 2^31", c.ranks, c.max_tokens, c.topk));
  if (c.timeout.count() <= 0) fail_config("timeout must be positive");
  if (c.buffers == 0 || c.buffers > kMaxBuffers)
    fail_config(fmt::format("buffers {} (1 to {})", c.buffers, kMaxBuffers));
  if (c.rdma_buffers == RdmaBuffers::kDevice && c.side != KernelSide::kCuda)
    fail_config("rdma_buffers kDevice needs side kCuda (host kernels cannot reach device memory)");
  if (c.shrink && c.side == KernelSide::kCuda)
    throw Error(ErrorCode::kUnsupported,
                "MoE: shrink mode runs on the host kernels only for now (the CUDA kernels do not mask a rank yet)");
  if (c.num_sms > 1024)
    fail_config(fmt::format("num_sms {} (0: the default, else 1 to 1024)", c.num_sms));
  if (c.imm_base &&
      (uint64_t{*c.imm_base} + (uint64_t{c.buffers} << kMoeImmBits) > (uint64_t{1} << 32)))
    fail_config(
        fmt::format("imm_base {:#x}: {} buffer sets of 2^{} immediates do not fit below 2^32",
                    *c.imm_base, c.buffers, kMoeImmBits));
  if (c.job.empty() || c.job.size() > 64 ||
      c.job.find_first_not_of(
          "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-") != std::string::npos)
    fail_config(fmt::format("job '{}': 1 to 64 of [A-Za-z0-9_.-]", c.job));
}

// What every rank publishes: the dimensions (all ranks must agree), and for each buffer set its
// receive region and the handle of its node region.
struct Blob {
  std::array<uint32_t, 11> dims{};
  std::vector<std::vector<uint8_t>> recv_desc;
  std::vector<std::vector<std::byte>> node_handle;
};

std::array<uint32_t, 11> dims_of(const AllToAllConfig& c) {
  return {c.ranks,
          c.node_size,
          c.experts,
          c.topk,
          c.hidden,
          c.max_tokens,
          static_cast<uint32_t>(c.dispatch_dtype),
          c.private_rows,
          static_cast<uint32_t>(c.side),
          c.buffers,
          c.shrink ? 1u : 0u};
}

template <typename T>
void put(std::vector<std::byte>& out, const T& v) {
  const size_t at = out.size();
  out.resize(at + sizeof v);  // never empty after this: memcpy gets a valid pointer
  std::memcpy(out.data() + at, &v, sizeof v);
}

template <typename Bytes>
void put_bytes(std::vector<std::byte>& out, const Bytes& b) {
  put(out, static_cast<uint32_t>(b.size()));
  for (auto x : b) out.push_back(std::byte(x));
}

std::vector<std::byte> encode(const Blob& b) {
  std::vector<std::byte> out;
  put(out, kBlobMagic);
  put(out, b.dims);
  for (size_t i = 0; i < b.node_handle.size(); ++i) {
    put_bytes(out, b.recv_desc[i]);
    put_bytes(out, b.node_handle[i]);
  }
  return out;
}

Blob decode(const std::vector<std::byte>& in, uint32_t rank) {
  size_t at = 0;
  auto take = [&](void* dst, size_t n) {
    if (at + n > in.size())
      throw Error(ErrorCode::kMalformed,
                  fmt::format("MoE: rank {}'s published bytes are truncated", rank));
    if (n == 0) return;
    std::memcpy(dst, in.data() + at, n);
    at += n;
  };
  auto take_bytes = [&](auto& v) {
    uint32_t n = 0;
    take(&n, 4);
    v.resize(n);
    take(v.data(), n);
  };
  uint32_t magic = 0;
  take(&magic, 4);
  if (magic != kBlobMagic)
    throw Error(
        ErrorCode::kMalformed,
        fmt::format("MoE: rank {} published something else than an AllToAll of this version",
                    rank));
  Blob b;
  take(b.dims.data(), sizeof b.dims);
  const uint32_t sets = b.dims[9];
  if (sets == 0 || sets > kMaxBuffers)
    throw Error(ErrorCode::kMalformed,
                fmt::format("MoE: rank {} published {} buffer sets", rank, sets));
  b.recv_desc.resize(sets);
  b.node_handle.resize(sets);
  for (uint32_t i = 0; i < sets; ++i) {
    take_bytes(b.recv_desc[i]);
    take_bytes(b.node_handle[i]);
  }
  if (at != in.size())
    throw Error(ErrorCode::kMalformed,
                fmt::format("MoE: rank {}'s published bytes are too long", rank));
  return b;
}

}  // namespace

// One buffer set: a whole instance of the protocol (node region, RDMA regions, immediates,
// signal words, proxy), so two dispatches in flight never share a byte or an immediate.
struct BufferSet {
  std::unique_ptr<NodeRegion> node;
  Block recv, send, local, out;
  std::shared_ptr<Block> signals;
  ImmReservation imms;  // the receive region's immediates (two nodes or more)
  MrHandle recv_mr{}, send_mr{};
  std::vector<RemoteMr> remotes;  // [W]: interned receive regions of the other nodes' ranks
  Views views;                    // what the kernel side uses
  std::unique_ptr<Proxy> proxy;
  Phase phase = Phase::kIdle;
  uint64_t step = 0;      // this set's dispatches: the protocol's step (host kernels)
  uint64_t combines = 0;  // this set's combines: the combine sequence (host kernels; layout.h)
  uint64_t handle = 0;  // the dispatch number of the handle holding the set (0: none yet)
  uint32_t tokens = 0;  // of that dispatch
  std::chrono::nanoseconds send_time{0};  // of the half sent last (host kernels; for MoeStats)

  const std::atomic<uint64_t>& signal(uint64_t offset) const {
    return *reinterpret_cast<const std::atomic<uint64_t>*>(signals->host() + offset);
  }
};

struct AllToAll::Impl {
  TransferEngine& engine;
  AllToAllConfig cfg;
  Layout lay;
  std::vector<std::unique_ptr<BufferSet>> sets;
  uint64_t dispatches = 0;  // dispatch_send calls that were accepted
  bool failed = false;      // a host receive half failed
  MoeStats stats;
  MetricsRegistration metrics;  // its source reads the sets and their proxies

  Impl(TransferEngine& e, AllToAllConfig c) : engine(e), cfg(std::move(c)) {}
  ~Impl() {
    metrics.remove();  // first: it reads the proxies
    for (auto& b : sets) b->proxy.reset();  // no more submits or expectations
    for (auto& b : sets) {
      for (RemoteMr r : b->remotes)
        if (r.slot != UINT32_MAX) engine.remove_remote(r);
      if (b->recv_mr.slot != UINT32_MAX) engine.dereg_mr(b->recv_mr);
      if (b->send_mr.slot != UINT32_MAX) engine.dereg_mr(b->send_mr);
    }
  }
  bool cuda() const { return cfg.side == KernelSide::kCuda; }

  // For the metrics source, on the thread reading the metrics: what the sets' proxies and signal
  // words say now (read only; the sets and proxies do not change after construction).
  MoeReading read_metrics() const {
    MoeReading r;
    r.failed = stats.failed.load(std::memory_order_relaxed);
    for (const auto& b : sets) {
      if (b->proxy) {
        const ProxyStats p = b->proxy->stats();
        r.proxy_dispatches += b->proxy->dispatch_steps();
        r.proxy.steps += p.steps, r.proxy.writes += p.writes, r.proxy.bytes += p.bytes, r.proxy.cpu_ms += p.cpu_ms;
        r.proxy.dispatch_wait_ms += p.dispatch_wait_ms, r.proxy.combine_wait_ms += p.combine_wait_ms;
      }
      r.failed |= b->signal(lay.signals.kernel_error).load(std::memory_order_relaxed) != 0 ||
                  b->signal(lay.signals.failed).load(std::memory_order_relaxed) != 0;
    }
    for (uint32_t rank = 0; rank < cfg.ranks; ++rank)  // masked in any set (share_masks spreads it at the next call)
      r.masked += std::any_of(sets.begin(), sets.end(), [&](const auto& b) {
        return b->signal(signal_at(lay.signals.mask, rank)).load(std::memory_order_relaxed) != 0;
      });
    return r;
  }

  void allocate(BufferSet& b, uint32_t index) {
    if (cuda()) {
      b.node = cuda_node_region(lay.node.bytes);
      const bool on_device = cfg.rdma_buffers == RdmaBuffers::kDevice;
      b.recv = on_device ? device_block(lay.recv.bytes) : pinned_block(lay.recv.bytes);
      b.send = on_device ? device_block(lay.send.bytes) : pinned_block(lay.send.bytes);
      b.signals = std::make_shared<Block>(pinned_block(lay.signals.bytes));
      b.local = device_block(lay.local.bytes);
      b.out = device_block(lay.out.bytes);
    } else {
      b.node = host_node_region(lay.node.bytes, fmt::format("{}.{}", cfg.job, index), cfg.rank);
      b.recv = host_block(lay.recv.bytes);
      b.send = host_block(lay.send.bytes);
      b.signals = std::make_shared<Block>(host_block(lay.signals.bytes));
      b.local = host_block(lay.local.bytes);
      b.out = host_block(lay.out.bytes);
    }
  }

  // Host pointers for the proxy and host kernels, device pointers for CUDA kernels.
  Views make_views(const BufferSet& b, bool device) const {
    Views v;
    v.lay = lay;
    v.rank = cfg.rank;
    v.timeout_ns = static_cast<uint64_t>(std::chrono::nanoseconds(cfg.timeout).count());
    v.max_blocks = device && cuda() ? cuda::blocks_per_half(cfg.num_sms) : 0;
    v.shrink = cfg.shrink;
    auto pick = [device](const Block& blk) {
      return device && blk.device() ? blk.device() : blk.host();
    };
    v.recv = pick(b.recv);
    v.send = pick(b.send);
    v.signals = pick(*b.signals);
    v.local = pick(b.local);
    v.out = pick(b.out);
    return v;
  }

  // Every call first reports an earlier failure: a host receive half's, a CUDA kernel's (it
  // gave up on the device, after the call that enqueued it returned) or a proxy's.
  void check_before(const char* what) const {
    // A failure already reported to the caller comes first: the proxy's expectations for the
    // same missing rank may time out a moment after the receive half did, and the next call
    // must say the same thing whichever came first.
    if (failed)
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("MoE {} on rank {}: this AllToAll failed earlier; build a new one "
                              "(with the job's live ranks)",
                              what, cfg.rank));
    for (const auto& b : sets) {
      const uint64_t kernel = b->signal(lay.signals.kernel_error).load(std::memory_order_acquire);
      if (kernel != 0) throw kernel_failure(kernel);
      if (b->signal(lay.signals.failed).load(std::memory_order_acquire) != 0)
        throw Error(ErrorCode::kProvider,
                    fmt::format("MoE {} on rank {}: a transfer or expectation of the proxy failed "
                                "earlier (see the log); build a new "
                                "AllToAll (with the job's live ranks)",
                                what, cfg.rank));
    }
  }

  Error kernel_failure(uint64_t kernel) const {
    const auto what = static_cast<KernelError>(kernel >> 32);
    const uint64_t who = kernel & 0xFFFFFFFFu;
    switch (what) {
      case KernelError::kDispatchTimeout:
      case KernelError::kCombineTimeout:
        return Error(
            ErrorCode::kTimeout,
            fmt::format("MoE {} receive on rank {}: rows from {} missing after {} ms (peer dead or "
                        "stalled?); its outputs are "
                        "marked invalid and this AllToAll is failed",
                        what == KernelError::kDispatchTimeout ? "dispatch" : "combine", cfg.rank,
                        who == 0 ? std::string("some rank") : fmt::format("rank {}", who - 1),
                        cfg.timeout.count()));
      case KernelError::kBadExpert:
        return Error(ErrorCode::kInvalidArgument,
                     fmt::format("MoE dispatch on rank {}: an expert index was >= experts {} or "
                                 "repeated within a token (those slots "
                                 "were dropped)",
                                 cfg.rank, cfg.experts));
      case KernelError::kStaleRow:
        return Error(ErrorCode::kMalformed,
                     fmt::format("MoE dispatch on rank {}: a row from rank {} carried another step",
                                 cfg.rank, who - 1));
      default:
        return Error(
            ErrorCode::kProvider,
            fmt::format("MoE on rank {}: a kernel gave up (error word {:#x})", cfg.rank, kernel));
    }
  }

  std::atomic<uint64_t>& mask_word(BufferSet& b, uint32_t rank) const {
    return *reinterpret_cast<std::atomic<uint64_t>*>(b.signals->host() + signal_at(lay.signals.mask, rank));
  }
  // Shrink mode: a rank one buffer set masked is masked in all (each set has its own words, which
  // its receive halves and proxy set).
  void share_masks() {
    if (!cfg.shrink) return;
    for (uint32_t r = 0; r < cfg.ranks; ++r) {
      const bool any = std::any_of(sets.begin(), sets.end(), [&](const auto& b) { return mask_word(*b, r).load() != 0; });
      if (any)
        for (auto& b : sets) mask_word(*b, r).store(1, std::memory_order_release);
    }
  }

  // The set a handle names, once the handle is one of this AllToAll's, not spent, and at `want`.
  BufferSet& set_of(const Handle& h, Phase want, const char* what) {
    check_before(what);
    share_masks();
    const uint32_t B = cfg.buffers;
    if (h.step == 0 || h.step > dispatches || h.buffer >= B || (h.step - 1) % B != h.buffer)
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("MoE {} on rank {}: not a handle of this AllToAll (dispatch {}, "
                              "buffer set {}; {} dispatches so far)",
                              what, cfg.rank, h.step, h.buffer, dispatches));
    BufferSet& b = *sets[h.buffer];
    if (h.step != b.handle)
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("MoE {} on rank {}: the handle of dispatch {} is spent (dispatch {} took its "
                              "buffer set {}: a handle is valid until its set is taken, {} dispatches later)",
                              what, cfg.rank, h.step, b.handle, h.buffer, cfg.buffers));
    if (b.phase != want)
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("MoE {} on rank {}: out of order for dispatch {} (it is at '{}'; "
                              "each handle goes dispatch send, "
                              "dispatch receive, combine send, combine receive)",
                              what, cfg.rank, h.step, phase_name(b.phase)));
    return b;
  }

  // RdmaBuffers::kDevice through the cuda_ipc domain: the proxy's WRITEs are GPU copies on the
  // engine's streams, issued while this rank's receive kernel spins with the rest of its step
  // queued behind it. CUDA maps a process's streams onto CUDA_DEVICE_MAX_CONNECTIONS hardware
  // queues (8 by default), and a copy whose stream shares a queue with that queued work waits
  // behind it: every rank then waits for the timeout (docs/benchmarks.md, "MoE dispatch/combine";
  // the full account, "The node boundary in device memory", is in `git show
  // 788bf4b:docs/benchmarks.md`). 16 queues ran twenty back-to-back graph replays of 4 ranks
  // exactly where 8 failed every time; say so before a user finds out by a timeout.
  void warn_if_few_hardware_queues() const {
    const std::vector<NicStats> nics = engine.nic_stats();
    if (std::none_of(nics.begin(), nics.end(), [](const NicStats& n) { return n.nic == "cuda_ipc"; })) return;
    const char* v = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
    const long queues = v ? std::strtol(v, nullptr, 10) : 8;
    if (queues >= 16) return;
    log::warn("MoE on rank {}: rdma_buffers kDevice with {} CUDA hardware queues per process "
              "(CUDA_DEVICE_MAX_CONNECTIONS{}): the engine's cuda_ipc copies can queue behind this rank's "
              "waiting kernels and fail steps with a timeout; set CUDA_DEVICE_MAX_CONNECTIONS=16 before "
              "CUDA starts (docs/api.md)",
              cfg.rank, queues, v ? fmt::format("={}", v) : std::string(" unset"));
  }

  // RdmaBuffers::kDevice: one small WRITE to every remote rank's receive region of every set
  // (zeros into this rank's own counts row there, which only this rank writes), waited for
  // here. The engine maps a peer's GPU memory at its first WRITE (cudaIpcOpenMemHandle for
  // cuda_ipc), and that must not wait behind a receive kernel spinning on the device.
  void open_remote_regions() {
    std::vector<std::unique_ptr<std::atomic<int>>> flags;
    for (auto& b : sets)
      for (uint32_t r = 0; r < cfg.ranks; ++r) {
        if (r == cfg.rank || lay.dims.same_node(r, cfg.rank)) continue;
        flags.push_back(std::make_unique<std::atomic<int>>(kDonePending));
        engine.submit(SingleWrite{.len = 4,
                                  .src = {b->send_mr, lay.send.route_row},
                                  .dst = {b->remotes[r], lay.recv.routing + 4ull * cfg.rank * cfg.experts}},
                      OnDone::flag(flags.back().get()));
      }
    const auto deadline = std::chrono::steady_clock::now() + cfg.timeout;
    for (auto& f : flags) {
      while (f->load(std::memory_order_acquire) == kDonePending) {
        if (std::chrono::steady_clock::now() > deadline)
          throw Error(ErrorCode::kTimeout, fmt::format("MoE on rank {}: the first WRITEs into the other nodes' device memory did not "
                                                       "complete within {} ms",
                                                       cfg.rank, cfg.timeout.count()));
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
      if (f->load() != kDoneSucceeded)
        throw Error(ErrorCode::kProvider,
                    fmt::format("MoE on rank {}: a WRITE into another node's device memory failed (see the log): can this engine "
                                "reach the peers' GPU memory (EngineConfig::cuda_ipc and cuda_device on one host, a NIC with "
                                "FI_HMEM elsewhere)?",
                                cfg.rank));
    }
  }

  // What the combine receive of a handle needs from its caller (a dispatch of no tokens: nothing).
  void check_combine_out(const BufferSet& b, const CombineArgs& args, const char* what) const {
    if (b.tokens > 0 && (!args.out || !args.topk_weights))
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("MoE {}: out and topk_weights [{}][{}] must be given", what, b.tokens,
                              cfg.topk));
  }

  // Runs a host receive half; a failure marks its outputs invalid and fails the AllToAll.
  template <typename F, typename Mark>
  void guarded(F&& f, Mark&& mark) {
    try {
      f();
    } catch (const Error& e) {
      if (e.code() == ErrorCode::kTimeout) stats.timeouts.add();
      fail(mark);
      throw;
    } catch (...) {
      fail(mark);
      throw;
    }
  }
  template <typename Mark>
  void fail(Mark&& mark) {
    failed = true;
    stats.failed.store(true, std::memory_order_relaxed);
    mark();
  }
};

AllToAll::AllToAll(TransferEngine& engine, AllToAllConfig config, const AllGather& all_gather) {
  check_config(config);
  impl_ = std::make_unique<Impl>(engine, std::move(config));
  Impl& s = *impl_;
  const AllToAllConfig& c = s.cfg;
  Dims d;
  d.ranks = c.ranks, d.node_size = c.node_size, d.experts = c.experts,
  d.local_experts = c.experts / c.ranks;
  d.topk = c.topk, d.hidden = c.hidden, d.max_tokens = c.max_tokens,
  d.private_rows = c.private_rows;
  d.fp8 = c.dispatch_dtype == Dtype::kFp8;
  s.lay = make_layout(d);
  if (s.cuda()) cuda::prepare_kernels(d);
  const bool remote = c.ranks > c.node_size;
  Blob mine;
  mine.dims = dims_of(c);
  for (uint32_t i = 0; i < c.buffers; ++i) {
    s.sets.push_back(std::make_unique<BufferSet>());
    BufferSet& b = *s.sets.back();
    s.allocate(b, i);
    mine.node_handle.push_back(b.node->handle());
    mine.recv_desc.emplace_back();
    if (!remote) continue;
    const std::optional<uint32_t> base =
        c.imm_base ? std::optional<uint32_t>(*c.imm_base + (i << kMoeImmBits)) : std::nullopt;
    b.imms = engine.reserve_imms(
        {.holder = fmt::format("moe all-to-all: job {} rank {} buffer set {}", c.job, c.rank, i),
         .bits = kMoeImmBits,
         .base = base});
    // Device memory has no host address: it is registered by its device address.
    const bool on_device = c.rdma_buffers == RdmaBuffers::kDevice;
    const Device where = on_device ? Device::cuda(c.cuda_device) : Device::host();
    std::byte* recv_at = on_device ? b.recv.device() : b.recv.host();
    std::byte* send_at = on_device ? b.send.device() : b.send.host();
    auto [recv_mr, recv_desc] = engine.reg_mr(recv_at, b.recv.len(), where, b.imms);
    b.recv_mr = recv_mr;
    b.send_mr = engine.reg_mr(send_at, b.send.len(), where).first;
    mine.recv_desc.back() = recv_desc.to_bytes();
  }
  const std::vector<std::vector<std::byte>> all = all_gather(encode(mine));
  if (all.size() != c.ranks)
    throw Error(
        ErrorCode::kInvalidArgument,
        fmt::format("MoE: the all-gather returned {} entries for {} ranks", all.size(), c.ranks));
  std::vector<Blob> blobs;
  for (uint32_t r = 0; r < c.ranks; ++r) {
    blobs.push_back(decode(all[r], r));
    if (blobs[r].dims != mine.dims)
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("MoE: rank {} was built with other dimensions than rank {} (ranks, "
                              "node_size, experts, topk, hidden, "
                              "max_tokens, dtype, private_rows, kernel side, buffers, shrink differ)",
                              r, c.rank));
  }
  const uint32_t first = c.rank / c.node_size * c.node_size;
  std::vector<Views> hosts;
  for (uint32_t i = 0; i < c.buffers; ++i) {
    BufferSet& b = *s.sets[i];
    Views host = s.make_views(b, false), device = s.make_views(b, true);
    for (uint32_t j = 0; j < c.node_size; ++j) {
      std::byte* p =
          first + j == c.rank ? b.node->own() : b.node->open(blobs[first + j].node_handle[i]);
      host.node[j] = device.node[j] = p;
    }
    if (remote) {
      b.remotes.assign(c.ranks, RemoteMr{});
      for (uint32_t r = 0; r < c.ranks; ++r)
        if (r != c.rank)
          b.remotes[r] = engine.add_remote(MrDesc::from_bytes(blobs[r].recv_desc[i]));
    }
    b.views = s.cuda() ? device : host;
    hosts.push_back(host);
  }
  if (remote && c.rdma_buffers == RdmaBuffers::kDevice) {
    s.warn_if_few_hardware_queues();
    s.open_remote_regions();
  }
  all_gather({});  // every node-mate has mapped our node regions: their names can go
  for (uint32_t i = 0; i < c.buffers; ++i) {
    BufferSet& b = *s.sets[i];
    b.node->seal();
    if (!remote) continue;
    b.proxy = std::make_unique<Proxy>(engine, ProxyConfig{.views = hosts[i],
                                                          .signals = b.signals,
                                                          .send_mr = b.send_mr,
                                                          .imms = &b.imms,
                                                          .recv = b.remotes,
                                                          .busy_poll = c.proxy_busy_poll});
  }
  s.metrics = engine.add_metrics_source([&s](MetricsWriter& w) { write_metrics(w, s.stats, s.read_metrics(), s.cfg); });
}

AllToAll::~AllToAll() = default;

Handle AllToAll::dispatch_send(const DispatchArgs& args) {
  Impl& s = *impl_;
  s.check_before("dispatch send");
  s.share_masks();
  const uint32_t index = static_cast<uint32_t>(s.dispatches % s.cfg.buffers);
  BufferSet& b = *s.sets[index];
  // The dispatch holding the set goes, combined or not, as DeepEP drops it: its set is reused
  // (every rank makes the same calls, so every rank's set moves on at once), and its handle is
  // refused from now on. One whose receive or combine is under way still owns the set: its peers'
  // rows may still be landing there.
  if (b.phase == Phase::kDispatchSent || b.phase == Phase::kCombineSent)
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("MoE dispatch send on rank {}: at most {} dispatches in flight "
                            "(buffers = {}); dispatch {} holds buffer set {} at '{}': {} first",
                            s.cfg.rank, s.cfg.buffers, s.cfg.buffers, b.handle, index, phase_name(b.phase),
                            b.phase == Phase::kDispatchSent ? "receive it (dispatch_recv, or its hook)"
                                                            : "receive its combine (combine_recv, or its hook)"));
  const auto t0 = std::chrono::steady_clock::now();
  if (s.cuda()) {
    cuda::dispatch_send(b.views, args);
  } else {
    host::check_dispatch_args(s.lay.dims, args);  // refused input changes nothing
    s.guarded([&] { host::dispatch_send(b.views, args, b.step + 1); }, [] {});
  }
  b.send_time = std::chrono::steady_clock::now() - t0;
  s.stats.dispatches.add();
  ++b.step;
  b.handle = ++s.dispatches;
  b.tokens = args.num_tokens;
  b.phase = Phase::kDispatchSent;
  return Handle{.buffer = index, .step = b.handle, .num_tokens = args.num_tokens};
}

void AllToAll::dispatch_recv(const Handle& h, void* stream, int64_t* wait_ns) {
  Impl& s = *impl_;
  BufferSet& b = s.set_of(h, Phase::kDispatchSent, "dispatch receive");
  if (s.cuda()) {
    cuda::dispatch_recv(b.views, stream, wait_ns);
  } else {
    const auto t0 = std::chrono::steady_clock::now();
    s.guarded([&] { host::dispatch_recv(b.views, b.step, wait_ns); },
              [&] { host::mark_dispatch_failed(b.views); });
    s.stats.dispatch_seconds.observe(b.send_time + (std::chrono::steady_clock::now() - t0));
  }
  b.phase = Phase::kDispatched;
}

void AllToAll::combine_send(const Handle& h, const CombineArgs& args) {
  Impl& s = *impl_;
  BufferSet& b = s.set_of(h, Phase::kDispatched, "combine send");
  if (!args.expert_out)
    throw Error(ErrorCode::kInvalidArgument, "MoE combine send: expert_out must be given");
  const auto t0 = std::chrono::steady_clock::now();
  if (s.cuda())
    cuda::combine_send(b.views, args);
  else
    s.guarded([&] { host::combine_send(b.views, args, b.combines + 1); }, [] {});
  b.send_time = std::chrono::steady_clock::now() - t0;
  s.stats.combines.add();
  ++b.combines;
  b.phase = Phase::kCombineSent;
}

void AllToAll::combine_recv(const Handle& h, const CombineArgs& args) {
  Impl& s = *impl_;
  BufferSet& b = s.set_of(h, Phase::kCombineSent, "combine receive");
  s.check_combine_out(b, args, "combine receive");
  if (s.cuda()) {
    cuda::combine_recv(b.views, args);
  } else {
    const auto t0 = std::chrono::steady_clock::now();
    s.guarded([&] { host::combine_recv(b.views, args, b.combines); },
              [&] { host::mark_combine_failed(b.views, args); });
    s.stats.combine_seconds.observe(b.send_time + (std::chrono::steady_clock::now() - t0));
  }
  b.phase = Phase::kDispatched;  // combined; it may be combined again (DeepEP's test does) until its set is taken
}

Handle AllToAll::dispatch(const DispatchArgs& args) {
  const Handle h = dispatch_send(args);
  dispatch_recv(h, args.stream);
  return h;
}

void AllToAll::combine(const Handle& h, const CombineArgs& args) {
  // Both halves' checks first, so a refused call sends nothing.
  Impl& s = *impl_;
  const BufferSet& b = s.set_of(h, Phase::kDispatched, "combine");
  s.check_combine_out(b, args, "combine");
  combine_send(h, args);
  combine_recv(h, args);
}

DispatchOutput AllToAll::output(const Handle& h) const {
  const Impl& s = *impl_;
  if (h.buffer >= s.sets.size())
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("MoE output: buffer set {} of {}", h.buffer, s.sets.size()));
  const Layout& l = s.lay;
  std::byte* out = s.sets[h.buffer]->views.out;
  return DispatchOutput{
      .x = out + l.out.x,
      .scales = l.dims.fp8 ? reinterpret_cast<float*>(out + l.out.scales) : nullptr,
      .counts = reinterpret_cast<int32_t*>(out + l.out.counts),
      .src = reinterpret_cast<int32_t*>(out + l.out.src),
      .runs = reinterpret_cast<int64_t*>(out + l.out.runs),
      .local_experts = l.dims.local_experts,
      .rows_per_expert = l.dims.rows_per_expert()};
}

void AllToAll::check() const { impl_->check_before("check"); }

std::vector<uint32_t> AllToAll::masked_ranks() const {
  Impl& s = *impl_;
  s.share_masks();
  std::vector<uint32_t> out;
  for (uint32_t r = 0; r < s.cfg.ranks; ++r)
    if (s.mask_word(*s.sets[0], r).load(std::memory_order_acquire) != 0) out.push_back(r);
  return out;
}

void AllToAll::set_masked(uint32_t rank, bool masked) {
  Impl& s = *impl_;
  if (!s.cfg.shrink)
    throw Error(ErrorCode::kInvalidArgument, "MoE set_masked: this AllToAll was built without shrink mode");
  if (rank >= s.cfg.ranks)
    throw Error(ErrorCode::kInvalidArgument, fmt::format("MoE set_masked: rank {} of {}", rank, s.cfg.ranks));
  for (auto& b : s.sets) s.mask_word(*b, rank).store(masked ? 1 : 0, std::memory_order_release);
}

ProxyStats AllToAll::proxy_stats() const {
  ProxyStats sum;
  for (const auto& b : impl_->sets) {
    if (!b->proxy) continue;
    const ProxyStats one = b->proxy->stats();
    sum.steps += one.steps, sum.writes += one.writes, sum.bytes += one.bytes, sum.cpu_ms += one.cpu_ms;
    sum.dispatch_wait_ms += one.dispatch_wait_ms, sum.combine_wait_ms += one.combine_wait_ms;
  }
  return sum;
}
const AllToAllConfig& AllToAll::config() const { return impl_->cfg; }

}  // namespace fabric::moe
