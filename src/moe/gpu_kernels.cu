// The MoE kernel side as CUDA kernels (kernel_side.h): the four halves enqueued on the caller's
// stream, doing the writes and raising the flags of layout.h's protocol exactly as
// host_kernels.cpp does (the same bytes at the same offsets), so one proxy serves both sides.
//
// Shape: every kernel runs blocks of kThreads (16 warps); a warp moves one row at a time (a
// dispatched row, an expert-output row) or sums one segment of a token (combine receive), rows
// handed out warp-strided over the grid. What a block needs to place rows it derives itself, in
// shared memory, from the counts rows (a few E words), so no block waits on another to copy.
//
// Ordering:
//  - send halves: every thread fences at system scope after its stores, then each block takes a
//    ticket on a completion counter; the block holding the last ticket raises the flags with
//    release stores at system scope. Whoever acquires a flag (a node-mate's receive kernel, the
//    proxy) sees every row and counts row of the step.
//  - receive halves: on one node every block polls the flags (in its own GPU's memory) with one
//    warp. With other nodes the words the proxy raises are in host memory: the block that takes
//    the first ticket polls them with one warp (not every block: PCIe stays free for rows) and
//    publishes the outcome in a go word in device memory that the other blocks wait on. The
//    first ticket is taken by a running block, so the others never wait on a block not started.
//  - every wait is bounded by %globaltimer and gives up when the AllToAll failed
//    (signals.failed, signals.kernel_error): several processes may share a GPU, and a dead peer
//    must not hang it.
//
// The step: dispatch_send reads local.step and works with step + 1; its last block stores step + 1
// back once every block has read the old value. The later kernels on the stream read it there, so
// a captured graph replays with the right step. The combine sequence (layout.h) is kept alike in
// local.combines by combine_send. The grid counters live in local.scratch (the CUDA
// side has no other use for it), and the kernel that counts resets them for the next launch.
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>

#include "cuda/cuda_check.h"
#include "fabric/e4m3.h"
#include "fabric/error.h"
#include "kernel_side.h"

