// RL weight updates (issue 17, second part): the executor that runs an UpdatePlan every step.
//
// Each training rank has one registered arena: its shards at the offsets its source placements
// give, then a staging area of `window` slots (staging_bytes_for). Each inference rank has one or
// two registered weight arenas (buffer sets), laid out as its destination placements say.
//
// Per step, a training rank (WeightSender::update):
//   1. writes its pieces of the units other ranks quantize into their staging slots, as each slot
//      is released (a credit immediate from the quantizer: slot j % window is free once unit
//      j - window has been quantized), and its BF16 pieces straight from its shards;
//   2. for each unit it quantizes, in order: waits for the unit's gather immediates, copies its own
//      part into the slot, quantizes (the UnitHook: host code by default, torch on GPU arenas),
//      releases the slot to the unit `window` later, and writes the FP8 bytes and scales to every
//      inference rank that needs them, once that rank said its buffer set is free (a ready
//      immediate) and the slot's previous sends have completed;
//   3. returns when every WRITE it posted has completed, or throws (kTimeout names what it waited
//      for) once the update's timeout passes. Stages overlap: gathers, quantizing and sends run
//      at once over the window.
// An inference rank (WeightReceiver) says ready(step) for buffer set step % sets, then
// wait_update(step) returns when every source rank's immediates for that step are counted; the counts
// come from the plan, so no message says "done". A timeout names the source ranks still missing.
//
// Failure and what it leaves: with two buffer sets, step s writes only set s % 2; a failed step
// leaves the other set (the last completed step's weights) untouched and usable, and the failed
// set's tensors partially written (some bytes of step s, others older): retry under a new step
// number, which rewrites every byte of its set. With one set, a failed step leaves that set mixed
// until a later step completes. A sender whose update failed is not reused (its peers' staging
// state is unknown): the training job restarts it, and the receivers take the new ranks' arenas
// with set_sources.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "fabric/transfer_engine.h"
#include "fabric/weights/plan.h"

