// MoE all-to-all (include/fabric/moe/all_to_all.h): where every byte of the protocol lives, and the index
// arithmetic both kernel sides (host threads in host_kernels.cpp, CUDA in gpu_kernels.cu) and the
// proxy share. Plain data and inline functions only, usable from host and device code.
//
// Names: W ranks, N ranks per node (node of rank r: r / N), E experts, L = E / W local experts
// (expert e lives on rank e / L), K experts per token, H hidden, T max tokens per rank,
// P private rows per source, R bytes per dispatched row (H values, then H/128 fp32 scales for
// FP8), B = 2H bytes per combined (BF16) row, M = W * T rows per expert in the output.
//
// The order of a sender s's rows for destination d ("d's enumeration"): by expert of d, then by
// token, then by top-k slot. Row (e, t, k) has index E0(e) + j where E0(e) = sum over d's experts
// e' < e of s's count c(s, e'), and j its rank among s's (t, k) with expert e.
//
// Dispatch, from s to d:
//   - same node: s stores row j of expert e at node.rows[e % L][s % N][j], then s's counts row
//     (all E experts) at node.counts[s % N], then node.dispatch_flag[s % N] = step (release).
//   - other node: s's proxy writes s's counts row to rdma.routing[s] of every other rank
//     (ROUTE imm), rows [0, P) of d's enumeration to rdma.priv[s] (DISPATCH imm, one WRITE), and
//     the rest, rows [P, n(s, d)), to the same places of s's slot of d's shared region,
//     rdma.shared[slot(s, d)][P..] (DISPATCH imm, one WRITE, zero bytes when n <= P). Row (e, j)
//     is at index i = E0(e) + j of the enumeration: in priv[s][i] when i < P, else in
//     shared[slot(s, d)][i]. slot(s, d) numbers the ranks not on d's node in rank order; a slot
//     holds T * min(K, L) rows, the most s can send d. No rank waits for another's counts before
//     it posts: the receiver places the rows with s's counts row, which it holds by then.
// d counts ROUTE(s) once and DISPATCH(s) twice per step from each remote s (its proxy sets
// signals.route_seen[s], dispatch_seen[s] to the step), then copies every source's rows into the
// expert-major output, expert e's rows from sources in rank order, and the remote sources' counts
// rows to signals.routing, where d's proxy reads them for the combine (host memory always).
//
// Combine, from expert rank d back to source s: row j of expert e from s goes to s's combine
// position cbase(s, d) + E0(e) + j, where cbase(s, d) = sum over d' < d of n(s, d') (n: rows s
// sends d). Same node: stored in node.combine, then node.combine_flag[d % N] = step; other node:
// packed contiguously in rdma_send.cstage and written in one WRITE (COMBINE imm) to
// rdma.combine[cbase(s, d)]. s then sums sum_k w[t][k] * row(pos[t][k]) in fp32, k in order,
// with fmaf, rounding to BF16 once.
//
// A dispatch may be combined more than once (DeepEP's test combines each dispatch twice). The
// combine therefore counts its own sequence c (per buffer set, from 1, on every rank alike as
// every rank makes the same calls): the combine flags, combine_sent, combine_seen and the COMBINE
// immediate carry c, not the dispatch step, and the combine rows (node.combine, rdma.combine,
// rdma_send.cstage) have two halves, c taking half c % 2. A rank that finished combine c and
// starts c + 1 then writes the half its slower peers are not reading; it can reach c + 2 only
// once every peer sent c + 1, which each does after it received c.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define FABRIC_HD __host__ __device__ inline
#else
#define FABRIC_HD inline
#endif

namespace fabric::moe::detail {

inline constexpr uint32_t kScaleBlock = 128;  // FP8: one fp32 scale per 128 values
inline constexpr uint32_t kMaxTopk = 8;       // experts per token
inline constexpr uint64_t kLine = 64;          // signal words each on their own cache line

// Immediates: kind (2 bits), step modulo 2^10, the sending rank (16 bits): local values of the
// receiving rank's immediate range (kMoeImmBits wide, reserved by its AllToAll and carried by its
// receive region's MrDesc), so another AllToAll or application on the same engine never counts them.
enum class ImmKind : uint32_t { kRoute = 0, kDispatch = 1, kCombine = 2 };
inline constexpr uint32_t kMoeImmBits = 28;
FABRIC_HD uint32_t moe_imm(ImmKind kind, uint64_t step, uint32_t rank) {
  return (static_cast<uint32_t>(kind) << 26) | static_cast<uint32_t>((step & 0x3FF) << 16) | (rank & 0xFFFF);
}

// The last 16 bytes of every dispatched row: which token it is, and the step that wrote it (the
// receiving side checks it: a row of another step means a protocol or memory error).
struct RowTail {
  uint32_t token = 0;
  uint32_t slot = 0;
  uint32_t step = 0;  // low 32 bits of the dispatch step
  uint32_t pad = 0;
};

struct Dims {
  uint32_t ranks = 0, node_size = 0, experts = 0, local_experts = 0, topk = 0, hidden = 0;
  uint32_t max_tokens = 0, private_rows = 0;
  bool fp8 = true;

