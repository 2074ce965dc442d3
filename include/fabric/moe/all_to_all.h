// MoE dispatch/combine for decode (issue 18): every rank sends each token to the ranks holding its
// top-k experts and gathers the expert outputs back, split into send and receive halves.
//
// Inside a node, the sending side stores rows straight into its node-mates' receive buffers (a
// node region shared by the node's ranks: CUDA IPC for GPU kernels, POSIX shared memory for host
// kernels) and raises a flag; no proxy is involved. Across nodes, a proxy thread per rank turns the
// sending side's flags into scatters over the TransferEngine and the immediates it counts into
// words the receiving side waits on. The first `private_rows` rows for each remote peer go
// into a private region of that peer, the rest in the same post into the sender's own slot of the
// peer's shared region; the receiver places them by the sender's counts row. The RDMA buffers live
// in host memory by default (pinned and device-mapped for GPU kernels), which the tcp, shm, EFA
// and verbs providers all reach; config.rdma_buffers = kDevice puts them in GPU memory, for a
// domain that reaches it (cuda_ipc, or a NIC with FI_HMEM). docs/api.md describes the protocol;
// src/moe/layout.h has every offset.
//
// Kernel sides: KernelSide::kHost runs the halves on the calling thread over host memory (tests,
// CI, CPU-only decode); KernelSide::kCuda enqueues CUDA kernels on the caller's stream (every
// call capturable in a CUDA graph: no host synchronization, no allocation).
#pragma once

#include <memory>
#include <vector>

#include "fabric/moe/types.h"
#include "fabric/transfer_engine.h"

namespace fabric::moe {

class AllToAll {
 public:
  // Allocates and registers every buffer once, maps the node-mates' node regions and interns the
  // other nodes' receive regions. Collective: every rank constructs its AllToAll at once. Throws
  // fabric::Error (kInvalidArgument naming a bad field).
  AllToAll(TransferEngine& engine, AllToAllConfig config, const AllGather& all_gather);
  ~AllToAll();
  AllToAll(const AllToAll&) = delete;
  AllToAll& operator=(const AllToAll&) = delete;

  // The four halves of one dispatch/combine, in this order for each handle: dispatch_send
  // stages and posts this rank's rows and returns the dispatch's handle; dispatch_recv waits for
  // every rank's rows to this rank and fills output(handle); combine_send sends the expert
  // outputs back; combine_recv sums them into args.out. A received dispatch may be combined again
  // (combine_send, combine_recv once more: DeepEP's test combines each dispatch twice), or not at
  // all. Up to config.buffers dispatches are in flight (dispatch(A), dispatch(B), combine(A),
  // combine(B)). Dispatch n takes buffer set n % buffers, and the dispatch that held the set goes
  // then, combined or not (DeepEP's alternating buffers: every rank makes the same calls): its
  // handle is spent from then on. A call out of order for its handle, a spent handle, or a
  // dispatch whose set still holds a dispatch not yet received (or a combine not yet received) is
  // refused (kInvalidArgument) and changes nothing.
  //
  // Failures: host kernels throw kTimeout naming the ranks whose rows are missing after
  // config.timeout; CUDA kernels give up on the device and every later call (and check()) throws
  // it. Either way the receive half marks its outputs invalid (counts = kInvalidCount, combine
  // `out` = NaN) and the AllToAll is failed: every later call throws, and a job whose peer died
  // builds a new one.
  //
  // Shrink mode (AllToAllConfig::shrink): a missing or failing rank is masked instead (types.h).
  // masked_ranks() lists the masked ranks; set_masked(rank, masked) masks or unmasks one on this
  // rank (DeepEP's low_latency_update_mask_buffer; every rank should do the same, between steps).
  Handle dispatch_send(const DispatchArgs& args);
  // wait_ns: optional [ranks] int64 the receive adds its per-source wait to (CombineArgs::wait_ns).
  void dispatch_recv(const Handle& h, void* stream = nullptr, int64_t* wait_ns = nullptr);
  void combine_send(const Handle& h, const CombineArgs& args);
  void combine_recv(const Handle& h, const CombineArgs& args);
  // Both halves in one call.
  Handle dispatch(const DispatchArgs& args);
  void combine(const Handle& h, const CombineArgs& args);
  // The dispatch output of the handle's buffer set (its addresses are fixed for the AllToAll's
  // life: a captured graph reads the same ones each replay).
  DispatchOutput output(const Handle& h) const;

  // Throws the first failure seen (a proxy's transfer or expectation, a kernel's timed-out wait).
  void check() const;
  std::vector<uint32_t> masked_ranks() const;
  void set_masked(uint32_t rank, bool masked);
  ProxyStats proxy_stats() const;
  const AllToAllConfig& config() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace fabric::moe
