// The MoE host proxy (proxy.h).
#include "proxy.h"

#include <algorithm>
#include <chrono>

#include "util/idle.h"
#include "util/log.h"

namespace fabric::moe::detail {

namespace {

uint64_t now_ns() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}

}  // namespace

std::atomic<uint64_t>& Proxy::signal(uint64_t offset) const {
  return *reinterpret_cast<std::atomic<uint64_t>*>(cfg_.views.signals + offset);
}

Proxy::Proxy(TransferEngine& engine, ProxyConfig config)
    : engine_(engine), cfg_(std::move(config)), dims_(cfg_.views.lay.dims) {
  const Layout& l = cfg_.views.lay;
  const uint32_t me = cfg_.views.rank;
  std::vector<RemoteMr> others, remotes;
  for (uint32_t s = 0; s < dims_.ranks; ++s) {
    if (s == me) continue;
    others_.push_back(s);
    others.push_back(cfg_.recv[s]);
    if (!dims_.same_node(s, me)) {
      remotes_.push_back(s);
      remotes.push_back(cfg_.recv[s]);
    }
  }
  others_group_ = engine_.add_peer_group(others);
  remotes_group_ = engine_.add_peer_group(remotes);
  // The counts row goes to the same place of every other rank each step.
  route_slices_.assign(others_.size(), GroupSlice{.len = 4ull * dims_.experts,
                                                  .src_offset = l.send.route_row,
                                                  .dst_offset = l.recv.routing + uint64_t{me} * dims_.experts * 4});
  remote_slices_.assign(remotes_.size(), GroupSlice{});
  shared_slices_.assign(remotes_.size(), GroupSlice{});
  pending_.reserve(4 * dims_.ranks);  // a dispatch and two combines of it (DeepEP's test) without growing
  thread_ = std::thread([this] { run(); });
}

