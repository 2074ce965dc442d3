// MoE dispatch/combine: the value types (configuration, call arguments, outputs) that the
// AllToAll (fabric/moe/all_to_all.h) and its kernel sides share. No engine here: the CUDA kernel
// side (src/moe/gpu_kernels.cu, built as C++17 by nvcc) includes this header alone.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace fabric::moe {

enum class Dtype : uint8_t {
  kFp8,   // e4m3 bytes, one fp32 scale per 128 values of a row
  kBf16,  // no scales
};
enum class KernelSide : uint8_t { kHost, kCuda };
// Where the regions between nodes (what the proxy's WRITEs read and write) live. kHost: host
// memory (pinned and device-mapped for CUDA kernels), which every provider reaches. kDevice
// (KernelSide::kCuda only): device memory, written through whatever domain of the engine reaches
// the peer's GPU memory: the cuda_ipc domain between processes of one host (EngineConfig::
// cuda_ipc, cuda_device), a NIC with FI_HMEM elsewhere. The protocol is the same.
enum class RdmaBuffers : uint8_t { kHost, kDevice };

struct AllToAllConfig {
  uint32_t rank = 0;
  uint32_t ranks = 1;
  uint32_t node_size = 1;     // ranks per NVLink domain (1-8); ranks / node_size nodes
  uint32_t experts = 0;       // a multiple of ranks; expert e lives on rank e / (experts / ranks)
  uint32_t topk = 8;          // experts per token (1-8)
  uint32_t hidden = 7168;     // a multiple of 128
  uint32_t max_tokens = 128;  // per rank and call
  Dtype dispatch_dtype = Dtype::kFp8;  // combine is always BF16
  uint32_t private_rows = 32;  // per remote source: rows sent before the routing counts are known
  std::chrono::milliseconds timeout{10000};  // a receive half waiting longer fails (peer dead?)
  KernelSide side = KernelSide::kHost;
  int cuda_device = 0;      // KernelSide::kCuda
  std::string job = "moe";  // names the node region: unique per job on a host
  bool proxy_busy_poll =
      false;  // the proxy thread spins without pause (give it a core) or backs off when idle
  // Where this rank's immediates go in its engine's space (TransferEngine::reserve_imms; two nodes
  // or more): 2^28 per buffer set, set i at imm_base + i * 2^28; none: the highest free blocks. A
  // range that overlaps another user's is refused.
  std::optional<uint32_t> imm_base{};
  // Buffer sets (1-4): dispatches in flight at once. Dispatch n (from 0) uses set n % buffers; a
  // set is free again once its combine received. Two give two-batch overlap: dispatch(A),
  // dispatch(B), combine(A), combine(B). Each set is a whole copy of the buffers (memory x
  // buffers).
  uint32_t buffers = 2;
  // KernelSide::kCuda: the most blocks (one per SM) each half's grid takes, so that a receive half
  // waiting for its peers leaves SMs to the send halves and to compute sharing the GPU (several
  // ranks on one GPU, or experts running beside a wait). 0: min(SMs, 16).
  uint32_t num_sms = 0;
  RdmaBuffers rdma_buffers = RdmaBuffers::kHost;
  // Shrink mode (DeepEP's enable_shrink; host kernels): a rank whose rows are missing after
  // `timeout`, or whose WRITEs or immediates fail, is masked instead of failing the AllToAll.
  // Nothing more is sent to it or waited for; its rows count as none, and combine leaves out the
  // slots its experts held (their weight counts as zero). AllToAll::masked_ranks / set_masked
  // read and change the mask. Without it a missing rank fails the AllToAll (kTimeout naming it).
  bool shrink = false;
};

// What dispatch_send returns and the later halves of that dispatch take: which buffer set holds
// its rows, the dispatch's number (from 1, over every set), and its tokens. Plain data.
struct Handle {
  uint32_t buffer = 0;
  uint64_t step = 0;
  uint32_t num_tokens = 0;
};

// Written to every DispatchOutput::counts entry (and kInvalidRun to every runs entry) by a
// dispatch receive that failed (timed out, or found the AllToAll failed): never a plausible
// count. A failed combine receive fills `out` with BF16 NaN (kInvalidBf16).
inline constexpr int32_t kInvalidCount = -1;
inline constexpr int64_t kInvalidRun = -1;
inline constexpr uint16_t kInvalidBf16 = 0x7FC0;

// Exchanges each rank's bytes with every rank (an all-gather over torch.distributed, a store, MPI):
// returns every rank's bytes, in rank order. Called twice by the constructor, collectively.
using AllGather =
    std::function<std::vector<std::vector<std::byte>>(const std::vector<std::byte>& mine)>;