namespace fabric::weights {

// The immediates an update carries: kind (2 bits), step (its tag: 10 bits), an index (16 bits):
// the unit of a gather, the source rank of data, the quantizer of a credit, the inference rank of
// a ready. They are local values of the receiving rank's immediate range (kUpdateImmBits wide,
// reserved by the caller, who registers that rank's arena under it: WeightSenderConfig::imms,
// WeightReceiverConfig::imms), so other users of its engine never count them.
enum class ImmKind : uint32_t { kGather = 0, kData = 1, kCredit = 2, kReady = 3 };
inline constexpr uint8_t kUpdateStepBits = 10;
inline constexpr uint8_t kUpdateImmBits = 2 + kUpdateStepBits + 16;
inline uint32_t update_imm(ImmKind kind, uint64_t step, uint32_t index) {
  return (static_cast<uint32_t>(kind) << (kUpdateImmBits - 2)) |
         static_cast<uint32_t>((step & ((1u << kUpdateStepBits) - 1)) << 16) | (index & 0xFFFF);
}
inline constexpr uint32_t kMaxUpdateRanks = 1u << 16;

// Staging bytes each training rank needs from plan.staging_base[rank] for `window` slots (each
// holds one unit: its gathered BF16 input, its FP8 bytes and its scales).
std::vector<uint64_t> staging_bytes_for(const UpdatePlan& plan, uint32_t window);

// One unit a training rank quantizes, with offsets into its own arena: first the local copies
// (its own part of a gathered unit, rows of row_bytes from src_offset to dst_offset at their
// strides), then quantize rows [r0, r1) of the tensor (cols columns of BF16 at in_offset,
// in_stride bytes per row) into FP8 rows packed at out_offset and block scales at scale_offset.
struct UnitWork {
  QuantizeTask task;
  uint64_t cols = 0;
  std::vector<Copy> local_copies{};
};
// Runs a unit's copies and quantization on the arena (host: memcpy and fp8::quantize_blocks; a
// GPU arena: cuda_unit_hook, or the caller's kernels, finished before it returns).
using UnitHook = std::function<void(const UnitWork&)>;

// The hook for an arena in CUDA device memory (`arena`: its device pointer): a unit's local copies
// and its block quantization (one kernel, bit for bit fp8::quantize_blocks) on a stream of the
// hook's own, synchronised before it returns. Throws kInvalidArgument for memory that is not CUDA
// device memory, kUnsupported in a build without CUDA, and kProvider when a CUDA call fails.
UnitHook cuda_unit_hook(std::byte* arena);

struct WeightSenderConfig {
  std::shared_ptr<const UpdatePlan> plan{};
  uint32_t rank = 0;
  MrHandle arena{};
  std::byte* arena_ptr = nullptr;  // for the default hook (host arenas)
  std::vector<MrDesc> train_arenas{};              // per training rank (this rank's own included)
  std::vector<std::vector<MrDesc>> dest_arenas{};  // [buffer set][inference rank]
  uint32_t window = 2;                             // the same on every training rank
  std::chrono::milliseconds timeout{60000};        // per update
  UnitHook hook{};                                 // empty: the host hook on arena_ptr
  bool trace = false;                              // UpdateTimes::units: a timeline per unit
  // The immediate range (at least kUpdateImmBits wide) that `arena` was registered under
  // (TransferEngine::reg_mr with it): the gathers, credits and ready notices sent to this rank
  // are counted there. Not owned: it must outlive the sender.
  ImmReservation* imms = nullptr;
};

// One unit of a traced update (WeightSenderConfig::trace), in ms from the update's start: when the
// executor's loop first saw its gather complete, when its hook started and returned, and when its
// sends were all submitted.
struct UnitTrace {
  uint32_t unit = 0;
  double input_ms = 0, start_ms = 0, quantized_ms = 0, posted_ms = 0;
};

// Where one update's time went on a training rank (milliseconds). gather_wait and ready_wait are
// the times the next unit waited for its input and for its inference ranks; quantize is the time
// in the unit hook (copies, quantizing and the hook's stream synchronisation); post is the
// calling thread's time inside TransferEngine::submit; drain, from the last submit to the last
// completion. writes: WRITEs (a run of a column split's rows counts one per row); requests:
// what was submitted for them (a run is one PagedWrites).
struct UpdateTimes {
  double total_ms = 0, gather_wait_ms = 0, quantize_ms = 0, ready_wait_ms = 0, drain_ms = 0, post_ms = 0;
  uint64_t writes = 0, requests = 0, bytes = 0, units_quantized = 0;
  std::vector<UnitTrace> units{};  // trace only
};

// The executor's cost model, for a plan and a machine: each GPU's links move link_gbs GB/s (its
// NICs; or, with one_device, the one GPU every rank of both sides shares, its copy bandwidth),
// a unit hook quantizes quantize_gbs GB/s of BF16 input (0: link_gbs), and submitting one request
// costs post_us of a training rank's thread. The pipeline overlaps the three, so an update takes
// the slowest of them plus the fill (the first unit's gather and quantizing, before any send).
// Latency, where given: a unit's hook costs at least unit_us (its launch and synchronisation), and
// a WRITE's round trip (submitted here, its immediate seen there, an answer seen here) is
// write_rtt_us. A training rank then runs its n units one after another, each at least
// max(h, (h + rtt) / window) apart (h: the unit's hook time; unit k + window's gather is released
// by unit k's credit, a round trip before it lands), after a fill of one round trip and its first
// unit, and the last sends land half a round trip later.
struct UpdateCost {
  double link_gbs = 0, quantize_gbs = 0, post_us = 0, unit_us = 0, write_rtt_us = 0;
  bool one_device = false;
  uint32_t window = 2;
  size_t nics = 1;  // NICs per GPU (which WRITEs the executor merges into runs)
};
struct UpdatePrediction {
  double predicted_ms = 0, lower_bound_ms = 0;  // lower bound: the destination bytes over the links alone
  double link_ms = 0, quantize_ms = 0, post_ms = 0, fill_ms = 0;
  double chain_ms = 0;  // the slowest rank's units one after another (the latency terms; 0 without them)
  uint64_t busiest_bytes = 0, requests_max = 0;  // the busiest link's bytes; the most requests of a rank
};
// Throws fabric::Error(kInvalidArgument) for no plan or a link_gbs that is not positive.
UpdatePrediction predict_update(std::shared_ptr<const UpdatePlan> plan, const UpdateCost& cost);

class WeightSender {
 public:
  WeightSender(TransferEngine& engine, WeightSenderConfig config);
  ~WeightSender();
  WeightSender(const WeightSender&) = delete;
  WeightSender& operator=(const WeightSender&) = delete;
  // Runs step `step` (its tag: step mod 2^kUpdateStepBits) and returns when every WRITE of it completed.
  // Throws fabric::Error: kTimeout naming what was still awaited, or the failed WRITE's error.
  UpdateTimes update(uint64_t step);

 private:
  struct State;
  class Step;
  std::unique_ptr<State> s_;
};

struct WeightReceiverConfig {
  std::shared_ptr<const UpdatePlan> plan{};
  uint32_t rank = 0;
  std::vector<MrDesc> train_arenas{};  // per training rank: where ready immediates go
  uint32_t sets = 1;                 // buffer sets the senders alternate over (1 or 2)
  // The immediate range (at least kUpdateImmBits wide) that this rank's weight arenas were
  // registered under: the training ranks' data WRITEs are counted there. Not owned: it must
  // outlive the receiver.
  ImmReservation* imms = nullptr;
};

class WeightReceiver {
 public:
  WeightReceiver(TransferEngine& engine, WeightReceiverConfig config);
  ~WeightReceiver();
  WeightReceiver(const WeightReceiver&) = delete;
  WeightReceiver& operator=(const WeightReceiver&) = delete;
  // Buffer set step % sets may be written: counts step's immediates and tells every source rank.
  void ready(uint64_t step);
  // Returns when step's writes have all landed; throws kTimeout naming the source ranks whose
  // writes are missing (the step is then failed: its tag's late immediates are discarded and a
  // retry takes a new step number), kInvalidArgument for a step never made ready or failed.
  void wait_update(uint64_t step, std::chrono::milliseconds timeout);
  // A restarted training job's arenas (same plan, new processes).
  void set_sources(std::vector<MrDesc> train_arenas);
  uint64_t expected_writes() const;  // immediates per step, over all source ranks

 private:
  struct State;
  std::unique_ptr<State> s_;
};

}  // namespace fabric::weights
