// AllToAll (include/fabric/moe/all_to_all.h): allocates and shares the buffers once, then runs each half on
// the chosen kernel side, in the order dispatch send, dispatch receive, combine send, combine
// receive.
#include <fmt/format.h>

#include <cstring>

#include "fabric/error.h"
#include "fabric/moe/all_to_all.h"
#include "kernel_side.h"
#include "memory.h"
#include "proxy.h"

namespace fabric::moe {

using namespace detail;

namespace {

enum class Phase { kIdle, kDispatchSent, kDispatched, kCombineSent };

constexpr uint32_t kBlobMagic = 0x4D6F4531;  // "MoE1"

void fail_config(const std::string& what) {
  throw Error(ErrorCode::kInvalidArgument, "AllToAllConfig: " + what);
}

void check_config(const AllToAllConfig& c) {
  if (c.ranks == 0 || c.ranks > (1u << 16)) fail_config(fmt::format("ranks {} (1 to 65536)", c.ranks));
  if (c.rank >= c.ranks) fail_config(fmt::format("rank {} of {} ranks", c.rank, c.ranks));
  if (c.node_size == 0 || c.node_size > kMaxNodeSize || c.ranks % c.node_size != 0)
    fail_config(fmt::format("node_size {}: 1 to {} and dividing ranks {}", c.node_size, kMaxNodeSize, c.ranks));
  if (c.experts == 0 || c.experts % c.ranks != 0)
    fail_config(fmt::format("experts {}: a positive multiple of ranks {}", c.experts, c.ranks));
  if (c.topk == 0 || c.topk > 8) fail_config(fmt::format("topk {} (1 to 8)", c.topk));
  if (c.hidden == 0 || c.hidden % kScaleBlock != 0) fail_config(fmt::format("hidden {}: a positive multiple of 128", c.hidden));
  if (c.max_tokens == 0) fail_config("max_tokens 0");
  if (c.timeout.count() <= 0) fail_config("timeout must be positive");
  if (c.job.empty() || c.job.size() > 64 ||
      c.job.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-") != std::string::npos)
    fail_config(fmt::format("job '{}': 1 to 64 of [A-Za-z0-9_.-]", c.job));
}

// What every rank publishes: the dimensions (all ranks must agree), its receive region and the
// handle of its node region.
struct Blob {
  std::array<uint32_t, 9> dims{};
  std::vector<uint8_t> recv_desc;
  std::vector<std::byte> node_handle;
};

std::array<uint32_t, 9> dims_of(const AllToAllConfig& c) {
  return {c.ranks, c.node_size, c.experts, c.topk, c.hidden, c.max_tokens, static_cast<uint32_t>(c.dispatch_dtype),
          c.private_rows, static_cast<uint32_t>(c.side)};
}

template <typename T>
void put(std::vector<std::byte>& out, const T& v) {
  const size_t at = out.size();
  out.resize(at + sizeof v);  // never empty after this: memcpy gets a valid pointer
  std::memcpy(out.data() + at, &v, sizeof v);
}

std::vector<std::byte> encode(const Blob& b) {
  std::vector<std::byte> out;
  put(out, kBlobMagic);
  put(out, b.dims);
  put(out, static_cast<uint32_t>(b.recv_desc.size()));
  for (uint8_t x : b.recv_desc) out.push_back(std::byte{x});
  put(out, static_cast<uint32_t>(b.node_handle.size()));
  out.insert(out.end(), b.node_handle.begin(), b.node_handle.end());
  return out;
}

Blob decode(const std::vector<std::byte>& in, uint32_t rank) {
  size_t at = 0;
  auto take = [&](void* dst, size_t n) {
    if (at + n > in.size()) throw Error(ErrorCode::kMalformed, fmt::format("MoE: rank {}'s published bytes are truncated", rank));
    if (n == 0) return;
    std::memcpy(dst, in.data() + at, n);
    at += n;
  };
  uint32_t magic = 0, n = 0;
  take(&magic, 4);
  if (magic != kBlobMagic) throw Error(ErrorCode::kMalformed, fmt::format("MoE: rank {} published something else than an AllToAll", rank));
  Blob b;
  take(b.dims.data(), sizeof b.dims);
  take(&n, 4);
  b.recv_desc.resize(n);
  take(b.recv_desc.data(), n);
  take(&n, 4);
  b.node_handle.resize(n);
  take(b.node_handle.data(), n);
  if (at != in.size()) throw Error(ErrorCode::kMalformed, fmt::format("MoE: rank {}'s published bytes are too long", rank));
  return b;
}

}  // namespace

struct AllToAll::Impl {
  TransferEngine& engine;
  AllToAllConfig cfg;
  Layout lay;
  std::unique_ptr<NodeRegion> node;
  Block recv, send, local, out;
  std::shared_ptr<Block> signals;
  ImmReservation imms;  // the receive region's immediates (two nodes or more)
  MrHandle recv_mr{}, send_mr{};
  std::vector<RemoteMr> remotes;  // [W]: interned receive regions of the other nodes' ranks
  Views views;                    // what the kernel side uses
  std::unique_ptr<Proxy> proxy;
  Phase phase = Phase::kIdle;
  uint64_t step = 0;
  uint32_t tokens = 0;  // of the last dispatch
  bool failed = false;