// Who quantizes an FP8 dispatch's tokens. kNone: the caller (x is e4m3 bytes with x_scales).
// Otherwise x is BF16 and the send half quantizes each 128 values of a token as it stages the
// token's rows (DeepEP's low_latency_dispatch with use_fp8), into values e4m3(x / scale) rounded
// to nearest even and one fp32 scale (fabric/e4m3.h):
//   kAmax  scale = amax / 448 (1 for a block of zeros): fabric_lib.moe.quantize_fp8_tokens
//   kPow2  scale = 2^ceil(log2(max(amax, 1e-4) / 448)), a power of two that one UE8M0 exponent
//          holds exactly (DeepEP's round_scale)
enum class Quantize : uint8_t { kNone, kAmax, kPow2 };

// One dispatch call. x is [num_tokens][hidden] in the dispatch dtype (FP8: e4m3 bytes, with
// x_scales [num_tokens][hidden / 128] fp32), or BF16 for an FP8 dispatch that quantizes
// (`quantize`, then no x_scales); topk_idx [num_tokens][topk] (-1: slot not used). The routing
// weights go to combine (CombineArgs), as in DeepEP. Host kernels read host memory, CUDA kernels
// device memory (num_tokens and the pointers fixed for a captured graph).
struct DispatchArgs {
  uint32_t num_tokens = 0;
  const void* x = nullptr;
  const float* x_scales = nullptr;
  const int64_t* topk_idx = nullptr;
  void* stream = nullptr;  // kCuda: the cudaStream_t the kernels go on
  Quantize quantize = Quantize::kNone;
};

// Where dispatch puts what this rank's experts received (owned by the AllToAll: its handle's
// buffer set, valid until that set's next dispatch): expert-major and padded, rows_per_expert =
// ranks * max_tokens rows per expert.
//   x       [local_experts][rows_per_expert][hidden]      dispatch dtype
//   scales  [local_experts][rows_per_expert][hidden/128]  fp32 (FP8 only)
//   counts  [local_experts] i32: rows of each expert that hold tokens (the rest are stale);
//           kInvalidCount in every entry after a failed receive
//   src     [local_experts][rows_per_expert] i32: source rank * max_tokens + source token
//   runs    [local_experts][ranks] i64: (first row << 32) | rows, of each source rank's rows of
//           each expert, as DeepEP packs its layout_range (pack2(count, begin): the count in the
//           low 32 bits, the first row in the high 32); an empty run starts where the next one does;
//           kInvalidRun in every entry after a failed receive
// Expert e's rows come from source ranks in rank order, each source's by token, then top-k slot.
struct DispatchOutput {
  void* x = nullptr;
  float* scales = nullptr;
  int32_t* counts = nullptr;
  int32_t* src = nullptr;
  int64_t* runs = nullptr;
  uint32_t local_experts = 0;
  uint64_t rows_per_expert = 0;
};

// One combine call (the send half reads expert_out, the receive half topk_weights and out).
// expert_out is BF16 in the dispatch output's layout ([local_experts][rows_per_expert][hidden],
// rows past counts[e] ignored); topk_weights [num_tokens of the handle][topk] fp32; out gets
// [num_tokens of the handle][hidden] BF16: sum over used slots k (in order) of
// topk_weights[t][k] * expert_out(row of (t, k)), accumulated in fp32 with fused multiply-adds
// and rounded to BF16 once (a token with no used slot gets zeros).
struct CombineArgs {
  const uint16_t* expert_out = nullptr;
  const float* topk_weights = nullptr;
  uint16_t* out = nullptr;
  void* stream = nullptr;
  // Optional [ranks] int64: the receive adds, per source rank, the nanoseconds it waited for that
  // rank's rows (DeepEP's *_wait_recv_cost_stats, in ns rather than GPU cycles).
  int64_t* wait_ns = nullptr;
};

// What one rank's proxy did (for the benchmark): steps, WRITEs and bytes posted, and the time its
// thread spent handling steps (registering expectations, building and submitting scatters; the
// polling between steps is not counted). dispatch_wait_ms / combine_wait_ms: sums over steps of
// the host time, by the proxy thread's clock, from this rank's first post of the half to the last
// immediate of it from the other nodes counted (their proxies, the transport and the immediates).
struct ProxyStats {
  uint64_t steps = 0;
  uint64_t writes = 0;
  uint64_t bytes = 0;
  double cpu_ms = 0;
  double dispatch_wait_ms = 0;
  double combine_wait_ms = 0;
};

}  // namespace fabric::moe