Proxy::~Proxy() {
  stop_.store(true, std::memory_order_release);
  if (thread_.joinable()) thread_.join();
  // The last step's WRITEs may still be on their way to a slower peer: its receive half needs
  // them, and the AllToAll deregisters the send region next. Wait for them (bounded).
  const SignalLayout& sig = cfg_.views.lay.signals;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::nanoseconds(cfg_.views.timeout_ns);
  while (signal(sig.writes_done).load(std::memory_order_acquire) + signal(sig.failed).load(std::memory_order_acquire) <
             posted_.load(std::memory_order_relaxed) &&
         std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  for (const ImmExpectation& e : pending_) engine_.cancel_imm_expectation(e);
}

template <typename Request>
void Proxy::post(const Request& request) {
  engine_.submit(request, on_write());
  posted_.fetch_add(1, std::memory_order_relaxed);  // only once it was taken: its OnDone fires
}

ProxyStats Proxy::stats() const {
  ProxyStats s;
  s.steps = steps_.read();
  s.writes = writes_.read();
  s.bytes = bytes_.read();
  s.cpu_ms = static_cast<double>(work_ns_.read()) / 1e6;
  s.dispatch_wait_ms = static_cast<double>(dispatch_wait_ns_.read()) / 1e6;
  s.combine_wait_ms = static_cast<double>(combine_wait_ns_.read()) / 1e6;
  return s;
}

OnDone Proxy::on_write() {
  return OnDone::counter(&signal(cfg_.views.lay.signals.writes_done), &signal(cfg_.views.lay.signals.failed))
      .keep_alive(cfg_.signals);
}

bool Proxy::masked(uint32_t rank) const { return rank_masked(cfg_.views, rank); }

void Proxy::post_each(const std::vector<uint32_t>& ranks, const std::vector<GroupSlice>& slices, uint32_t imm) {
  const SignalLayout& sig = cfg_.views.lay.signals;
  for (size_t i = 0; i < ranks.size(); ++i) {
    const uint32_t r = ranks[i];
    if (masked(r)) continue;
    std::atomic<uint64_t>* done = &signal(sig.writes_done);
    std::atomic<uint64_t>* mask = &signal(signal_at(sig.mask, r));
    OnDone on_done = OnDone::callback([done, mask, keep = cfg_.signals](const Status& status) {
                       if (!status.ok()) mask->store(1, std::memory_order_release);
                       done->fetch_add(1, std::memory_order_release);  // completed, either way
                     });
    try {
      engine_.submit(SingleWrite{.len = slices[i].len,
                                 .src = {cfg_.send_mr, slices[i].src_offset},
                                 .dst = {cfg_.recv[r], slices[i].dst_offset},
                                 .imm = imm},
                     std::move(on_done));
      posted_.fetch_add(1, std::memory_order_relaxed);
    } catch (const Error& e) {
      log::warn("MoE proxy of rank {}: a WRITE to rank {} was refused ({}): masked (shrink mode)", cfg_.views.rank, r,
                e.what());
      mask->store(1, std::memory_order_release);
    }
  }
}

// The word is raised to the step (not counted): a dispatch dropped without its combine leaves no
// gap that later steps would wait behind. In shrink mode an expectation that fails masks its rank
// instead of failing the AllToAll.
void Proxy::expect(ImmKind kind, uint64_t step, uint32_t src, uint64_t count, uint64_t counter_offset) {
  if (cfg_.views.shrink && masked(src)) return;
  const SignalLayout& sig = cfg_.views.lay.signals;
  std::atomic<uint64_t>* on_failure = &signal(cfg_.views.shrink ? signal_at(sig.mask, src) : sig.failed);
  OnDone done = OnDone::raise(&signal(signal_at(counter_offset, src)), step, on_failure).keep_alive(cfg_.signals);
  pending_.push_back(cfg_.imms->expect(moe_imm(kind, step, src), count, std::move(done),
                                       ExpectOptions{.timeout = std::chrono::milliseconds(cfg_.views.timeout_ns / 1000000)}));
}

void Proxy::run() {
  if (!cfg_.busy_poll) util::tighten_timer_slack();  // its 20 us naps, not 70
  try {
    loop();
  } catch (const std::exception& e) {
    // A submit refused (a peer removed, the engine closing): the receive halves see `failed`.
    log::error("MoE proxy of rank {}: {}", cfg_.views.rank, e.what());
    signal(cfg_.views.lay.signals.failed).fetch_add(1, std::memory_order_release);
  }
}

void Proxy::loop() {
  const SignalLayout& sig = cfg_.views.lay.signals;
  uint64_t dispatched = 0, combined = 0;
  // The dispatch step / combine sequence whose rows from the other nodes are still being counted
  // (0: none), and when this rank's first post of that half went out.
  uint64_t dispatch_arriving = 0, combine_arriving = 0, dispatch_t0 = 0, combine_t0 = 0;
  uint32_t idle = 0;
  while (!stop_.load(std::memory_order_acquire)) {
    bool worked = false;
    if (const uint64_t step = signal(sig.dispatch_sent).load(std::memory_order_acquire); step > dispatched) {
      const uint64_t t0 = now_ns();
      start_dispatch(step);
      dispatched = dispatch_arriving = step;
      dispatch_t0 = t0;
      dispatches_.add();
      work_ns_.add(now_ns() - t0);
      worked = true;
    }
    if (const uint64_t seq = signal(sig.combine_sent).load(std::memory_order_acquire); seq > combined) {
      const uint64_t t0 = now_ns();
      start_combine(seq);
      combined = combine_arriving = seq;
      combine_t0 = t0;
      steps_.add();
      work_ns_.add(now_ns() - t0);
      worked = true;
    }
    if (dispatch_arriving != 0 && remotes_arrived(sig.dispatch_seen, dispatch_arriving)) {
      dispatch_wait_ns_.add(now_ns() - dispatch_t0);
      dispatch_arriving = 0;
    }
    if (combine_arriving != 0 && remotes_arrived(sig.combine_seen, combine_arriving)) {
      combine_wait_ns_.add(now_ns() - combine_t0);
      combine_arriving = 0;
    }
    if (worked || cfg_.busy_poll) {
      idle = 0;
      continue;
    }
    // Adaptive polling for machines with few cores: spin a while, then yield, then nap.
    if (++idle < 2000) continue;
    if (idle < 4000) std::this_thread::yield();
    else std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

// Step `step`'s rows are staged: expect the other ranks' immediates of this step, send the counts
// row to every other rank and, to every remote rank, the rows staged for it: the first P of them
// to its private rows, the rest to this rank's slot of its shared region (layout.h).
void Proxy::start_dispatch(uint64_t step) {
  const Layout& l = cfg_.views.lay;
  const uint32_t me = cfg_.views.rank;
  const uint64_t R = dims_.row_bytes();
  pending_.clear();  // the last step's: all met (or failed: the AllToAll is failed then)
  for (uint32_t s : others_) expect(ImmKind::kRoute, step, s, 1, l.signals.route_seen);
  for (uint32_t s : remotes_) expect(ImmKind::kDispatch, step, s, 2, l.signals.dispatch_seen);

  const auto* counts = reinterpret_cast<const uint32_t*>(cfg_.views.signals + l.signals.route_row);
  if (cfg_.views.shrink) post_each(others_, route_slices_, moe_imm(ImmKind::kRoute, step, me));
  else post(GroupScatter{.group = others_group_, .src = cfg_.send_mr, .slices = route_slices_,
            .imm = moe_imm(ImmKind::kRoute, step, me)});
  uint64_t bytes = route_slices_.size() * 4ull * dims_.experts;
  for (size_t i = 0; i < remotes_.size(); ++i) {
    const uint32_t d = remotes_[i];
    const uint64_t n = rows_to(dims_, counts, d), priv = std::min<uint64_t>(n, dims_.private_rows);
    const uint64_t stage = l.send.stage + stage_base(dims_, counts, me, d) * R;
    remote_slices_[i] = GroupSlice{.len = priv * R,
                                   .src_offset = stage,
                                   .dst_offset = l.recv.priv + uint64_t{me} * dims_.private_rows * R};
    // Rows [priv, n) of d's enumeration, contiguous in this rank's slot of d's shared region from
    // where index priv lands (empty when n <= P: zero bytes still carry the counted immediate).
    shared_slices_[i] = GroupSlice{
        .len = (n - priv) * R,
        .src_offset = stage + priv * R,
        .dst_offset = received_row_offset(dims_, l.recv, me, d, static_cast<uint32_t>(priv))};
    bytes += n * R;
  }
  if (cfg_.views.shrink) {
    post_each(remotes_, remote_slices_, moe_imm(ImmKind::kDispatch, step, me));
    post_each(remotes_, shared_slices_, moe_imm(ImmKind::kDispatch, step, me));
  } else {
    post(GroupScatter{.group = remotes_group_, .src = cfg_.send_mr, .slices = remote_slices_,
         .imm = moe_imm(ImmKind::kDispatch, step, me)});
    post(GroupScatter{.group = remotes_group_, .src = cfg_.send_mr, .slices = shared_slices_,
         .imm = moe_imm(ImmKind::kDispatch, step, me)});
  }
  log::debug("MoE proxy of rank {}: step {}: counts, private and shared rows posted", me, step);
  writes_.add(route_slices_.size() + 2 * remote_slices_.size());
  bytes_.add(bytes);
}

bool Proxy::remotes_arrived(uint64_t counter_offset, uint64_t step) const {
  for (uint32_t s : remotes_)
    if (signal(signal_at(counter_offset, s)).load(std::memory_order_acquire) < step && !masked(s)) return false;
  return true;
}

// Combine `seq`'s rows for the other nodes are staged in its half of cstage, by source rank
// (layout.h: a dispatch may be combined more than once, each combine with its own sequence).
void Proxy::start_combine(uint64_t seq) {
  const Layout& l = cfg_.views.lay;
  const uint32_t me = cfg_.views.rank;
  const uint64_t B = dims_.combine_row_bytes();
  for (uint32_t d : remotes_) expect(ImmKind::kCombine, seq, d, 1, l.signals.combine_seen);
  // The other nodes' counts rows, as this rank's dispatch receive half copied them (layout.h).
  const auto* routing = reinterpret_cast<const uint32_t*>(cfg_.views.signals + l.signals.routing);
  const uint64_t cstage = l.send.cstage + cstage_half(dims_, seq), combine = l.recv.combine + combine_half(dims_, seq);
  uint64_t bytes = 0;
  for (size_t i = 0; i < remotes_.size(); ++i) {
    const uint32_t s = remotes_[i];
    const uint32_t* row_s = routing + uint64_t{s} * dims_.experts;
    remote_slices_[i] = GroupSlice{.len = rows_to(dims_, row_s, me) * B,
                                   .src_offset = cstage + cstage_base(dims_, routing, s, me) * B,
                                   .dst_offset = combine + uint64_t{combine_base(dims_, row_s, me)} * B};
    bytes += remote_slices_[i].len;
  }
  if (cfg_.views.shrink)
    post_each(remotes_, remote_slices_, moe_imm(ImmKind::kCombine, seq, me));
  else
    post(GroupScatter{.group = remotes_group_, .src = cfg_.send_mr, .slices = remote_slices_,
         .imm = moe_imm(ImmKind::kCombine, seq, me)});
  log::debug("MoE proxy of rank {}: combine {}: rows posted", me, seq);
  writes_.add(remote_slices_.size());
  bytes_.add(bytes);
}

}  // namespace fabric::moe::detail