  Impl(TransferEngine& e, AllToAllConfig c) : engine(e), cfg(std::move(c)) {}
  ~Impl() {
    proxy.reset();  // no more submits or expectations
    for (RemoteMr r : remotes)
      if (r.slot != UINT32_MAX) engine.remove_remote(r);
    if (recv_mr.slot != UINT32_MAX) engine.dereg_mr(recv_mr);
    if (send_mr.slot != UINT32_MAX) engine.dereg_mr(send_mr);
  }
  bool cuda() const { return cfg.side == KernelSide::kCuda; }
  const std::atomic<uint64_t>& signal(uint64_t offset) const {
    return *reinterpret_cast<const std::atomic<uint64_t>*>(signals->host() + offset);
  }

  void allocate() {
    if (cuda()) {
      node = cuda_node_region(lay.node.bytes);
      recv = pinned_block(lay.recv.bytes);
      send = pinned_block(lay.send.bytes);
      signals = std::make_shared<Block>(pinned_block(lay.signals.bytes));
      local = device_block(lay.local.bytes);
      out = device_block(lay.out.bytes);
    } else {
      node = host_node_region(lay.node.bytes, cfg.job, cfg.rank);
      recv = host_block(lay.recv.bytes);
      send = host_block(lay.send.bytes);
      signals = std::make_shared<Block>(host_block(lay.signals.bytes));
      local = host_block(lay.local.bytes);
      out = host_block(lay.out.bytes);
    }
  }

  // Host pointers for the proxy and host kernels, device pointers for CUDA kernels.
  Views make_views(bool device) const {
    Views v;
    v.lay = lay;
    v.rank = cfg.rank;
    v.timeout_ns = static_cast<uint64_t>(std::chrono::nanoseconds(cfg.timeout).count());
    auto pick = [device](const Block& b) { return device && b.device() ? b.device() : b.host(); };
    v.recv = pick(recv);
    v.send = pick(send);
    v.signals = pick(*signals);
    v.local = pick(local);
    v.out = pick(out);
    return v;
  }

  void check_usable(const char* what) const {
    if (failed)
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("MoE {} on rank {}: this AllToAll failed earlier; build a new one (with the job's live ranks)", what, cfg.rank));
  }
  void expect_phase(Phase want, const char* what) const {
    check_usable(what);
    if (phase != want)
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("MoE {} on rank {}: out of order (calls go dispatch send, dispatch receive, combine send, combine receive)",
                              what, cfg.rank));
  }
  // Runs a host receive half; a failure fails the AllToAll.
  template <typename F>
  void guarded(F&& f) {
    try {
      f();
    } catch (...) {
      failed = true;
      throw;
    }
  }
};

