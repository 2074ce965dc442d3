// The two implementations of the MoE kernel side (the four halves: dispatch send and receive,
// combine send and receive), over the memory described by layout.h. Both do the same writes in
// the same places and raise the same flags, so one proxy and one protocol serve both.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>

#include "fabric/moe/types.h"
#include "layout.h"

namespace fabric::moe::detail {

inline constexpr uint32_t kMaxNodeSize = 8;

// Pointers the kernel side works on, as its code sees them (host kernels: host pointers; CUDA
// kernels: device pointers, the host regions through their device mapping).
struct Views {
  Layout lay{};
  uint32_t rank = 0;
  std::array<std::byte*, kMaxNodeSize> node{};  // node region of node-mate i (this rank's at rank % N)
  std::byte* recv = nullptr;                    // RDMA receive region
  std::byte* send = nullptr;                    // RDMA send region
  std::byte* signals = nullptr;
  std::byte* local = nullptr;
  std::byte* out = nullptr;
  uint64_t timeout_ns = 0;  // a receive half waiting longer gives up
  uint32_t max_blocks = 0;  // CUDA: the most blocks a half's grid takes (AllToAllConfig::num_sms)
  bool shrink = false;      // AllToAllConfig::shrink: a missing rank is masked, not a failure
};

// Whether rank s is masked (signals.mask; only shrink mode ever sets it).
inline bool rank_masked(const Views& v, uint32_t s) {
  return reinterpret_cast<const std::atomic<uint64_t>*>(v.signals + signal_at(v.lay.signals.mask, s))
             ->load(std::memory_order_acquire) != 0;
}

// What is wrong with a dispatch's pointers and quantize choice (nullptr: nothing), the part of
// the checks both kernel sides make alike.
inline const char* dispatch_args_error(const Dims& d, const DispatchArgs& a) {
  if (a.quantize != Quantize::kNone && a.quantize != Quantize::kAmax && a.quantize != Quantize::kPow2)
    return "MoE dispatch: quantize is not a Quantize value";
  if (a.quantize != Quantize::kNone && !d.fp8)
    return "MoE dispatch: quantize is for an FP8 dispatch (dispatch_dtype kFp8); this AllToAll dispatches BF16";
  if (a.quantize != Quantize::kNone && a.x_scales)
    return "MoE dispatch: x_scales is given with quantize: the send half computes the scales (pass BF16 x alone)";
  if (a.num_tokens > 0 && (!a.x || !a.topk_idx || (d.fp8 && a.quantize == Quantize::kNone && !a.x_scales)))
    return "MoE dispatch: x and topk_idx (and x_scales for FP8 without quantize) must be given";
  return nullptr;
}

namespace host {
// Throws kInvalidArgument for a dispatch the host kernels cannot run (too many tokens, an expert
// out of range or repeated within a token, missing pointers); call before dispatch_send.
void check_dispatch_args(const Dims& d, const DispatchArgs& args);
// Run on the calling thread. `step` counts the set's dispatches from 1, `seq` its combines
// (layout.h). A receive half that times out, or
// finds the AllToAll failed, throws fabric::Error (kTimeout naming the ranks it waited for).
void dispatch_send(const Views& v, const DispatchArgs& args, uint64_t step);
void dispatch_recv(const Views& v, uint64_t step, int64_t* wait_ns);
void combine_send(const Views& v, const CombineArgs& args, uint64_t seq);
void combine_recv(const Views& v, const CombineArgs& args, uint64_t seq);
// What a failed receive half leaves: counts = kInvalidCount; out = NaN (the last dispatch's tokens).
void mark_dispatch_failed(const Views& v);
void mark_combine_failed(const Views& v, const CombineArgs& args);
}  // namespace host

namespace cuda {
// Enqueue kernels on args.stream; the step and the combine sequence live in device memory
// (local.step, local.combines: the send halves increment them), so a captured graph replays
// correctly. A wait that times out stores
// KernelError into signals.kernel_error, marks its outputs invalid (counts = kInvalidCount,
// combine out = NaN) and ends its kernel. Only in CUDA builds.
void dispatch_send(const Views& v, const DispatchArgs& args);
void dispatch_recv(const Views& v, void* stream, int64_t* wait_ns);
void combine_send(const Views& v, const CombineArgs& args);
void combine_recv(const Views& v, const CombineArgs& args);
// The grid cap for config.num_sms on the current device: num_sms if set, else min(SMs, 16).
uint32_t blocks_per_half(uint32_t num_sms);
// Throws kUnsupported, naming the dimensions, when the kernels could not launch at these dims on
// the current device (their shared-memory tables at max_tokens): checked at construction, not at
// some later call (possibly inside a graph capture). Then loads the kernels of these dims, so
// that no first launch waits on a receive kernel already spinning.
void prepare_kernels(const Dims& d);
}  // namespace cuda

}  // namespace fabric::moe::detail
