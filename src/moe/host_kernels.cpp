// The MoE kernel side on host threads (kernel_side.h): the writes and flags of layout.h's
// protocol, done by the calling thread over host memory. CI runs the whole inter-node protocol
// through it, and it is the behavioural reference of gpu_kernels.cu.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>

#include "fabric/e4m3.h"
#include "fabric/error.h"
#include "kernel_side.h"
#include "util/log.h"

namespace fabric::moe::detail::host {

namespace {

using Clock = std::chrono::steady_clock;

std::atomic<uint64_t>& word(std::byte* base, uint64_t offset) {
  return *reinterpret_cast<std::atomic<uint64_t>*>(base + offset);
}
template <typename T>
T* at(std::byte* base, uint64_t offset) {
  return reinterpret_cast<T*>(base + offset);
}

std::byte* own_node(const Views& v) { return v.node[v.rank % v.lay.dims.node_size]; }

// The counts row of source s as this rank sees it: from the node region for node-mates, from the
// RDMA routing table for the other nodes.
const uint32_t* counts_of(const Views& v, uint32_t s) {
  const Dims& d = v.lay.dims;
  if (d.same_node(s, v.rank)) return at<uint32_t>(own_node(v), v.lay.node.counts) + uint64_t{s % d.node_size} * d.experts;
  return at<uint32_t>(v.recv, v.lay.recv.routing) + uint64_t{s} * d.experts;
}

// Calls f(el, e, s, row_s, c, m) for every local expert el (global e) and source s in rank
// order: s's counts row, its c rows of e, and m, the first of them among e's output rows. A
// source the last dispatch receive left out (local.live, shrink mode) has no rows.
template <typename F>
void for_each_source_run(const Views& v, F&& f) {
  const Dims& d = v.lay.dims;
  const uint32_t* live = at<uint32_t>(v.local, v.lay.local.live);
  for (uint32_t el = 0; el < d.local_experts; ++el) {
    const uint32_t e = v.rank * d.local_experts + el;
    uint64_t m = 0;
    for (uint32_t s = 0; s < d.ranks; ++s) {
      const uint32_t* row_s = counts_of(v, s);
      const uint32_t c = live[s] ? row_s[e] : 0;
      f(el, e, s, row_s, c, m);
      m += c;
    }
  }
}

void mask_rank(const Views& v, uint32_t s) {
  word(v.signals, signal_at(v.lay.signals.mask, s)).store(1, std::memory_order_release);
}

// Spins, then yields, then sleeps, until every rank's `ready(rank)` holds (or it is masked);
// throws kTimeout naming the ranks still missing (shrink mode: masks them and returns), or the
// failure the proxy counted. wait_ns (optional, [ranks]):
// each rank's wait, from the call until its rows were seen, is added to its entry.
template <typename Ready>
void wait_all(const Views& v, const char* what, uint64_t step, int64_t* wait_ns, Ready ready) {
  const Dims& d = v.lay.dims;
  const auto start = Clock::now();
  const auto deadline = start + std::chrono::nanoseconds(v.timeout_ns);
  std::atomic<uint64_t>& failed = word(v.signals, v.lay.signals.failed);
  std::vector<bool> seen(wait_ns ? d.ranks : 0);
  for (uint32_t spins = 0;; ++spins) {
    bool all = true;
    if (wait_ns) {
      const auto now = Clock::now();
      for (uint32_t s = 0; s < d.ranks; ++s) {
        if (seen[s]) continue;
        if (ready(s) || rank_masked(v, s)) {
          seen[s] = true;
          wait_ns[s] += std::chrono::duration_cast<std::chrono::nanoseconds>(now - start).count();
        } else {
          all = false;
        }
      }
    } else {
      for (uint32_t s = 0; s < d.ranks && all; ++s) all = ready(s) || rank_masked(v, s);
    }
    if (all) return;
    const bool late = Clock::now() > deadline;
    if (late || failed.load(std::memory_order_acquire) != 0) {
      std::vector<uint32_t> missing;
      for (uint32_t s = 0; s < d.ranks; ++s)
        if (!ready(s) && !rank_masked(v, s)) missing.push_back(s);
      if (late && v.shrink) {
        log::warn("MoE {} step {} on rank {}: rows from ranks {} missing after {} ms: masked (shrink mode)", what, step,
                  v.rank, missing, v.timeout_ns / 1000000);
        for (uint32_t s : missing) mask_rank(v, s);
        return;
      }
      if (late)
        throw Error(ErrorCode::kTimeout, fmt::format("MoE {} step {} on rank {}: rows from ranks {} missing after {} ms (peer dead or stalled?)",
                                                     what, step, v.rank, missing, v.timeout_ns / 1000000));
      throw Error(ErrorCode::kProvider, fmt::format("MoE {} step {} on rank {}: a transfer or expectation of the proxy failed "
                                                    "(see the log) while rows from ranks {} were missing",
                                                    what, step, v.rank, missing));
    }
    if (spins < 2000) continue;
    if (spins < 4000) std::this_thread::yield();
    else std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

}  // namespace

void check_dispatch_args(const Dims& d, const DispatchArgs& a) {
  if (a.num_tokens > d.max_tokens)
    throw Error(ErrorCode::kInvalidArgument, fmt::format("MoE dispatch: {} tokens, more than max_tokens {}", a.num_tokens, d.max_tokens));
  if (const char* bad = dispatch_args_error(d, a)) throw Error(ErrorCode::kInvalidArgument, bad);
  for (uint32_t t = 0; t < a.num_tokens; ++t)
    for (uint32_t k = 0; k < d.topk; ++k) {
      const int64_t e = a.topk_idx[uint64_t{t} * d.topk + k];
      if (e < 0) continue;
      if (e >= d.experts)
        throw Error(ErrorCode::kInvalidArgument, fmt::format("MoE dispatch: topk_idx[{}][{}] = {}, not below experts {}", t, k, e, d.experts));
      for (uint32_t k2 = 0; k2 < k; ++k2)
        if (a.topk_idx[uint64_t{t} * d.topk + k2] == e)
          throw Error(ErrorCode::kInvalidArgument, fmt::format("MoE dispatch: token {} names expert {} in slots {} and {}", t, e, k2, k));
    }
}

namespace {

// BF16 token x quantized into an FP8 row's payload and scales at dst (Quantize, fabric/e4m3.h).
void quantize_row(const Dims& d, const uint16_t* x, Quantize q, std::byte* dst) {
  for (uint64_t b = 0; b < d.hidden / kScaleBlock; ++b) {
    const uint16_t* in = x + b * kScaleBlock;
    float amax = 0.0f;
    for (uint64_t i = 0; i < kScaleBlock; ++i) amax = std::max(amax, std::fabs(fp8::from_bf16(in[i])));
    const float scale = q == Quantize::kPow2 ? fp8::pow2_scale(amax) : fp8::amax_scale(amax);
    for (uint64_t i = 0; i < kScaleBlock; ++i)
      dst[b * kScaleBlock + i] = std::byte{fp8::to_e4m3(fp8::div_rn(fp8::from_bf16(in[i]), scale))};
    std::memcpy(dst + d.hidden + 4 * b, &scale, 4);
  }
}

// Writes row (t, k) of the dispatch input, with its tail, to `dst`. `staged`: the token's row
// already written for an earlier slot (a quantizing dispatch copies it rather than quantize again).
void write_row(const Dims& d, const DispatchArgs& a, uint32_t t, uint32_t k, uint64_t step, const std::byte* staged,
               std::byte* dst) {
  const uint64_t pb = d.payload_bytes(), sc = d.scales_per_row();
  if (staged) {
    std::memcpy(dst, staged, pb + 4 * sc);
  } else if (a.quantize != Quantize::kNone) {
    quantize_row(d, static_cast<const uint16_t*>(a.x) + uint64_t{t} * d.hidden, a.quantize, dst);
  } else {
    std::memcpy(dst, static_cast<const std::byte*>(a.x) + t * pb, pb);
    if (sc) std::memcpy(dst + pb, a.x_scales + t * sc, 4 * sc);
  }
  const RowTail tail{t, k, static_cast<uint32_t>(step), 0};
  std::memcpy(dst + pb + 4 * sc, &tail, sizeof tail);
}

}  // namespace

void dispatch_send(const Views& v, const DispatchArgs& a, uint64_t step) {
  const Dims& d = v.lay.dims;
  const uint32_t N = d.node_size, L = d.local_experts, me = v.rank;
  const uint64_t R = d.row_bytes();
  uint32_t* counts = at<uint32_t>(v.local, v.lay.local.counts);
  int32_t* pos = at<int32_t>(v.local, v.lay.local.pos);
  int32_t* dst_of = at<int32_t>(v.local, v.lay.local.dst);
  // A slot whose expert lives on a masked rank is dropped here, as an unused one (shrink mode).
  auto used = [&](int64_t e) { return e >= 0 && !rank_masked(v, d.rank_of_expert(static_cast<uint32_t>(e))); };
  std::memset(counts, 0, 4ull * d.experts);
  for (uint64_t i = 0; i < uint64_t{a.num_tokens} * d.topk; ++i)
    if (used(a.topk_idx[i])) ++counts[a.topk_idx[i]];
  *at<uint64_t>(v.local, v.lay.local.step) = step;
  *at<uint32_t>(v.local, v.lay.local.tokens) = a.num_tokens;

  // Per expert, once: where its row 0 goes among the combine positions (rows of the experts
  // below it) and in the stage for the other nodes (rows of the other nodes' experts below it).
  uint32_t* rank_in_expert = at<uint32_t>(v.local, v.lay.local.scratch);
  uint32_t* before = rank_in_expert + d.experts;
  uint32_t* remote_before = before + d.experts;
  uint32_t all = 0, remote = 0;
  for (uint32_t e = 0; e < d.experts; ++e) {
    rank_in_expert[e] = 0;
    before[e] = all, remote_before[e] = remote;
    all += counts[e];
    if (!d.same_node(d.rank_of_expert(e), me)) remote += counts[e];
  }
  for (uint32_t t = 0; t < a.num_tokens; ++t) {
    const std::byte* staged = nullptr;  // the token's first row, when it is quantized here
    for (uint32_t k = 0; k < d.topk; ++k) {
      const uint64_t slot = uint64_t{t} * d.topk + k;
      const int64_t e64 = a.topk_idx[slot];
      if (!used(e64)) {
        pos[slot] = dst_of[slot] = -1;
        continue;
      }
      const uint32_t e = static_cast<uint32_t>(e64), dst = d.rank_of_expert(e), j = rank_in_expert[e]++;
      pos[slot] = static_cast<int32_t>(before[e] + j);
      dst_of[slot] = static_cast<int32_t>(dst);
      std::byte* row;
      if (d.same_node(dst, me))
        row = v.node[dst % N] + v.lay.node.rows + ((uint64_t{e % L} * N + me % N) * d.max_tokens + j) * R;
      else
        row = v.send + v.lay.send.stage + (uint64_t{remote_before[e]} + j) * R;
      write_row(d, a, t, k, step, staged, row);
      if (a.quantize != Quantize::kNone) staged = row;
    }
  }
  // The counts row, then the flag: a node-mate that sees the flag (acquire) sees rows and counts.
  for (uint32_t i = 0; i < N; ++i) {
    std::byte* node = v.node[i];
    std::memcpy(node + v.lay.node.counts + uint64_t{me % N} * d.experts * 4, counts, 4ull * d.experts);
    word(node, v.lay.node.dispatch_flag + kLine * (me % N)).store(step, std::memory_order_release);
  }
  if (d.ranks > N) {
    std::memcpy(v.send + v.lay.send.route_row, counts, 4ull * d.experts);
    std::memcpy(v.signals + v.lay.signals.route_row, counts, 4ull * d.experts);
    word(v.signals, v.lay.signals.dispatch_sent).store(step, std::memory_order_release);
  }
}

void dispatch_recv(const Views& v, uint64_t step, int64_t* wait_ns) {
  const Dims& d = v.lay.dims;
  const uint32_t N = d.node_size, me = v.rank;
  std::byte* node = own_node(v);
  wait_all(v, "dispatch", step, wait_ns, [&](uint32_t s) {
    if (d.same_node(s, me)) return word(node, v.lay.node.dispatch_flag + kLine * (s % N)).load(std::memory_order_acquire) >= step;
    return word(v.signals, signal_at(v.lay.signals.route_seen, s)).load(std::memory_order_acquire) >= step &&
           word(v.signals, signal_at(v.lay.signals.dispatch_seen, s)).load(std::memory_order_acquire) >= step;
  });
  // The sources this dispatch takes rows from (shrink mode: not the masked ones), fixed for its
  // combines; the other nodes' counts rows for this rank's proxy and combine (zeros for a source
  // left out), published by combine_sent.
  uint32_t* live = at<uint32_t>(v.local, v.lay.local.live);
  for (uint32_t s = 0; s < d.ranks; ++s) {
    live[s] = rank_masked(v, s) ? 0 : 1;
    if (d.same_node(s, me)) continue;
    uint32_t* routing = at<uint32_t>(v.signals, v.lay.signals.routing) + uint64_t{s} * d.experts;
    if (live[s]) std::memcpy(routing, counts_of(v, s), 4ull * d.experts);
    else std::memset(routing, 0, 4ull * d.experts);
  }
  const uint64_t R = d.row_bytes(), pb = d.payload_bytes(), sb = 4 * d.scales_per_row(), M = d.rows_per_expert();
  int32_t* out_counts = at<int32_t>(v.out, v.lay.out.counts);
  int32_t* out_src = at<int32_t>(v.out, v.lay.out.src);
  int64_t* out_runs = at<int64_t>(v.out, v.lay.out.runs);
  for_each_source_run(v, [&](uint32_t el, uint32_t e, uint32_t s, const uint32_t* row_s, uint32_t c, uint64_t m) {
    out_runs[uint64_t{el} * d.ranks + s] = static_cast<int64_t>((m << 32) | c);  // DeepEP: count low, first row high
    const uint32_t start = d.same_node(s, me) ? 0 : expert_start(d, row_s, e);  // E0(e)
    for (uint32_t j = 0; j < c; ++j) {
      const std::byte* row;
      if (d.same_node(s, me))
        row = node + v.lay.node.rows + ((uint64_t{el} * N + s % N) * d.max_tokens + j) * R;
      else
        row = v.recv + received_row_offset(d, v.lay.recv, s, me, start + j);
      RowTail tail;
      std::memcpy(&tail, row + pb + sb, sizeof tail);
      if (tail.step != static_cast<uint32_t>(step))
        throw Error(ErrorCode::kMalformed, fmt::format("MoE dispatch step {} on rank {}: row {} of expert {} from rank {} carries step {}",
                                                       step, me, j, e, s, tail.step));
      const uint64_t out_row = uint64_t{el} * M + m + j;
      std::memcpy(v.out + v.lay.out.x + out_row * pb, row, pb);
      if (sb) std::memcpy(v.out + v.lay.out.scales + out_row * sb, row + pb, sb);
      out_src[out_row] = static_cast<int32_t>(s * d.max_tokens + tail.token);
    }
    if (s + 1 == d.ranks) out_counts[el] = static_cast<int32_t>(m + c);
  });
}

void combine_send(const Views& v, const CombineArgs& a, uint64_t seq) {
  const Dims& d = v.lay.dims;
  const uint32_t N = d.node_size, me = v.rank;
  const uint64_t B = d.combine_row_bytes(), M = d.rows_per_expert();
  const uint32_t* routing = at<uint32_t>(v.signals, v.lay.signals.routing);  // as the proxy reads it
  for_each_source_run(v, [&](uint32_t el, uint32_t e, uint32_t s, const uint32_t* row_s, uint32_t c, uint64_t m) {
    if (c == 0 || rank_masked(v, s)) return;  // nothing for it, or it went since (shrink mode)
    const uint64_t first = expert_start(d, row_s, e);
    std::byte* dst;
    if (d.same_node(s, me))
      dst = v.node[s % N] + v.lay.node.combine + combine_half(d, seq) + (combine_base(d, row_s, me) + first) * B;
    else
      dst = v.send + v.lay.send.cstage + cstage_half(d, seq) + (cstage_base(d, routing, s, me) + first) * B;
    std::memcpy(dst, a.expert_out + (uint64_t{el} * M + m) * d.hidden, c * B);
  });
  for (uint32_t i = 0; i < N; ++i) word(v.node[i], v.lay.node.combine_flag + kLine * (me % N)).store(seq, std::memory_order_release);
  if (d.ranks > N) word(v.signals, v.lay.signals.combine_sent).store(seq, std::memory_order_release);
}

void mark_dispatch_failed(const Views& v) {
  int32_t* counts = at<int32_t>(v.out, v.lay.out.counts);
  std::fill(counts, counts + v.lay.dims.local_experts, kInvalidCount);
  int64_t* runs = at<int64_t>(v.out, v.lay.out.runs);
  std::fill(runs, runs + uint64_t{v.lay.dims.local_experts} * v.lay.dims.ranks, kInvalidRun);
}

void mark_combine_failed(const Views& v, const CombineArgs& a) {
  if (!a.out) return;
  const uint64_t n = uint64_t{*at<uint32_t>(v.local, v.lay.local.tokens)} * v.lay.dims.hidden;
  std::fill(a.out, a.out + n, kInvalidBf16);
}

void combine_recv(const Views& v, const CombineArgs& a, uint64_t seq) {
  const Dims& d = v.lay.dims;
  const uint32_t N = d.node_size, me = v.rank;
  std::byte* node = own_node(v);
  wait_all(v, "combine", seq, a.wait_ns, [&](uint32_t s) {
    if (d.same_node(s, me)) return word(node, v.lay.node.combine_flag + kLine * (s % N)).load(std::memory_order_acquire) >= seq;
    return word(v.signals, signal_at(v.lay.signals.combine_seen, s)).load(std::memory_order_acquire) >= seq;
  });
  const uint32_t tokens = *at<uint32_t>(v.local, v.lay.local.tokens);
  const int32_t* pos = at<int32_t>(v.local, v.lay.local.pos);
  const int32_t* dst_of = at<int32_t>(v.local, v.lay.local.dst);
  const float* weights = a.topk_weights;
  float* acc = at<float>(v.local, v.lay.local.scratch);
  const uint64_t half = combine_half(d, seq);
  for (uint32_t t = 0; t < tokens; ++t) {
    std::fill(acc, acc + d.hidden, 0.0f);
    for (uint32_t k = 0; k < d.topk; ++k) {
      const uint64_t slot = uint64_t{t} * d.topk + k;
      if (pos[slot] < 0 || rank_masked(v, static_cast<uint32_t>(dst_of[slot]))) continue;  // masked: weight 0
      const std::byte* base = d.same_node(static_cast<uint32_t>(dst_of[slot]), me) ? node + v.lay.node.combine + half
                                                                                   : v.recv + v.lay.recv.combine + half;
      const uint16_t* row = reinterpret_cast<const uint16_t*>(base + uint64_t(pos[slot]) * d.combine_row_bytes());
      const float w = weights[slot];
      for (uint32_t h = 0; h < d.hidden; ++h) acc[h] = std::fma(w, bf16_to_float(row[h]), acc[h]);
    }
    for (uint32_t h = 0; h < d.hidden; ++h) a.out[uint64_t{t} * d.hidden + h] = float_to_bf16(acc[h]);
  }
}

}  // namespace fabric::moe::detail::host