AllToAll::AllToAll(TransferEngine& engine, AllToAllConfig config, const AllGather& all_gather) {
  check_config(config);
  impl_ = std::make_unique<Impl>(engine, std::move(config));
  Impl& s = *impl_;
  const AllToAllConfig& c = s.cfg;
  Dims d;
  d.ranks = c.ranks, d.node_size = c.node_size, d.experts = c.experts, d.local_experts = c.experts / c.ranks;
  d.topk = c.topk, d.hidden = c.hidden, d.max_tokens = c.max_tokens, d.private_rows = c.private_rows;
  d.fp8 = c.dispatch_dtype == Dtype::kFp8;
  s.lay = make_layout(d);
  s.allocate();
  const bool remote = c.ranks > c.node_size;
  Blob mine;
  mine.dims = dims_of(c);
  mine.node_handle = s.node->handle();
  if (remote) {
    s.imms = engine.reserve_imms({.holder = fmt::format("moe all-to-all: job {} rank {}", c.job, c.rank),
                                  .bits = kMoeImmBits,
                                  .base = c.imm_base});
    auto [recv_mr, recv_desc] = engine.reg_mr(s.recv.host(), s.recv.len(), Device::host(), s.imms);
    s.recv_mr = recv_mr;
    s.send_mr = engine.reg_mr(s.send.host(), s.send.len()).first;
    mine.recv_desc = recv_desc.to_bytes();
  }
  const std::vector<std::vector<std::byte>> all = all_gather(encode(mine));
  if (all.size() != c.ranks)
    throw Error(ErrorCode::kInvalidArgument, fmt::format("MoE: the all-gather returned {} entries for {} ranks", all.size(), c.ranks));
  std::vector<Blob> blobs;
  for (uint32_t r = 0; r < c.ranks; ++r) {
    blobs.push_back(decode(all[r], r));
    if (blobs[r].dims != mine.dims)
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("MoE: rank {} was built with other dimensions than rank {} (ranks, node_size, experts, topk, hidden, "
                              "max_tokens, dtype, private_rows, kernel side differ)",
                              r, c.rank));
  }
  Views host = s.make_views(false), device = s.make_views(true);
  const uint32_t first = c.rank / c.node_size * c.node_size;
  for (uint32_t i = 0; i < c.node_size; ++i) {
    std::byte* p = first + i == c.rank ? s.node->own() : s.node->open(blobs[first + i].node_handle);
    host.node[i] = device.node[i] = p;
  }
  if (remote) {
    s.remotes.assign(c.ranks, RemoteMr{});
    for (uint32_t r = 0; r < c.ranks; ++r)
      if (r != c.rank) s.remotes[r] = engine.add_remote(MrDesc::from_bytes(blobs[r].recv_desc));
  }
  all_gather({});  // every node-mate has mapped our node region: its name can go
  s.node->seal();
  s.views = s.cuda() ? device : host;
  if (remote)
    s.proxy = std::make_unique<Proxy>(engine, ProxyConfig{.views = host, .signals = s.signals, .send_mr = s.send_mr,
                                                           .imms = &s.imms, .recv = s.remotes, .busy_poll = c.proxy_busy_poll});
}

AllToAll::~AllToAll() = default;

void AllToAll::dispatch(const DispatchArgs& args, bool do_send, bool do_recv) {
  Impl& s = *impl_;
  if (do_send) {
    s.expect_phase(Phase::kIdle, "dispatch send");
    if (s.cuda()) {
      cuda::dispatch_send(s.views, args);
    } else {
      host::check_dispatch_args(s.lay.dims, args);  // refused input changes nothing
      s.guarded([&] { host::dispatch_send(s.views, args, s.step + 1); });
    }
    ++s.step;
    s.tokens = args.num_tokens;
    s.phase = Phase::kDispatchSent;
  }
  if (do_recv) {
    s.expect_phase(Phase::kDispatchSent, "dispatch receive");
    if (s.cuda()) cuda::dispatch_recv(s.views, args.stream);
    else s.guarded([&] { host::dispatch_recv(s.views, s.step); });
    s.phase = Phase::kDispatched;
  }
}