namespace fabric::moe::detail::cuda {
namespace {

constexpr uint32_t kThreads = 512;
constexpr uint32_t kWarps = kThreads / 32;
constexpr uint32_t kAllLanes = 0xFFFFFFFFu;
constexpr uint32_t kNone = 0xFFFFFFFFu;
constexpr uint32_t kSpinPolls = 64;          // polls before a waiter sleeps between polls
constexpr uint32_t kSleepNs = 200;           // short against the ~tens of us a step takes
constexpr uint32_t kFailureCheckEvery = 16;  // polls between looks at the failure words (host memory)
constexpr uint64_t kGoMarginNs = 1000000000ull;  // a go-word waiter outwaits the poller by this
constexpr size_t kDefaultSharedBytes = 48 * 1024;  // dynamic shared memory without opting in
constexpr uint32_t kDefaultBlocksPerHalf = 16;     // AllToAllConfig::num_sms 0: room for other halves

// Words the CUDA kernels keep in local.scratch, 8 bytes apart.
enum ScratchWord : uint32_t {
  kDispatchSendDone = 0,  // u32 completion counter of dispatch_send's blocks
  kCombineSendDone,       // u32 completion counter of combine_send's blocks
  kDispatchRecvTicket,    // u32: which block of dispatch_recv polls
  kCombineRecvTicket,     // u32: which block of combine_recv polls
  kDispatchRecvGo,        // u64: step << 1 | gave up, published by dispatch_recv's poller
  kCombineRecvGo,         // u64: the same for combine_recv
  kDispatchRecvDone,      // u32 completion counter of dispatch_recv's blocks
  kCombineRecvDone,       // u32 completion counter of combine_recv's blocks
};

// Views as a kernel parameter (std::array has no device-side operator[]).
struct Ptrs {
  Layout lay;
  uint32_t rank;
  std::byte* node[kMaxNodeSize];
  std::byte* recv;
  std::byte* send;
  std::byte* signals;
  std::byte* local;
  std::byte* out;
  uint64_t timeout_ns;
  int64_t* wait_ns;  // optional [ranks]: the receive's per-source wait is added here (one block records)
};

struct DispatchInput {
  const std::byte* x;
  const float* scales;
  const int64_t* idx;
  uint32_t tokens;
  Quantize quantize;  // not kNone: x is BF16, quantized by send_quantized_rows
};

// ---------------------------------------------------------------------------------------------
// Memory ordering, time, failure reports.

__device__ __forceinline__ uint64_t load_acquire_sys(const std::byte* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void store_release_sys(std::byte* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ uint64_t load_acquire_gpu(const std::byte* p) {
  uint64_t v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void store_release_gpu(std::byte* p, uint64_t v) {
  asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
// Orders this thread's earlier accesses before its later ones for every observer (peers over
// NVLink, the host, NICs). acq_rel suffices for the release/acquire chains here and is cheaper
// than the sequentially consistent __threadfence_system().
__device__ __forceinline__ void fence_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint64_t error_word(KernelError what, uint32_t low) {
  return (static_cast<uint64_t>(what) << 32) | low;
}
// The first failure stays: the host reports that one.
__device__ __forceinline__ void report(const Ptrs& p, uint64_t word) {
  atomicCAS_system(reinterpret_cast<unsigned long long*>(p.signals + p.lay.signals.kernel_error), 0ull,
                   static_cast<unsigned long long>(word));
}

__device__ __forceinline__ std::byte* scratch(const Ptrs& p, ScratchWord w) { return p.local + p.lay.local.scratch + 8ull * w; }
__device__ __forceinline__ std::byte* own_node(const Ptrs& p) { return p.node[p.rank % p.lay.dims.node_size]; }
__device__ __forceinline__ uint64_t current_step(const Ptrs& p) {
  return *reinterpret_cast<const uint64_t*>(p.local + p.lay.local.step);
}
__device__ __forceinline__ uint64_t current_combine(const Ptrs& p) {
  return *reinterpret_cast<const uint64_t*>(p.local + p.lay.local.combines);
}

// A ticket of this launch (0 for the first block to ask). The last block to ask resets the
// counter: every block of the launch has its ticket then, and the next launch starts from zero.
__device__ __forceinline__ uint32_t take_ticket(std::byte* word) {
  auto* counter = reinterpret_cast<unsigned int*>(word);
  const uint32_t ticket = atomicAdd(counter, 1u);
  if (ticket == gridDim.x - 1) atomicExch(counter, 0u);
  return ticket;
}

// Whether this block is the last of the grid to finish. Every thread first makes its stores
// visible at system scope, so what the last block does next (raise flags) follows all of them.
__device__ bool finish_block(std::byte* counter) {
  __shared__ bool last;
  fence_sys();
  __syncthreads();
  if (threadIdx.x == 0) {
    last = take_ticket(counter) == gridDim.x - 1;
    fence_sys();  // the other blocks' fenced stores before what this block does next
  }
  __syncthreads();
  return last;
}

__device__ __forceinline__ uint32_t warp_min(uint32_t v) {
  for (uint32_t o = 16; o > 0; o /= 2) v = min(v, __shfl_xor_sync(kAllLanes, v, o));
  return v;
}

// ---------------------------------------------------------------------------------------------
// Bounded waits of the receive halves.

// Lane 0 decides whether the poller gives up now: the AllToAll failed, or the time is up.
__device__ uint64_t give_up_word(const Ptrs& p, uint32_t poll, uint64_t start, KernelError timeout, uint32_t missing) {
  if (poll % kFailureCheckEvery == kFailureCheckEvery - 1 &&
      (load_acquire_sys(p.signals + p.lay.signals.failed) != 0 || load_acquire_sys(p.signals + p.lay.signals.kernel_error) != 0))
    return error_word(KernelError::kFailed, missing + 1);
  if (now_ns() - start > p.timeout_ns) return error_word(timeout, missing + 1);
  return 0;
}

// One warp polls every source until all arrived (true), or gives up and reports why (false).
// record: this warp adds each source's wait to p.wait_ns (when given) as the source arrives.
template <typename Arrived>
__device__ bool poll_sources(const Ptrs& p, KernelError timeout, bool record, Arrived arrived) {
  const uint32_t lane = threadIdx.x % 32, W = p.lay.dims.ranks;
  const uint64_t start = now_ns();
  record = record && p.wait_ns != nullptr;
  uint64_t seen = 0;  // bit j: source lane + 32 j arrived (record only; W <= 2048, checked on the host)
  for (uint32_t poll = 0;; ++poll) {
    uint32_t missing = kNone;
    if (record) {
      uint32_t j = 0;
      for (uint32_t s = lane; s < W; s += 32, ++j) {
        if ((seen >> j) & 1) continue;
        if (arrived(s)) {
          seen |= uint64_t{1} << j;
          atomicAdd(reinterpret_cast<unsigned long long*>(p.wait_ns + s),
                    static_cast<unsigned long long>(now_ns() - start));
        } else if (missing == kNone) {
          missing = s;
        }
      }
    } else {
      for (uint32_t s = lane; s < W; s += 32)
        if (!arrived(s)) {
          missing = s;
          break;
        }
    }
    missing = warp_min(missing);
    if (missing == kNone) return true;
    uint64_t word = 0;
    if (lane == 0) word = give_up_word(p, poll, start, timeout, missing);
    word = __shfl_sync(kAllLanes, word, 0);
    if (word != 0) {
      if (lane == 0) report(p, word);
      return false;
    }
    if (poll >= kSpinPolls) __nanosleep(kSleepNs);
  }
}

// A block other than the poller waits for its go word of this step. Bounded as well: the
// poller gives up after the timeout, so this wait outlasting it by far means something is broken.
__device__ bool wait_go(const Ptrs& p, uint64_t step, KernelError timeout, const std::byte* go) {
  const uint64_t start = now_ns();
  for (uint32_t poll = 0;; ++poll) {
    const uint64_t g = load_acquire_gpu(go);
    if ((g >> 1) == step) return (g & 1) == 0;
    if (now_ns() - start > p.timeout_ns + kGoMarginNs) {
      report(p, error_word(timeout, 0));
      return false;
    }
    if (poll >= kSpinPolls) __nanosleep(kSleepNs);
  }
}

// Whether every source's rows of this step are in (the block may read them), or the wait gave
// up (reported; the block must end). Called by every thread of the block. On one node every flag
// is in this GPU's memory (the node region), cheap enough for every block to poll itself; with
// other nodes the words are in host memory, and one poller relays them through the go word.
template <typename Arrived>
__device__ bool wait_sources(const Ptrs& p, uint64_t step, KernelError timeout, ScratchWord ticket_word, ScratchWord go_word,
                             Arrived arrived) {
  __shared__ uint32_t ready;
  if (p.lay.dims.ranks == p.lay.dims.node_size) {
    if (threadIdx.x < 32) {
      const bool ok = poll_sources(p, timeout, blockIdx.x == 0, arrived);
      if (threadIdx.x == 0) ready = ok;
    }
  } else if (threadIdx.x < 32) {
    uint32_t ticket = 0;
    if (threadIdx.x == 0) ticket = take_ticket(scratch(p, ticket_word));
    ticket = __shfl_sync(kAllLanes, ticket, 0);
    if (ticket == 0) {
      const bool ok = poll_sources(p, timeout, true, arrived);
      if (threadIdx.x == 0) {
        store_release_gpu(scratch(p, go_word), (step << 1) | (ok ? 0 : 1));
        ready = ok;
      }
    } else if (threadIdx.x == 0) {
      ready = wait_go(p, step, timeout, scratch(p, go_word));
    }
  }
  __syncthreads();
  return ready != 0;
}

__device__ bool dispatch_arrived(const Ptrs& p, uint32_t s, uint64_t step) {
  const Dims& d = p.lay.dims;
  if (d.same_node(s, p.rank)) return load_acquire_sys(own_node(p) + p.lay.node.dispatch_flag + kLine * (s % d.node_size)) >= step;
  return load_acquire_sys(p.signals + signal_at(p.lay.signals.route_seen, s)) >= step &&
         load_acquire_sys(p.signals + signal_at(p.lay.signals.dispatch_seen, s)) >= step;
}

__device__ bool combine_arrived(const Ptrs& p, uint32_t s, uint64_t seq) {
  const Dims& d = p.lay.dims;
  if (d.same_node(s, p.rank)) return load_acquire_sys(own_node(p) + p.lay.node.combine_flag + kLine * (s % d.node_size)) >= seq;
  return load_acquire_sys(p.signals + signal_at(p.lay.signals.combine_seen, s)) >= seq;
}

// ---------------------------------------------------------------------------------------------
// Row copies: a warp moves `bytes` (a multiple of sizeof(Vec), both ends Vec-aligned), with
// kBatch loads in flight per lane before it stores them.

template <typename Vec>
__device__ __forceinline__ void warp_copy(std::byte* dst, const std::byte* src, uint32_t bytes, uint32_t lane) {
  constexpr uint32_t kBatch = 8;
  const uint32_t n = bytes / sizeof(Vec);
  Vec* d = reinterpret_cast<Vec*>(dst);
  const Vec* s = reinterpret_cast<const Vec*>(src);
  for (uint32_t i = lane; i < n; i += 32 * kBatch) {
    Vec v[kBatch];
#pragma unroll
    for (uint32_t b = 0; b < kBatch; ++b)
      if (i + 32 * b < n) v[b] = s[i + 32 * b];
#pragma unroll
    for (uint32_t b = 0; b < kBatch; ++b)
      if (i + 32 * b < n) d[i + 32 * b] = v[b];
  }
}

__device__ __forceinline__ void store_tail(std::byte* at, uint4 tail, uint4) { *reinterpret_cast<uint4*>(at) = tail; }
__device__ __forceinline__ void store_tail(std::byte* at, uint4 tail, uint32_t) {
  auto* w = reinterpret_cast<uint32_t*>(at);
  w[0] = tail.x, w[1] = tail.y, w[2] = tail.z, w[3] = tail.w;
}
__device__ __forceinline__ uint4 load_tail(const std::byte* at, uint4) { return *reinterpret_cast<const uint4*>(at); }
__device__ __forceinline__ uint4 load_tail(const std::byte* at, uint32_t) {
  const auto* w = reinterpret_cast<const uint32_t*>(at);
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// Byte sizes of a dispatched row (layout.h: payload, scales, RowTail); constants for the
// hidden sizes with their own kernel instances.
struct RowBytes {
  uint32_t payload, scales, row;
};
template <uint32_t kHidden, bool kFp8>
__device__ __forceinline__ RowBytes row_bytes(const Dims& d) {
  const uint32_t h = kHidden != 0 ? kHidden : d.hidden;
  const uint32_t payload = kFp8 ? h : 2 * h, scales = kFp8 ? 4 * (h / kScaleBlock) : 0;
  return {payload, scales, payload + scales + static_cast<uint32_t>(sizeof(RowTail))};
}

// ---------------------------------------------------------------------------------------------
// Dispatch send.

// The expert of slot k of token t, or -1 for a slot that sends nothing: masked by the caller
// (negative), or bad (not below E, or the expert of an earlier slot of the token): `bad` says so.
__device__ int32_t slot_expert(const int64_t* idx, uint32_t t, uint32_t k, const Dims& d, bool& bad) {
  const int64_t* row = idx + uint64_t{t} * d.topk;
  const int64_t e = row[k];
  bad = false;
  if (e < 0) return -1;
  bad = e >= d.experts;
  for (uint32_t k2 = 0; k2 < k && !bad; ++k2) bad = row[k2] == e;
  return bad ? -1 : static_cast<int32_t>(e);
}

// This rank's routing, in the block's shared memory: bit t of expert e's `words` bitmap words is
// set when token t sends to e (so a row's rank j among e's rows is a popcount), the counts, and
// the exclusive prefix sums that place rows.
struct Routing {
  uint32_t* bits;           // [E][words]
  uint32_t* counts;         // [E]
  uint32_t* before;         // [E] rows of experts below e: combine position of e's row 0
  uint32_t* remote_before;  // [E] rows of other nodes' experts below e: stage row of e's row 0
  uint32_t words;
};

__host__ __device__ inline uint32_t bitmap_words(uint32_t tokens) { return tokens == 0 ? 1 : (tokens + 31) / 32; }
__host__ __device__ inline size_t routing_shared_bytes(const Dims& d, uint32_t tokens) {
  return 4ull * d.experts * (bitmap_words(tokens) + 3);
}

// Exclusive prefix sums of the counts, all experts and other nodes' experts, by warp 0.
__device__ void scan_counts(const Dims& d, uint32_t rank, const Routing& r) {
  const uint32_t lane = threadIdx.x % 32;
  uint32_t all = 0, remote = 0;
  for (uint32_t first = 0; first < d.experts; first += 32) {
    const uint32_t e = first + lane;
    const uint32_t c = e < d.experts ? r.counts[e] : 0;
    const uint32_t rc = e < d.experts && !d.same_node(d.rank_of_expert(e), rank) ? c : 0;
    uint32_t incl = c, rincl = rc;
    for (uint32_t o = 1; o < 32; o *= 2) {
      const uint32_t a = __shfl_up_sync(kAllLanes, incl, o), b = __shfl_up_sync(kAllLanes, rincl, o);
      if (lane >= o) incl += a, rincl += b;
    }
    if (e < d.experts) {
      r.before[e] = all + incl - c;
      r.remote_before[e] = remote + rincl - rc;
    }
    all += __shfl_sync(kAllLanes, incl, 31);
    remote += __shfl_sync(kAllLanes, rincl, 31);
  }
}

// Every block derives the whole routing itself (it is a few KiB of topk_idx), so none waits for
// another. Block 0 reports bad expert indices.
__device__ Routing build_routing(const Ptrs& p, const DispatchInput& in, uint32_t* smem) {
  const Dims& d = p.lay.dims;
  const uint32_t E = d.experts, words = bitmap_words(in.tokens);
  const Routing r{smem, smem + uint64_t{E} * words, smem + uint64_t{E} * (words + 1), smem + uint64_t{E} * (words + 2), words};
  for (uint32_t i = threadIdx.x; i < E * words; i += kThreads) r.bits[i] = 0;
  __syncthreads();
  bool any_bad = false;
  for (uint32_t slot = threadIdx.x; slot < in.tokens * d.topk; slot += kThreads) {
    const uint32_t t = slot / d.topk;
    bool bad;
    const int32_t e = slot_expert(in.idx, t, slot % d.topk, d, bad);
    any_bad |= bad;
    if (e >= 0) atomicOr(&r.bits[uint64_t(e) * words + t / 32], 1u << (t % 32));
  }
  if (any_bad && blockIdx.x == 0) report(p, error_word(KernelError::kBadExpert, 0));
  __syncthreads();
  for (uint32_t e = threadIdx.x; e < E; e += kThreads) {
    uint32_t n = 0;
    for (uint32_t w = 0; w < words; ++w) n += __popc(r.bits[uint64_t{e} * words + w]);
    r.counts[e] = n;
  }
  __syncthreads();
  if (threadIdx.x < 32) scan_counts(d, p.rank, r);
  __syncthreads();
  return r;
}

// j of token t's row to expert e: e's rows of the tokens below t.
__device__ __forceinline__ uint32_t rank_in_expert(const Routing& r, uint32_t e, uint32_t t) {
  const uint32_t* bits = r.bits + uint64_t{e} * r.words;
  uint32_t j = 0;
  for (uint32_t w = 0; w < t / 32; ++w) j += __popc(bits[w]);
  return j + __popc(bits[t / 32] & ((1u << (t % 32)) - 1));
}

// Block 0: this rank's counts where combine finds them and where the node-mates and the proxy
// read them (before the flags, which the last block raises after every block's fence).
__device__ void publish_counts(const Ptrs& p, uint32_t tokens, const Routing& r) {
  const Dims& d = p.lay.dims;
  const uint32_t N = d.node_size;
  for (uint32_t e = threadIdx.x; e < d.experts; e += kThreads) {
    const uint32_t c = r.counts[e];
    reinterpret_cast<uint32_t*>(p.local + p.lay.local.counts)[e] = c;
    for (uint32_t i = 0; i < N; ++i)
      reinterpret_cast<uint32_t*>(p.node[i] + p.lay.node.counts + 4ull * d.experts * (p.rank % N))[e] = c;
    if (d.ranks > N) {
      reinterpret_cast<uint32_t*>(p.send + p.lay.send.route_row)[e] = c;
      reinterpret_cast<uint32_t*>(p.signals + p.lay.signals.route_row)[e] = c;  // the proxy's copy
    }
  }
  if (threadIdx.x == 0) *reinterpret_cast<uint32_t*>(p.local + p.lay.local.tokens) = tokens;
}

// Where row j of expert e goes: the expert rank's node region on this node, else the stage the
// proxy sends from (rows by destination rank, then expert, then j).
__device__ __forceinline__ std::byte* dispatch_row_at(const Ptrs& p, const Routing& r, uint32_t e, uint32_t j, uint32_t row) {
  const Dims& d = p.lay.dims;
  const uint32_t N = d.node_size, L = d.local_experts, dst = d.rank_of_expert(e);
  if (d.same_node(dst, p.rank))
    return p.node[dst % N] + p.lay.node.rows + ((uint64_t{e % L} * N + p.rank % N) * d.max_tokens + j) * row;
  return p.send + p.lay.send.stage + (uint64_t{r.remote_before[e]} + j) * row;
}

// One warp per slot: the slot's combine bookkeeping, then its row (payload, scales, tail).
template <uint32_t kHidden, bool kFp8, typename Vec>
__device__ void send_rows(const Ptrs& p, const DispatchInput& in, const Routing& r, uint64_t step) {
  const Dims& d = p.lay.dims;
  const RowBytes rb = row_bytes<kHidden, kFp8>(d);
  const uint32_t lane = threadIdx.x % 32;
  int32_t* pos = reinterpret_cast<int32_t*>(p.local + p.lay.local.pos);
  int32_t* dst_of = reinterpret_cast<int32_t*>(p.local + p.lay.local.dst);
  const uint32_t slots = in.tokens * d.topk;
  for (uint32_t slot = blockIdx.x * kWarps + threadIdx.x / 32; slot < slots; slot += gridDim.x * kWarps) {
    const uint32_t t = slot / d.topk, k = slot % d.topk;
    bool bad;
    const int32_t e = slot_expert(in.idx, t, k, d, bad);  // the same for every lane
    const uint32_t j = e < 0 ? 0 : rank_in_expert(r, e, t);
    if (lane == 0) {
      pos[slot] = e < 0 ? -1 : static_cast<int32_t>(r.before[e] + j);
      dst_of[slot] = e < 0 ? -1 : static_cast<int32_t>(d.rank_of_expert(e));
    }
    if (e < 0) continue;
    std::byte* row = dispatch_row_at(p, r, e, j, rb.row);
    warp_copy<Vec>(row, in.x + uint64_t{t} * rb.payload, rb.payload, lane);
    if (kFp8)
      warp_copy<Vec>(row + rb.payload, reinterpret_cast<const std::byte*>(in.scales + uint64_t{t} * (rb.scales / 4)), rb.scales, lane);
    if (lane == 0) store_tail(row + rb.payload + rb.scales, make_uint4(t, k, static_cast<uint32_t>(step), 0), Vec{});
  }
}

// A quantizing dispatch (Quantize): one warp per chunk of kQuantChunk 128-value blocks of a
// token, not per slot, so each value is quantized once however many experts the token goes to:
// the warp loads the chunk's BF16 values (lane l holds values 4l..4l+3 of each block), takes each
// block's amax across the warp, and stores the e4m3 values and the scale into every row of the
// token. The arithmetic is fabric/e4m3.h's, as host_kernels.cpp's quantize_row.
constexpr uint32_t kQuantChunk = 8;

__device__ __forceinline__ uint32_t quantize4(uint2 v, float scale) {
  const float f[4] = {fp8::from_bf16(static_cast<uint16_t>(v.x)), fp8::from_bf16(static_cast<uint16_t>(v.x >> 16)),
                      fp8::from_bf16(static_cast<uint16_t>(v.y)), fp8::from_bf16(static_cast<uint16_t>(v.y >> 16))};
  uint32_t packed = 0;
#pragma unroll
  for (uint32_t i = 0; i < 4; ++i) packed |= uint32_t{fp8::to_e4m3(fp8::div_rn(f[i], scale))} << (8 * i);
  return packed;
}

__device__ __forceinline__ float block_scale(uint2 v, Quantize q) {
  const float a = fmaxf(fabsf(fp8::from_bf16(static_cast<uint16_t>(v.x))), fabsf(fp8::from_bf16(static_cast<uint16_t>(v.x >> 16))));
  const float b = fmaxf(fabsf(fp8::from_bf16(static_cast<uint16_t>(v.y))), fabsf(fp8::from_bf16(static_cast<uint16_t>(v.y >> 16))));
  float amax = fmaxf(a, b);
  for (uint32_t o = 16; o > 0; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(kAllLanes, amax, o));
  return q == Quantize::kPow2 ? fp8::pow2_scale(amax) : fp8::amax_scale(amax);
}

template <uint32_t kHidden>
__device__ void send_quantized_rows(const Ptrs& p, const DispatchInput& in, const Routing& r, uint64_t step) {
  const Dims& d = p.lay.dims;
  const RowBytes rb = row_bytes<kHidden, true>(d);
  const uint32_t lane = threadIdx.x % 32;
  const uint32_t blocks = rb.payload / kScaleBlock, chunks = (blocks + kQuantChunk - 1) / kQuantChunk;
  int32_t* pos = reinterpret_cast<int32_t*>(p.local + p.lay.local.pos);
  int32_t* dst_of = reinterpret_cast<int32_t*>(p.local + p.lay.local.dst);
  const uint32_t items = in.tokens * chunks;
  for (uint32_t item = blockIdx.x * kWarps + threadIdx.x / 32; item < items; item += gridDim.x * kWarps) {
    const uint32_t t = item / chunks, c = item % chunks;
    std::byte* rows[kMaxTopk];
    uint32_t n = 0;
    for (uint32_t k = 0; k < d.topk; ++k) {
      bool bad;
      const int32_t e = slot_expert(in.idx, t, k, d, bad);  // the same for every lane
      const uint32_t j = e < 0 ? 0 : rank_in_expert(r, e, t);
      if (c == 0 && lane == 0) {
        const uint32_t slot = t * d.topk + k;
        pos[slot] = e < 0 ? -1 : static_cast<int32_t>(r.before[e] + j);
        dst_of[slot] = e < 0 ? -1 : static_cast<int32_t>(d.rank_of_expert(e));
      }
      if (e < 0) continue;
      rows[n] = dispatch_row_at(p, r, e, j, rb.row);
      if (c == 0 && lane == 0) store_tail(rows[n] + rb.payload + rb.scales, make_uint4(t, k, static_cast<uint32_t>(step), 0), uint32_t{});
      ++n;
    }
    if (n == 0) continue;
    const uint32_t b0 = c * kQuantChunk, nb = blocks - b0 < kQuantChunk ? blocks - b0 : kQuantChunk;
    const uint2* src = reinterpret_cast<const uint2*>(in.x + uint64_t{t} * 2 * rb.payload) + uint64_t{b0} * 32;
    uint2 v[kQuantChunk];
#pragma unroll
    for (uint32_t b = 0; b < kQuantChunk; ++b)
      if (b < nb) v[b] = src[b * 32 + lane];
#pragma unroll
    for (uint32_t b = 0; b < kQuantChunk; ++b) {
      if (b >= nb) break;  // the same for every lane
      const float scale = block_scale(v[b], in.quantize);
      const uint32_t packed = quantize4(v[b], scale);
      const uint64_t at = uint64_t{b0 + b} * kScaleBlock + 4 * lane;
      for (uint32_t i = 0; i < n; ++i) {
        *reinterpret_cast<uint32_t*>(rows[i] + at) = packed;
        if (lane == 0) *reinterpret_cast<float*>(rows[i] + rb.payload + 4ull * (b0 + b)) = scale;
      }
    }
  }
}

__device__ void raise_dispatch_flags(const Ptrs& p, uint64_t step) {
  const Dims& d = p.lay.dims;
  const uint32_t N = d.node_size;
  if (threadIdx.x < N) store_release_sys(p.node[threadIdx.x] + p.lay.node.dispatch_flag + kLine * (p.rank % N), step);
  if (threadIdx.x == 0) {
    if (d.ranks > N) store_release_sys(p.signals + p.lay.signals.dispatch_sent, step);
    *reinterpret_cast<uint64_t*>(p.local + p.lay.local.step) = step;  // every block has read the old step
  }
}

template <uint32_t kHidden, bool kFp8, typename Vec>
__device__ void dispatch_send_phase(const Ptrs& p, const DispatchInput& in) {
  extern __shared__ uint32_t smem[];
  const uint64_t step = current_step(p) + 1;
  const Routing r = build_routing(p, in, smem);
  if (blockIdx.x == 0) publish_counts(p, in.tokens, r);
  if (kFp8 && in.quantize != Quantize::kNone) send_quantized_rows<kHidden>(p, in, r, step);
  else send_rows<kHidden, kFp8, Vec>(p, in, r, step);
  if (finish_block(scratch(p, kDispatchSendDone))) raise_dispatch_flags(p, step);
}

// ---------------------------------------------------------------------------------------------
// Where the rows of this rank's experts come from (dispatch receive) and go back to (combine
// send), per local expert el and source s at [el * W + s], in the block's shared memory.

struct Sources {
  uint32_t* count;        // c(s, e)
  uint32_t* row_base;     // first row of s's among expert e's output rows (m)
  uint32_t* start;        // E0(e) in s's enumeration: s's rows of this rank's experts below e
  uint32_t* expert_base;  // [L + 1] first flat row of each expert (rows of the experts below)
  uint32_t* dest_base;    // [W] combine: s's first combine position from this rank (node-mate:
                          // cbase(s, me); remote: s's first row in the combine stage)
};

__host__ __device__ inline size_t sources_shared_bytes(const Dims& d) {
  return 4ull * (3ull * d.local_experts * d.ranks + d.local_experts + 1 + d.ranks);
}

// The counts row of source s as this rank sees it (as in host_kernels.cpp).
__device__ __forceinline__ const uint32_t* counts_of(const Ptrs& p, uint32_t s) {
  const Dims& d = p.lay.dims;
  if (d.same_node(s, p.rank))
    return reinterpret_cast<const uint32_t*>(own_node(p) + p.lay.node.counts) + uint64_t{s % d.node_size} * d.experts;
  return reinterpret_cast<const uint32_t*>(p.recv + p.lay.recv.routing) + uint64_t{s} * d.experts;
}

// cbase(s, me) of node-mates, one warp each: s's rows to the experts below this rank's.
__device__ void node_mate_bases(const Ptrs& p, const Sources& t) {
  const Dims& d = p.lay.dims;
  const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const uint32_t first = p.rank / d.node_size * d.node_size;
  for (uint32_t i = warp; i < d.node_size; i += kWarps) {
    const uint32_t* row = counts_of(p, first + i);
    uint32_t n = 0;
    for (uint32_t x = lane; x < p.rank * d.local_experts; x += 32) n += row[x];
    for (uint32_t o = 16; o > 0; o /= 2) n += __shfl_xor_sync(kAllLanes, n, o);
    if (lane == 0) t.dest_base[first + i] = n;
  }
}

__device__ Sources build_sources(const Ptrs& p, uint32_t* smem, bool for_combine) {
  const Dims& d = p.lay.dims;
  const uint32_t W = d.ranks, L = d.local_experts, EW = L * W;
  const Sources t{smem, smem + EW, smem + 2 * EW, smem + 3 * EW, smem + 3 * EW + L + 1};
  for (uint32_t i = threadIdx.x; i < EW; i += kThreads) t.count[i] = counts_of(p, i % W)[p.rank * L + i / W];
  __syncthreads();
  // Threads [0, L) run along the sources of one expert, threads [L, L + W) along the experts of
  // one source (the per-source total lands in dest_base for now).
  for (uint32_t i = threadIdx.x; i < L + W; i += kThreads) {
    uint32_t run = 0;
    if (i < L) {
      for (uint32_t s = 0; s < W; ++s) {
        t.row_base[i * W + s] = run;
        run += t.count[i * W + s];
      }
    } else {
      const uint32_t s = i - L;
      for (uint32_t el = 0; el < L; ++el) {
        t.start[el * W + s] = run;
        run += t.count[el * W + s];
      }
      t.dest_base[s] = run;
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t run = 0;
    for (uint32_t el = 0; el < L; ++el) {
      t.expert_base[el] = run;
      run += t.row_base[el * W + W - 1] + t.count[el * W + W - 1];
    }
    t.expert_base[L] = run;
    if (for_combine) {
      run = 0;  // cstage_base: rows from the remote sources below s, by source
      for (uint32_t s = 0; s < W; ++s)
        if (!d.same_node(s, p.rank)) {
          const uint32_t rows = t.dest_base[s];
          t.dest_base[s] = run;
          run += rows;
        }
    }
  }
  if (for_combine) node_mate_bases(p, t);  // warps 0..N-1; warp 0 after thread 0 above
  __syncthreads();
  return t;
}

// The last index i in [0, n) with a[i] <= x (a non-decreasing, a[0] <= x): the expert or source
// whose rows hold flat row x, stepping over empty ones.
__device__ __forceinline__ uint32_t last_at_most(const uint32_t* a, uint32_t n, uint32_t x, uint32_t stride) {
  uint32_t lo = 0, hi = n;
  while (hi - lo > 1) {
    const uint32_t mid = (lo + hi) / 2;
    if (a[uint64_t{mid} * stride] <= x) lo = mid;
    else hi = mid;
  }
  return lo;
}

struct RowAt {
  uint32_t el, s, j, m;  // expert, source, the row's j among s's rows of el, its row among el's
};
__device__ __forceinline__ RowAt locate(const Sources& t, const Dims& d, uint32_t flat) {
  RowAt a;
  a.el = last_at_most(t.expert_base, d.local_experts, flat, 1);
  a.m = flat - t.expert_base[a.el];
  a.s = last_at_most(t.row_base + uint64_t{a.el} * d.ranks, d.ranks, a.m, 1);
  a.j = a.m - t.row_base[uint64_t{a.el} * d.ranks + a.s];
  return a;
}

// ---------------------------------------------------------------------------------------------
// Dispatch receive.

// Where row j of expert el from source s arrived: the node region for node-mates; for the other
// nodes the private region (the first P rows of s's enumeration) or s's slot of the shared region.
__device__ __forceinline__ const std::byte* received_row(const Ptrs& p, const Sources& t, const RowAt& a, uint32_t row) {
  const Dims& d = p.lay.dims;
  const uint64_t i = uint64_t{a.el} * d.ranks + a.s;
  if (d.same_node(a.s, p.rank))
    return own_node(p) + p.lay.node.rows + ((uint64_t{a.el} * d.node_size + a.s % d.node_size) * d.max_tokens + a.j) * row;
  return p.recv + received_row_offset(d, p.lay.recv, a.s, p.rank, t.start[i] + a.j);
}

template <uint32_t kHidden, bool kFp8, typename Vec>
__device__ void copy_received_rows(const Ptrs& p, const Sources& t, uint64_t step) {
  const Dims& d = p.lay.dims;
  const RowBytes rb = row_bytes<kHidden, kFp8>(d);
  const uint64_t M = d.rows_per_expert();
  int32_t* out_src = reinterpret_cast<int32_t*>(p.out + p.lay.out.src);
  const uint32_t lane = threadIdx.x % 32, rows = t.expert_base[d.local_experts];
  for (uint32_t flat = blockIdx.x * kWarps + threadIdx.x / 32; flat < rows; flat += gridDim.x * kWarps) {
    const RowAt a = locate(t, d, flat);
    const std::byte* src = received_row(p, t, a, rb.row);
    const uint64_t out_row = a.el * M + a.m;
    uint4 tail{};
    if (lane == 0) tail = load_tail(src + rb.payload + rb.scales, Vec{});  // in flight with the copy
    warp_copy<Vec>(p.out + p.lay.out.x + out_row * rb.payload, src, rb.payload, lane);
    if (kFp8) warp_copy<Vec>(p.out + p.lay.out.scales + out_row * rb.scales, src + rb.payload, rb.scales, lane);
    if (lane == 0) {
      if (tail.z != static_cast<uint32_t>(step)) report(p, error_word(KernelError::kStaleRow, a.s + 1));
      out_src[out_row] = static_cast<int32_t>(a.s * d.max_tokens + tail.x);
    }
  }
}

__device__ __forceinline__ bool kernel_failed(const Ptrs& p) {
  return load_acquire_sys(p.signals + p.lay.signals.kernel_error) != 0;
}

// The other nodes' counts rows into host memory for this rank's proxy, whose combine reads them
// there (recv.routing may be device memory). Fenced at system scope: the combine send half's flag,
// raised by a later kernel, must not overtake them.
__device__ void publish_routing(const Ptrs& p) {
  const Dims& d = p.lay.dims;
  if (d.ranks == d.node_size) return;
  const uint32_t* from = reinterpret_cast<const uint32_t*>(p.recv + p.lay.recv.routing);
  uint32_t* to = reinterpret_cast<uint32_t*>(p.signals + p.lay.signals.routing);
  for (uint32_t i = threadIdx.x; i < d.ranks * d.experts; i += kThreads)
    if (!d.same_node(i / d.experts, p.rank)) to[i] = from[i];
  __threadfence_system();
}

// The rows of every source, copied by the blocks whose wait succeeded. The counts and runs are
// written last, by the last block to finish: the real ones when no block of this rank gave up
// (and no row was stale), else kInvalidCount / kInvalidRun, so a failed step never leaves
// plausible outputs behind.
template <uint32_t kHidden, bool kFp8, typename Vec>
__device__ void dispatch_recv_phase(const Ptrs& p) {
  extern __shared__ uint32_t smem[];
  const Dims& d = p.lay.dims;
  const uint64_t step = current_step(p);
  const bool ok = wait_sources(p, step, KernelError::kDispatchTimeout, kDispatchRecvTicket, kDispatchRecvGo,
                               [&](uint32_t s) { return dispatch_arrived(p, s, step); });
  Sources t{};
  if (ok) {
    t = build_sources(p, smem, false);
    if (blockIdx.x == 0) publish_routing(p);
    copy_received_rows<kHidden, kFp8, Vec>(p, t, step);
  }
  if (finish_block(scratch(p, kDispatchRecvDone))) {
    const bool valid = ok && !kernel_failed(p);
    for (uint32_t el = threadIdx.x; el < d.local_experts; el += kThreads)
      reinterpret_cast<int32_t*>(p.out + p.lay.out.counts)[el] =
          valid ? static_cast<int32_t>(t.expert_base[el + 1] - t.expert_base[el]) : kInvalidCount;
    for (uint32_t i = threadIdx.x; i < d.local_experts * d.ranks; i += kThreads)
      reinterpret_cast<int64_t*>(p.out + p.lay.out.runs)[i] =
          valid ? static_cast<int64_t>((uint64_t{t.row_base[i]} << 32) | t.count[i]) : kInvalidRun;  // count low, first high
  }
}

// ---------------------------------------------------------------------------------------------
// Combine send.

__device__ void raise_combine_flags(const Ptrs& p, uint64_t seq) {
  const Dims& d = p.lay.dims;
  const uint32_t N = d.node_size;
  if (threadIdx.x < N) store_release_sys(p.node[threadIdx.x] + p.lay.node.combine_flag + kLine * (p.rank % N), seq);
  if (threadIdx.x == 0) {
    if (d.ranks > N) store_release_sys(p.signals + p.lay.signals.combine_sent, seq);
    *reinterpret_cast<uint64_t*>(p.local + p.lay.local.combines) = seq;  // every block has read the old one
  }
}

// One warp per expert-output row: to the source's node region (node-mates) or into the combine
// stage (other nodes), at the row's combine position.
template <uint32_t kHidden>
__device__ void combine_send_phase(const Ptrs& p, const uint16_t* expert_out) {
  extern __shared__ uint32_t smem[];
  const Dims& d = p.lay.dims;
  const uint64_t seq = current_combine(p) + 1;
  const Sources t = build_sources(p, smem, true);
  const uint32_t B = 2 * (kHidden != 0 ? kHidden : d.hidden);
  const uint64_t M = d.rows_per_expert();
  const uint32_t lane = threadIdx.x % 32, rows = t.expert_base[d.local_experts];
  for (uint32_t flat = blockIdx.x * kWarps + threadIdx.x / 32; flat < rows; flat += gridDim.x * kWarps) {
    const RowAt a = locate(t, d, flat);
    const uint64_t position = uint64_t{t.dest_base[a.s]} + t.start[uint64_t{a.el} * d.ranks + a.s] + a.j;
    std::byte* dst = d.same_node(a.s, p.rank) ? p.node[a.s % d.node_size] + p.lay.node.combine + combine_half(d, seq)
                                              : p.send + p.lay.send.cstage + cstage_half(d, seq);
    const auto* src = reinterpret_cast<const std::byte*>(expert_out) + (a.el * M + a.m) * B;
    warp_copy<uint4>(dst + position * B, src, B, lane);
  }
  if (finish_block(scratch(p, kCombineSendDone))) raise_combine_flags(p, seq);
}

// ---------------------------------------------------------------------------------------------
// Combine receive.

constexpr uint32_t kMaxTopk = 8;       // AllToAllConfig allows 1-8
constexpr uint32_t kSegmentValues = 256;  // a warp sums 256 values of a token: 8 BF16 (16 bytes) per lane

__device__ __forceinline__ void accumulate(float (&acc)[8], uint4 v, float w) {
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (uint32_t i = 0; i < 4; ++i) {
    acc[2 * i] = fmaf(w, bf16_to_float(static_cast<uint16_t>(words[i] & 0xFFFFu)), acc[2 * i]);
    acc[2 * i + 1] = fmaf(w, bf16_to_float(static_cast<uint16_t>(words[i] >> 16)), acc[2 * i + 1]);
  }
}
__device__ __forceinline__ uint4 to_bf16(const float (&acc)[8]) {
  uint32_t words[4];
#pragma unroll
  for (uint32_t i = 0; i < 4; ++i) words[i] = uint32_t{float_to_bf16(acc[2 * i])} | (uint32_t{float_to_bf16(acc[2 * i + 1])} << 16);
  return make_uint4(words[0], words[1], words[2], words[3]);
}

// Values [seg * 256, (seg + 1) * 256) of token t: the used slots' rows weighted and summed in slot
// order in fp32 with fmaf, rounded to BF16 once (as host_kernels.cpp does). Every slot's load is
// issued before the sum starts, so a warp waits one memory latency, not topk of them.
__device__ void combine_segment(const Ptrs& p, uint64_t half, uint16_t* out, const float* topk_weights, uint32_t hidden, uint32_t t,
                                uint32_t seg, uint32_t lane) {
  const Dims& d = p.lay.dims;
  const int32_t* pos = reinterpret_cast<const int32_t*>(p.local + p.lay.local.pos) + uint64_t{t} * d.topk;
  const int32_t* dst_of = reinterpret_cast<const int32_t*>(p.local + p.lay.local.dst) + uint64_t{t} * d.topk;
  const float* weights = topk_weights + uint64_t{t} * d.topk;
  const uint32_t h = seg * kSegmentValues + lane * 8;
  const bool mine = h < hidden;  // the last segment of a hidden size not a multiple of 256
  const uint64_t B = 2ull * hidden;
  uint4 v[kMaxTopk];
  bool used[kMaxTopk];
#pragma unroll
  for (uint32_t k = 0; k < kMaxTopk; ++k) {
    const int32_t at = k < d.topk ? pos[k] : -1;
    used[k] = at >= 0;
    if (used[k] && mine) {
      const std::byte* base = d.same_node(static_cast<uint32_t>(dst_of[k]), p.rank) ? own_node(p) + p.lay.node.combine + half
                                                                                   : p.recv + p.lay.recv.combine + half;
      v[k] = *reinterpret_cast<const uint4*>(base + uint64_t(at) * B + 2ull * h);
    }
  }
  if (!mine) return;
  float acc[8] = {};
#pragma unroll
  for (uint32_t k = 0; k < kMaxTopk; ++k)
    if (used[k]) accumulate(acc, v[k], weights[k]);
  *reinterpret_cast<uint4*>(out + uint64_t{t} * hidden + h) = to_bf16(acc);
}

__host__ __device__ inline uint32_t combine_segments(uint32_t hidden) { return (hidden + kSegmentValues - 1) / kSegmentValues; }

// The blocks whose wait succeeded sum their segments; the last block to finish overwrites all of
// `out` with NaN when a block of this rank gave up, so a failed step leaves no plausible sums.
template <uint32_t kHidden>
__device__ void combine_recv_phase(const Ptrs& p, uint16_t* out, const float* topk_weights) {
  const Dims& d = p.lay.dims;
  const uint64_t seq = current_combine(p);
  const bool ok = wait_sources(p, seq, KernelError::kCombineTimeout, kCombineRecvTicket, kCombineRecvGo,
                               [&](uint32_t s) { return combine_arrived(p, s, seq); });
  const uint32_t hidden = kHidden != 0 ? kHidden : d.hidden, segs = combine_segments(hidden);
  // The caller gives no `out` only for a dispatch of no tokens (all_to_all.cpp checks).
  const uint32_t tokens = out ? *reinterpret_cast<const uint32_t*>(p.local + p.lay.local.tokens) : 0;
  const uint32_t lane = threadIdx.x % 32;
  if (ok)
    for (uint32_t item = blockIdx.x * kWarps + threadIdx.x / 32; item < tokens * segs; item += gridDim.x * kWarps)
      combine_segment(p, combine_half(d, seq), out, topk_weights, hidden, item / segs, item % segs, lane);
  if (finish_block(scratch(p, kCombineRecvDone)) && (!ok || kernel_failed(p))) {
    const uint32_t nan2 = uint32_t{kInvalidBf16} | (uint32_t{kInvalidBf16} << 16);
    auto* words = reinterpret_cast<uint32_t*>(out);  // hidden is a multiple of 128: whole words
    for (uint64_t i = threadIdx.x; i < uint64_t{tokens} * hidden / 2; i += kThreads) words[i] = nan2;
  }
}

// ---------------------------------------------------------------------------------------------
// The kernels: one `dispatch` and one `combine`, each launched once per phase (send, then
// receive), as DeepEP's are. DeepEP's own test profiles its kernels by name (bench_kineto:
// exactly one profile row holding "dispatch" and one holding "combine", and in the hook mode two
// "::dispatch" launches per call), so the names are part of the compatibility.

enum class Phase : uint32_t { kSend = 0, kRecv = 1 };

struct CombineKernelArgs {
  const uint16_t* expert_out = nullptr;  // send
  uint16_t* out = nullptr;               // receive
  const float* topk_weights = nullptr;   // receive
};

template <uint32_t kHidden, bool kFp8, typename Vec>
__global__ void __launch_bounds__(kThreads) dispatch(Ptrs p, DispatchInput in, Phase phase) {
  if (phase == Phase::kSend) dispatch_send_phase<kHidden, kFp8, Vec>(p, in);
  else dispatch_recv_phase<kHidden, kFp8, Vec>(p);
}

template <uint32_t kHidden>
__global__ void __launch_bounds__(kThreads) combine(Ptrs p, CombineKernelArgs a, Phase phase) {
  if (phase == Phase::kSend) combine_send_phase<kHidden>(p, a.expert_out);
  else combine_recv_phase<kHidden>(p, a.out, a.topk_weights);
}

// ---------------------------------------------------------------------------------------------
// Host side: checks, shapes, launches.

template <uint32_t kH, bool kF, typename V>
struct Shape {
  static constexpr uint32_t kHidden = kH;  // 0: the runtime hidden size
  static constexpr bool kFp8 = kF;
  using Vec = V;  // the copy word: uint4, or uint32_t where FP8 rows are not 16-byte multiples
};

// Calls launch(Shape{}) with the kernels' compile-time shape for these dims: the common hidden
// sizes get their own instances (constant row sizes, unrolled copies), others the runtime-sized
// one. FP8 rows are 16-byte multiples only when hidden is a multiple of 512 (the scales take
// hidden / 32 bytes); other FP8 rows are copied in 4-byte words.
template <typename Launch>
void with_dispatch_shape(const Dims& d, Launch&& launch) {
  switch (d.hidden) {
    case 2048: return d.fp8 ? launch(Shape<2048, true, uint4>{}) : launch(Shape<2048, false, uint4>{});
    case 4096: return d.fp8 ? launch(Shape<4096, true, uint4>{}) : launch(Shape<4096, false, uint4>{});
    case 5120: return d.fp8 ? launch(Shape<5120, true, uint4>{}) : launch(Shape<5120, false, uint4>{});
    case 7168: return d.fp8 ? launch(Shape<7168, true, uint4>{}) : launch(Shape<7168, false, uint4>{});
    default:
      if (!d.fp8) return launch(Shape<0, false, uint4>{});
      if (d.hidden % 512 == 0) return launch(Shape<0, true, uint4>{});
      return launch(Shape<0, true, uint32_t>{});
  }
}
bool dispatch_rows_vec16(const Dims& d) { return !d.fp8 || d.hidden % 512 == 0; }

// Combine rows are BF16 (2 * hidden bytes, a multiple of 256): only the hidden size varies.
template <typename Launch>
void with_combine_shape(const Dims& d, Launch&& launch) {
  switch (d.hidden) {
    case 2048: return launch(Shape<2048, false, uint4>{});
    case 4096: return launch(Shape<4096, false, uint4>{});
    case 5120: return launch(Shape<5120, false, uint4>{});
    case 7168: return launch(Shape<7168, false, uint4>{});
    default: return launch(Shape<0, false, uint4>{});
  }
}

void launched(const char* what) { ::fabric::cuda::check(what, cudaGetLastError()); }

int current_device() {
  int device = 0;
  ::fabric::cuda::check("cudaGetDevice", cudaGetDevice(&device));
  return device;
}

// SMs of the current device, asked once per device: a launch is sized to fill the GPU.
uint32_t sm_count() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cached[kMaxDevices]{};
  const int device = current_device();
  int n = device < kMaxDevices ? cached[device].load(std::memory_order_relaxed) : 0;
  if (n > 0) return static_cast<uint32_t>(n);
  ::fabric::cuda::check("cudaDeviceGetAttribute(multiprocessors)", cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
  if (n <= 0) n = 1;
  if (device < kMaxDevices) cached[device].store(n, std::memory_order_relaxed);
  return static_cast<uint32_t>(n);
}

// The most dynamic shared memory a block of the current device may opt in to.
size_t max_shared_optin() {
  int most = 0;
  ::fabric::cuda::check("cudaDeviceGetAttribute(shared memory)",
                        cudaDeviceGetAttribute(&most, cudaDevAttrMaxSharedMemoryPerBlockOptin, current_device()));
  return static_cast<size_t>(most);
}

// The most dynamic shared memory any phase of a kernel takes at these dims: each launch allows
// this much, the same every time (a phase allowing less would lower the kernel's cap under a
// graph captured with the other phase).
size_t kernel_shared_bytes(const Dims& d) { return std::max(routing_shared_bytes(d, d.max_tokens), sources_shared_bytes(d)); }

// Lets `kernel` take `bytes` of dynamic shared memory, or says which dimensions are too large.
template <typename Kernel>
void allow_shared(Kernel* kernel, size_t bytes, const char* what) {
  if (bytes <= kDefaultSharedBytes) return;
  const size_t most = max_shared_optin();
  if (bytes > most)
    throw Error(ErrorCode::kUnsupported,
                fmt::format("MoE {} (CUDA): needs {} bytes of shared memory per block for its routing tables, the GPU has {} "
                            "(fewer experts or max_tokens)",
                            what, bytes, most));
  ::fabric::cuda::check("cudaFuncSetAttribute(max dynamic shared memory)",
                        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

void require_aligned(const void* ptr, size_t alignment, const char* what) {
  if (reinterpret_cast<uintptr_t>(ptr) % alignment != 0)
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("MoE (CUDA): {} at {} is not {}-byte aligned (the kernels copy rows in {}-byte words)", what, ptr,
                            alignment, alignment));
}

Ptrs to_ptrs(const Views& v) {
  if (v.lay.dims.node_size == 0 || v.lay.dims.node_size > kMaxNodeSize)
    throw Error(ErrorCode::kInvalidArgument, fmt::format("MoE (CUDA): node_size {} (1 to {})", v.lay.dims.node_size, kMaxNodeSize));
  Ptrs p{};
  p.lay = v.lay;
  p.rank = v.rank;
  for (uint32_t i = 0; i < kMaxNodeSize; ++i) p.node[i] = v.node[i];
  p.recv = v.recv, p.send = v.send, p.signals = v.signals, p.local = v.local, p.out = v.out;
  p.timeout_ns = v.timeout_ns;
  return p;
}

cudaStream_t stream_of(void* stream) { return static_cast<cudaStream_t>(stream); }

// The host side checks what it can without reading device memory; expert indices are checked by
// the kernel (KernelError::kBadExpert).
void check_dispatch(const Dims& d, const DispatchArgs& a) {
  if (a.num_tokens > d.max_tokens)
    throw Error(ErrorCode::kInvalidArgument, fmt::format("MoE dispatch: {} tokens, more than max_tokens {}", a.num_tokens, d.max_tokens));
  if (const char* bad = dispatch_args_error(d, a)) throw Error(ErrorCode::kInvalidArgument, bad);
  if (a.num_tokens == 0) return;
  if (a.quantize != Quantize::kNone) {
    require_aligned(a.x, 8, "dispatch x (BF16, quantized)");  // 4 BF16 per lane load
  } else {
    const size_t word = dispatch_rows_vec16(d) ? 16 : 4;
    require_aligned(a.x, word, "dispatch x");
    if (d.fp8) require_aligned(a.x_scales, word, "dispatch x_scales");
  }
  require_aligned(a.topk_idx, 8, "dispatch topk_idx");
}

}  // namespace

void prepare_kernels(const Dims& d) {
  const size_t need = kernel_shared_bytes(d);
  if (need > kDefaultSharedBytes) {
    const size_t most = max_shared_optin();
    if (need > most)
      throw Error(ErrorCode::kUnsupported,
                  fmt::format("AllToAllConfig: the CUDA kernels need {} bytes of shared memory per block for their routing "
                              "tables at experts {}, ranks {}, max_tokens {}; the GPU has {} (fewer experts or max_tokens)",
                              need, d.experts, d.ranks, d.max_tokens, most));
  }
  // Asking for a kernel's attributes loads it now. Loaded lazily at its first launch instead
  // (CUDA's default), a kernel may wait for this context's running kernels: a receive kernel
  // spinning on another stream for rows it would bring is then never left.
  cudaFuncAttributes attrs{};
  auto load = [&](const void* kernel, const char* what) {
    ::fabric::cuda::check(what, cudaFuncGetAttributes(&attrs, kernel));
  };
  with_dispatch_shape(d, [&](auto shape) {
    using S = decltype(shape);
    load(reinterpret_cast<const void*>(dispatch<S::kHidden, S::kFp8, typename S::Vec>),
         "cudaFuncGetAttributes(MoE dispatch kernel)");
  });
  with_combine_shape(d, [&](auto shape) {
    using S = decltype(shape);
    load(reinterpret_cast<const void*>(combine<S::kHidden>), "cudaFuncGetAttributes(MoE combine kernel)");
  });
}

uint32_t blocks_per_half(uint32_t num_sms) {
  if (num_sms != 0) return num_sms;
  const uint32_t sms = sm_count();
  return sms < kDefaultBlocksPerHalf ? sms : kDefaultBlocksPerHalf;
}

void dispatch_send(const Views& v, const DispatchArgs& a) {
  const Dims& d = v.lay.dims;
  check_dispatch(d, a);
  const Ptrs p = to_ptrs(v);
  const DispatchInput in{static_cast<const std::byte*>(a.x), a.x_scales, a.topk_idx, a.num_tokens, a.quantize};
  const size_t shared = routing_shared_bytes(d, a.num_tokens);
  // A warp per slot (per token chunk when quantizing), as far as the SMs go.
  const uint32_t items = a.quantize != Quantize::kNone
                             ? a.num_tokens * ((d.hidden / kScaleBlock + kQuantChunk - 1) / kQuantChunk)
                             : a.num_tokens * d.topk;
  uint32_t blocks = (items + kWarps - 1) / kWarps;
  blocks = blocks == 0 ? 1 : (blocks < v.max_blocks ? blocks : v.max_blocks);
  with_dispatch_shape(d, [&](auto shape) {
    using S = decltype(shape);
    auto* kernel = dispatch<S::kHidden, S::kFp8, typename S::Vec>;
    allow_shared(kernel, kernel_shared_bytes(d), "dispatch send");
    kernel<<<blocks, kThreads, shared, stream_of(a.stream)>>>(p, in, Phase::kSend);
  });
  launched("MoE dispatch kernel launch (send)");
}

// The receive's per-source waits go to wait_ns; a lane tracks its sources in one 64-bit mask.
static Ptrs recv_ptrs(const Views& v, int64_t* wait_ns) {
  if (wait_ns && v.lay.dims.ranks > 32 * 64)
    throw Error(ErrorCode::kUnsupported, fmt::format("MoE (CUDA): wait statistics for {} ranks (at most 2048)", v.lay.dims.ranks));
  Ptrs p = to_ptrs(v);
  p.wait_ns = wait_ns;
  return p;
}

void dispatch_recv(const Views& v, void* stream, int64_t* wait_ns) {
  const Dims& d = v.lay.dims;
  const Ptrs p = recv_ptrs(v, wait_ns);
  const size_t shared = sources_shared_bytes(d);
  const uint32_t blocks = v.max_blocks;  // rows to copy are known only on the device
  with_dispatch_shape(d, [&](auto shape) {
    using S = decltype(shape);
    auto* kernel = dispatch<S::kHidden, S::kFp8, typename S::Vec>;
    allow_shared(kernel, kernel_shared_bytes(d), "dispatch receive");
    kernel<<<blocks, kThreads, shared, stream_of(stream)>>>(p, DispatchInput{}, Phase::kRecv);
  });
  launched("MoE dispatch kernel launch (receive)");
}

void combine_send(const Views& v, const CombineArgs& a) {
  const Dims& d = v.lay.dims;
  if (!a.expert_out) throw Error(ErrorCode::kInvalidArgument, "MoE combine: expert_out must be given");
  require_aligned(a.expert_out, 16, "combine expert_out");
  const Ptrs p = to_ptrs(v);
  const size_t shared = sources_shared_bytes(d);
  const uint32_t blocks = v.max_blocks;
  with_combine_shape(d, [&](auto shape) {
    using S = decltype(shape);
    auto* kernel = combine<S::kHidden>;
    allow_shared(kernel, kernel_shared_bytes(d), "combine send");
    kernel<<<blocks, kThreads, shared, stream_of(a.stream)>>>(p, CombineKernelArgs{.expert_out = a.expert_out},
                                                              Phase::kSend);
  });
  launched("MoE combine kernel launch (send)");
}

void combine_recv(const Views& v, const CombineArgs& a) {
  const Dims& d = v.lay.dims;
  if (a.out) require_aligned(a.out, 16, "combine out");
  if (a.topk_weights) require_aligned(a.topk_weights, 4, "combine topk_weights");
  const Ptrs p = recv_ptrs(v, a.wait_ns);
  with_combine_shape(d, [&](auto shape) {
    using S = decltype(shape);
    // Tokens are known on the device only: size for max_tokens, up to the grid cap.
    const uint32_t items = d.max_tokens * combine_segments(d.hidden);
    uint32_t blocks = (items + kWarps - 1) / kWarps;
    blocks = blocks == 0 ? 1 : (blocks < v.max_blocks ? blocks : v.max_blocks);
    auto* kernel = combine<S::kHidden>;
    allow_shared(kernel, kernel_shared_bytes(d), "combine receive");
    kernel<<<blocks, kThreads, 0, stream_of(a.stream)>>>(p, CombineKernelArgs{.out = a.out, .topk_weights = a.topk_weights},
                                                         Phase::kRecv);
  });
  launched("MoE combine kernel launch (receive)");
}

}  // namespace fabric::moe::detail::cuda