  FABRIC_HD uint64_t scales_per_row() const { return fp8 ? hidden / kScaleBlock : 0; }
  FABRIC_HD uint64_t payload_bytes() const { return fp8 ? hidden : 2ull * hidden; }
  // A dispatched row: payload, scales, then a RowTail.
  FABRIC_HD uint64_t row_bytes() const { return payload_bytes() + 4 * scales_per_row() + sizeof(RowTail); }
  FABRIC_HD uint64_t combine_row_bytes() const { return 2ull * hidden; }
  FABRIC_HD uint64_t rows_per_expert() const { return uint64_t{ranks} * max_tokens; }  // M
  FABRIC_HD uint32_t node_of(uint32_t rank) const { return rank / node_size; }
  FABRIC_HD bool same_node(uint32_t a, uint32_t b) const { return node_of(a) == node_of(b); }
  FABRIC_HD uint32_t remote_ranks() const { return ranks - node_size; }
  FABRIC_HD uint32_t rank_of_expert(uint32_t e) const { return e / local_experts; }
  // Rows one rank can send another (a token reaches at most min(K, L) of its experts): a slot of
  // the shared region, and what one rank can send back in a combine to all the other nodes.
  FABRIC_HD uint64_t slot_rows() const {
    return uint64_t{max_tokens} * (topk < local_experts ? topk : local_experts);
  }
  FABRIC_HD uint64_t cstage_rows() const { return uint64_t{remote_ranks()} * slot_rows(); }
};

inline uint64_t align_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

// The node region: shared by the ranks of a node (POSIX shared memory for host kernels, a CUDA
// allocation mapped by IPC for GPU kernels). Offsets from its base.
struct NodeLayout {
  uint64_t dispatch_flag = 0;  // [N] u64, kLine apart
  uint64_t combine_flag = 0;   // [N] u64, kLine apart
  uint64_t counts = 0;         // [N][E] u32: the node-mates' counts rows
  uint64_t rows = 0;           // [L][N][T] rows of row_bytes
  uint64_t combine = 0;        // [2][T * K] combine rows, a half per combine parity
  uint64_t bytes = 0;
};

// The RDMA receive region (registered; written by the other nodes' ranks).
struct RecvLayout {
  uint64_t routing = 0;  // [W][E] u32
  uint64_t priv = 0;     // [W][P] rows
  uint64_t shared = 0;   // [W - N][slot_rows] rows: a slot per rank of the other nodes
  uint64_t combine = 0;  // [2][T * K] combine rows, a half per combine parity
  uint64_t bytes = 0;
};

// The RDMA send region (registered; read by the NICs).
struct SendLayout {
  uint64_t route_row = 0;  // [E] u32: this rank's counts
  uint64_t stage = 0;      // [T * K] rows for the other nodes, by destination rank
  uint64_t cstage = 0;     // [2][cstage_rows] combine rows for the other nodes, by source rank
  uint64_t bytes = 0;
};

// Words the kernel side and the proxy signal each other with (host memory; for GPU kernels
// pinned and device-mapped). Each is a u64 on its own line; the arrays are [W].
struct SignalLayout {
  uint64_t dispatch_sent = 0;  // kernel -> proxy: dispatch step whose rows are staged
  uint64_t combine_sent = 0;   // kernel -> proxy: combine sequence whose rows are staged
  uint64_t failed = 0;         // nonzero once a transfer or expectation failed (proxy counts)
  uint64_t kernel_error = 0;   // a kernel's failure: KernelError << 32 | (rank it waited for + 1)
  uint64_t writes_done = 0;    // the proxy's scatters that completed (diagnostics)
  uint64_t route_seen = 0;     // [W] proxy -> kernel: steps whose counts row from rank s arrived
  uint64_t dispatch_seen = 0;  // [W] steps whose rows from remote rank s all arrived
  uint64_t combine_seen = 0;   // [W] the last combine sequence whose rows from remote rank s arrived
  uint64_t mask = 0;           // [W] nonzero: rank s is masked (shrink mode: it timed out, a WRITE
                               // to it or an expectation of it failed, or set_masked)
  uint64_t route_row = 0;      // [E] u32: this rank's counts row, for the proxy (a copy of
                               // send.route_row, which may be device memory)
  uint64_t routing = 0;        // [W][E] u32: the other nodes' counts rows, for the proxy's
                               // combine (copied from recv.routing, which may be device memory,
                               // by the dispatch receive half; node-mates' rows unused)
  uint64_t bytes = 0;
};

// This rank's own state between dispatch and combine (local memory).
struct LocalLayout {
  uint64_t counts = 0;     // [E] u32: this rank's counts (the last dispatch)
  uint64_t pos = 0;        // [T][K] i32: combine position of (t, k), -1 for a masked slot
  uint64_t dst = 0;        // [T][K] i32: rank holding slot (t, k)'s expert, -1 for a masked slot
  uint64_t step = 0;       // u64: the last dispatch step (GPU kernels keep it here)
  uint64_t combines = 0;   // u64: the last combine sequence (GPU kernels keep it here)
  uint64_t tokens = 0;     // u32: tokens of the last dispatch
  uint64_t live = 0;       // [W] u32: 1 for the sources the last dispatch receive took rows from
                           // (0: masked then; the combine's row positions follow this, not the
                           // mask of the moment)
  uint64_t scratch = 0;    // [max(3E, H)] 4-byte words for host kernels (nothing allocated per call)
  uint64_t bytes = 0;
};

// The expert-major dispatch output (local memory).
struct OutLayout {
  uint64_t x = 0;       // [L][M][H] values of the dispatch dtype
  uint64_t scales = 0;  // [L][M][H/128] fp32 (FP8 only)
  uint64_t counts = 0;  // [L] i32 rows per expert
  uint64_t src = 0;     // [L][M] i32: source rank * T + source token of each row
  uint64_t runs = 0;    // [L][W] i64: (first row << 32) | rows, of each source's rows of each expert
  uint64_t bytes = 0;
};

struct Layout {
  Dims dims;
  NodeLayout node;
  RecvLayout recv;
  SendLayout send;
  SignalLayout signals;
  LocalLayout local;
  OutLayout out;
};

inline Layout make_layout(const Dims& d) {
  Layout l{};
  l.dims = d;
  const uint64_t R = d.row_bytes(), B = d.combine_row_bytes(), TK = uint64_t{d.max_tokens} * d.topk;
  uint64_t o = 0;
  auto take = [&o](uint64_t bytes) {
    const uint64_t at = align_up(o, 256);
    o = at + bytes;
    return at;
  };
  l.node.dispatch_flag = take(kLine * d.node_size);
  l.node.combine_flag = take(kLine * d.node_size);
  l.node.counts = take(4ull * d.node_size * d.experts);
  l.node.rows = take(R * d.local_experts * d.node_size * d.max_tokens);
  l.node.combine = take(2 * B * TK);
  l.node.bytes = align_up(o, 4096);

  o = 0;
  l.recv.routing = take(4ull * d.ranks * d.experts);
  l.recv.priv = take(R * d.ranks * d.private_rows);
  l.recv.shared = take(R * d.remote_ranks() * d.slot_rows());
  l.recv.combine = take(2 * B * TK);
  l.recv.bytes = align_up(o, 4096);

  o = 0;
  l.send.route_row = take(4ull * d.experts);
  l.send.stage = take(R * TK);
  l.send.cstage = take(2 * B * d.cstage_rows());
  l.send.bytes = align_up(o, 4096);

  o = 0;
  l.signals.dispatch_sent = take(kLine);
  l.signals.combine_sent = take(kLine);
  l.signals.failed = take(kLine);
  l.signals.kernel_error = take(kLine);
  l.signals.writes_done = take(kLine);
  l.signals.route_seen = take(kLine * d.ranks);
  l.signals.dispatch_seen = take(kLine * d.ranks);
  l.signals.combine_seen = take(kLine * d.ranks);
  l.signals.mask = take(kLine * d.ranks);
  l.signals.route_row = take(4ull * d.experts);
  l.signals.routing = take(4ull * d.ranks * d.experts);
  l.signals.bytes = align_up(o, 4096);

  o = 0;
  l.local.counts = take(4ull * d.experts);
  l.local.pos = take(4 * TK);
  l.local.dst = take(4 * TK);
  l.local.step = take(8);
  l.local.combines = take(8);
  l.local.tokens = take(4);
  l.local.live = take(4ull * d.ranks);
  l.local.scratch = take(4ull * (3ull * d.experts > d.hidden ? 3ull * d.experts : d.hidden));
  l.local.bytes = align_up(o, 256);

  o = 0;
  const uint64_t M = d.rows_per_expert();
  l.out.x = take(d.payload_bytes() * d.local_experts * M);
  l.out.scales = take(4 * d.scales_per_row() * d.local_experts * M);
  l.out.counts = take(4ull * d.local_experts);
  l.out.src = take(4 * d.local_experts * M);
  l.out.runs = take(8ull * d.local_experts * d.ranks);
  l.out.bytes = align_up(o, 256);
  return l;
}

// What a kernel that gave up reports in signals.kernel_error (the high 32 bits).
enum class KernelError : uint32_t {
  kNone = 0,
  kDispatchTimeout = 1,  // dispatch receive: rows of a rank missing (low bits: that rank + 1)
  kCombineTimeout = 2,   // combine receive: rows of a rank missing
  kBadExpert = 3,        // an expert index >= experts, or repeated within a token
  kStaleRow = 4,         // a received row carries another step (low bits: its source + 1)
  kFailed = 5,           // gave up because the AllToAll had failed already
};

// Combine arithmetic, the same on both kernel sides: BF16 to fp32 exactly, fp32 to BF16 rounding
// to nearest even (NaN stays a quiet NaN of the same sign).
FABRIC_HD float bf16_to_float(uint16_t b) {
  const uint32_t u = uint32_t{b} << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
FABRIC_HD uint16_t float_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// Where combine `seq`'s half of the combine rows starts, from node.combine / recv.combine
// (combine_half) and from send.cstage (cstage_half).
FABRIC_HD uint64_t combine_half(const Dims& d, uint64_t seq) {
  return (seq & 1) * d.combine_row_bytes() * d.max_tokens * d.topk;
}
FABRIC_HD uint64_t cstage_half(const Dims& d, uint64_t seq) { return (seq & 1) * d.combine_row_bytes() * d.cstage_rows(); }

// Signal word i of an array at `offset` in the signal region.
FABRIC_HD uint64_t signal_at(uint64_t offset, uint32_t i) { return offset + kLine * i; }

// Rows s sends rank d (n(s, d)) and where expert e's rows start in d's enumeration (E0), from s's
// counts row.
FABRIC_HD uint32_t rows_to(const Dims& d, const uint32_t* counts, uint32_t dst) {
  uint32_t n = 0;
  for (uint32_t e = dst * d.local_experts; e < (dst + 1) * d.local_experts; ++e) n += counts[e];
  return n;
}
FABRIC_HD uint32_t expert_start(const Dims& d, const uint32_t* counts, uint32_t e) {
  uint32_t n = 0;
  for (uint32_t x = d.rank_of_expert(e) * d.local_experts; x < e; ++x) n += counts[x];
  return n;
}

// slot(s, d): source `src`'s slot in `dst`'s shared region (src on another node than dst's).
FABRIC_HD uint32_t remote_slot(const Dims& d, uint32_t src, uint32_t dst) {
  const uint32_t first = d.node_of(dst) * d.node_size;  // dst's node: ranks [first, first + N)
  return src < first ? src : src - d.node_size;
}

// Where row (e, j) from remote source `src` sits in `dst`'s receive region: `index` = E0(e) + j in
// src's enumeration for dst; the first P indices in src's private rows, the rest at the same
// index of src's slot of the shared region.
FABRIC_HD uint64_t received_row_offset(const Dims& d, const RecvLayout& r, uint32_t src, uint32_t dst, uint32_t index) {
  if (index < d.private_rows) return r.priv + (uint64_t{src} * d.private_rows + index) * d.row_bytes();
  return r.shared + (uint64_t{remote_slot(d, src, dst)} * d.slot_rows() + index) * d.row_bytes();
}

// cbase(s, d): where expert rank d's rows start among s's combine positions.
FABRIC_HD uint32_t combine_base(const Dims& d, const uint32_t* counts, uint32_t dst) {
  uint32_t n = 0;
  for (uint32_t x = 0; x < dst * d.local_experts; ++x) n += counts[x];
  return n;
}

// Offset of d's rows in s's dispatch stage: rows for the remote ranks below d.
FABRIC_HD uint64_t stage_base(const Dims& d, const uint32_t* counts, uint32_t src, uint32_t dst) {
  uint64_t n = 0;
  for (uint32_t x = 0; x < dst; ++x)
    if (!d.same_node(x, src)) n += rows_to(d, counts, x);
  return n;
}

// Offset of source s's rows in expert rank d's combine stage: rows from remote ranks below s.
FABRIC_HD uint64_t cstage_base(const Dims& d, const uint32_t* routing, uint32_t src, uint32_t dst) {
  uint64_t n = 0;
  for (uint32_t x = 0; x < src; ++x)
    if (!d.same_node(x, dst)) n += rows_to(d, routing + uint64_t{x} * d.experts, dst);
  return n;
}

}  // namespace fabric::moe::detail