void AllToAll::combine(const CombineArgs& args, bool do_send, bool do_recv) {
  Impl& s = *impl_;
  if (do_send) {
    s.expect_phase(Phase::kDispatched, "combine send");
    if (!args.expert_out) throw Error(ErrorCode::kInvalidArgument, "MoE combine: expert_out must be given");
    if (s.cuda()) cuda::combine_send(s.views, args);
    else s.guarded([&] { host::combine_send(s.views, args, s.step); });
    s.phase = Phase::kCombineSent;
  }
  if (do_recv) {
    s.expect_phase(Phase::kCombineSent, "combine receive");
    if (!args.out && s.tokens > 0) throw Error(ErrorCode::kInvalidArgument, "MoE combine: out must be given");
    if (s.cuda()) cuda::combine_recv(s.views, args);
    else s.guarded([&] { host::combine_recv(s.views, args, s.step); });
    s.phase = Phase::kIdle;
  }
}

DispatchOutput AllToAll::output() const {
  const Impl& s = *impl_;
  const Layout& l = s.lay;
  std::byte* out = s.views.out;
  return DispatchOutput{.x = out + l.out.x,
                        .scales = l.dims.fp8 ? reinterpret_cast<float*>(out + l.out.scales) : nullptr,
                        .counts = reinterpret_cast<int32_t*>(out + l.out.counts),
                        .src = reinterpret_cast<int32_t*>(out + l.out.src),
                        .local_experts = l.dims.local_experts,
                        .rows_per_expert = l.dims.rows_per_expert()};
}

void AllToAll::check() const {
  const Impl& s = *impl_;
  const uint64_t kernel = s.signal(s.lay.signals.kernel_error).load(std::memory_order_acquire);
  if (kernel != 0) {
    const auto what = static_cast<KernelError>(kernel >> 32);
    const uint64_t who = kernel & 0xFFFFFFFFu;
    switch (what) {
      case KernelError::kDispatchTimeout:
      case KernelError::kCombineTimeout:
        throw Error(ErrorCode::kTimeout, fmt::format("MoE {} receive on rank {}: rows from {} missing after {} ms (peer dead or stalled?)",
                                                     what == KernelError::kDispatchTimeout ? "dispatch" : "combine", s.cfg.rank,
                                                     who == 0 ? std::string("some rank") : fmt::format("rank {}", who - 1),
                                                     s.cfg.timeout.count()));
      case KernelError::kBadExpert:
        throw Error(ErrorCode::kInvalidArgument,
                    fmt::format("MoE dispatch on rank {}: an expert index was >= experts {} or repeated within a token (those slots were dropped)",
                                s.cfg.rank, s.cfg.experts));
      case KernelError::kStaleRow:
        throw Error(ErrorCode::kMalformed, fmt::format("MoE dispatch on rank {}: a row from rank {} carried another step", s.cfg.rank, who - 1));
      default:
        throw Error(ErrorCode::kProvider, fmt::format("MoE on rank {}: a kernel gave up (error word {:#x})", s.cfg.rank, kernel));
    }
  }
  if (s.signal(s.lay.signals.failed).load(std::memory_order_acquire) != 0)
    throw Error(ErrorCode::kProvider, fmt::format("MoE on rank {}: a transfer or expectation of the proxy failed (see the log)", s.cfg.rank));
  s.check_usable("check");
}

ProxyStats AllToAll::proxy_stats() const { return impl_->proxy ? impl_->proxy->stats() : ProxyStats{}; }
const AllToAllConfig& AllToAll::config() const { return impl_->cfg; }

}  // namespace fabric::moe
