// MoE dispatch/combine for decode (issue 18): every rank sends each token to the ranks holding its
// top-k experts and gathers the expert outputs back, split into send and receive halves.
//
// Inside a node, the sending side stores rows straight into its node-mates' receive buffers (a
// node region shared by the node's ranks: CUDA IPC for GPU kernels, POSIX shared memory for host
// kernels) and raises a flag; no proxy is involved. Across nodes, a proxy thread per rank turns the
// sending side's flags into scatters over the TransferEngine and the immediates it counts into
// words the receiving side waits on. The first `private_rows` rows for each remote peer go
// speculatively into a private region of that peer at once; the rest follow into the shared region
// once every lower rank's routing counts have arrived (they fix the offsets). The RDMA buffers live
// in host memory (pinned and device-mapped for GPU kernels), which the tcp, shm, EFA and verbs
// providers all reach. docs/api.md describes the protocol; src/moe/layout.h has every offset.
//
// Kernel sides: KernelSide::kHost runs the halves on the calling thread over host memory (tests,
// CI, CPU-only decode); KernelSide::kCuda enqueues CUDA kernels on the caller's stream (every
// call capturable in a CUDA graph: no host synchronization, no allocation).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#if defined(__CUDACC__) && __cplusplus < 202002L
// nvcc builds the CUDA kernel side as C++17 (src/moe/gpu_kernels.cu), which the engine's header
// (C++20) does not parse; this header only names the engine.
namespace fabric {
class TransferEngine;
}
#else
#include "fabric/transfer_engine.h"
#endif

namespace fabric::moe {

enum class Dtype : uint8_t {
  kFp8,   // e4m3 bytes, one fp32 scale per 128 values of a row
  kBf16,  // no scales
};
enum class KernelSide : uint8_t { kHost, kCuda };

struct AllToAllConfig {
  uint32_t rank = 0;
  uint32_t ranks = 1;
  uint32_t node_size = 1;      // ranks per NVLink domain (1-8); ranks / node_size nodes
  uint32_t experts = 0;        // a multiple of ranks; expert e lives on rank e / (experts / ranks)
  uint32_t topk = 8;           // experts per token (1-8)
  uint32_t hidden = 7168;      // a multiple of 128
  uint32_t max_tokens = 128;   // per rank and call
  Dtype dispatch_dtype = Dtype::kFp8;  // combine is always BF16
  uint32_t private_rows = 32;  // per remote source: rows sent before the routing counts are known
  std::chrono::milliseconds timeout{10000};  // a receive half waiting longer fails (peer dead?)
  KernelSide side = KernelSide::kHost;
  int cuda_device = 0;        // KernelSide::kCuda
  std::string job = "moe";    // names the node region: unique per job on a host
  bool proxy_busy_poll = false;  // the proxy thread spins without pause (give it a core) or backs off when idle
  // Where this rank's 2^28 immediates go in its engine's space (TransferEngine::reserve_imms; two
  // nodes or more): none, the highest free block. A range that overlaps another user's is refused.
  std::optional<uint32_t> imm_base{};
};

// Exchanges each rank's bytes with every rank (an all-gather over torch.distributed, a store, MPI):
// returns every rank's bytes, in rank order. Called twice by the constructor, collectively.
using AllGather = std::function<std::vector<std::vector<std::byte>>(const std::vector<std::byte>& mine)>;

// One dispatch call. x is [num_tokens][hidden] in the dispatch dtype (FP8: e4m3 bytes, with
// x_scales [num_tokens][hidden / 128] fp32); topk_idx [num_tokens][topk] (-1: slot not used);
// topk_weights [num_tokens][topk] fp32, kept for combine. Host kernels read host memory, CUDA
// kernels device memory (num_tokens and the pointers fixed for a captured graph).
struct DispatchArgs {
  uint32_t num_tokens = 0;
  const void* x = nullptr;
  const float* x_scales = nullptr;
  const int64_t* topk_idx = nullptr;
  const float* topk_weights = nullptr;
  void* stream = nullptr;  // kCuda: the cudaStream_t the kernels go on
};

// Where dispatch puts what this rank's experts received (owned by the AllToAll, valid until the
// next dispatch): expert-major and padded, rows_per_expert = ranks * max_tokens rows per expert.
//   x       [local_experts][rows_per_expert][hidden]      dispatch dtype
//   scales  [local_experts][rows_per_expert][hidden/128]  fp32 (FP8 only)
//   counts  [local_experts] i32: rows of each expert that hold tokens (the rest are stale)
//   src     [local_experts][rows_per_expert] i32: source rank * max_tokens + source token
// Expert e's rows come from source ranks in rank order, each source's by token, then top-k slot.
struct DispatchOutput {
  void* x = nullptr;
  float* scales = nullptr;
  int32_t* counts = nullptr;
  int32_t* src = nullptr;
  uint32_t local_experts = 0;
  uint64_t rows_per_expert = 0;
};

// One combine call. expert_out is BF16 in the dispatch output's layout
// ([local_experts][rows_per_expert][hidden], rows past counts[e] ignored); out gets
// [num_tokens of the last dispatch][hidden] BF16: sum over used slots k (in order) of
// topk_weights[t][k] * expert_out(row of (t, k)), accumulated in fp32 with fused multiply-adds
// and rounded to BF16 once (a token with no used slot gets zeros).
struct CombineArgs {
  const uint16_t* expert_out = nullptr;
  uint16_t* out = nullptr;
  void* stream = nullptr;
};

// What one rank's proxy did (for the benchmark): steps, WRITEs and bytes posted, and the time its
// thread spent handling steps (registering expectations, building and submitting scatters; the
// polling between steps is not counted).
struct ProxyStats {
  uint64_t steps = 0;
  uint64_t writes = 0;
  uint64_t bytes = 0;
  double cpu_ms = 0;
};

class AllToAll {
 public:
  // Allocates and registers every buffer once, maps the node-mates' node regions and interns the
  // other nodes' receive regions. Collective: every rank constructs its AllToAll at once. Throws
  // fabric::Error (kInvalidArgument naming a bad field).
  AllToAll(TransferEngine& engine, AllToAllConfig config, const AllGather& all_gather);
  ~AllToAll();
  AllToAll(const AllToAll&) = delete;
  AllToAll& operator=(const AllToAll&) = delete;

  // The send half stages and posts this rank's rows; the receive half waits for every rank's rows
  // to this rank and fills output(). A call with do_send must precede the one with do_recv of the
  // same step; calls alternate dispatch, combine. Host kernels: kTimeout names the ranks whose
  // rows are missing after config.timeout; the AllToAll is then failed (every later call
  // throws): a job whose peer died builds a new one. CUDA kernels: a wait that times out ends
  // its kernel and marks the AllToAll failed; check() reports it.
  void dispatch(const DispatchArgs& args, bool do_send = true, bool do_recv = true);
  void combine(const CombineArgs& args, bool do_send = true, bool do_recv = true);
  DispatchOutput output() const;

  // Throws the first failure seen (a proxy's transfer or expectation, a kernel's timed-out wait).
  void check() const;
  ProxyStats proxy_stats() const;
  const AllToAllConfig& config() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace fabric::moe
