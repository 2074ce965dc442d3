// Table of interned remote regions (TransferEngine::add_remote), one for all workers. Slots are
// taken and published by the engine under its control mutex; each worker writes only its own
// route in a slot (resolving the owner's addresses, which only that worker may do); application
// threads read it lock-free to validate handles and bounds at submit time. As in MrTable, a slot's
// generation is odd while it is live and handles carry it, so a stale handle never matches a
// reused slot.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>

#include "fabric/types.h"
#include "shared_state/resolved_target.h"
#include "util/slot_map.h"

namespace fabric {

struct RemoteSlot {
  std::atomic<uint32_t> generation{0};
  // Written while the slot is not live, read by any thread (atomics: a reader may race with a
  // reuse, which the generation check then reports as stale).
  std::atomic<uint64_t> len{0};
  std::atomic<bool> local{false};  // reached through this engine's cuda_ipc domain, not its NICs
  std::atomic<uint8_t> imm_bits{32};  // its immediate range's width (MrDesc::imms)
  // Set before the slot is published and cleared after it turns stale, under the engine's
  // control mutex: the descriptor (each worker resolves its owner again after a failure).
  MrDesc desc;
  // Worker w's thread only: its route, which holds the owner's peer record in that worker.
  ResolvedTarget& target(size_t w) { return targets[w]; }
  std::unique_ptr<ResolvedTarget[]> targets;  // one per worker, made when the slot is first taken
};

// What a submitting thread may read of a live slot.
struct RemoteView {
  uint64_t len = 0;
  bool local = false;
  uint8_t imm_bits = 32;
};

// Slots live in a util::SlotMap: room for all of them at once, touched only as interning reaches
// them, each slot's routes made when it is first taken (65,536 slots and their routes made up
// front would cost every engine about 20 MB); a slot never moves, so readers index it without a
// lock.
class RemoteTable {
 public:
  RemoteTable(size_t capacity, size_t workers) : workers_(workers), slots_(capacity) {}

  // Under the engine's control mutex.
  std::optional<uint32_t> take_free_slot() {
    std::optional<uint32_t> s = slots_.take();
    if (s && !slots_[*s].targets) slots_[*s].targets = std::make_unique<ResolvedTarget[]>(workers_);
    return s;
  }
  void return_slot(uint32_t s) { slots_.give(s); }
  RemoteSlot& slot(uint32_t s) { return slots_[s]; }
  size_t capacity() const { return slots_.capacity(); }
  // Slots [0, allocated) exist (any thread).
  size_t allocated() const { return slots_.size(); }
  // The live slot of a handle, or null (a worker's thread).
  RemoteSlot* live(const RemoteMr& r) {
    RemoteSlot* s = (r.generation & 1) ? slots_.find(r.slot) : nullptr;
    return s && s->generation.load(std::memory_order_relaxed) == r.generation ? s : nullptr;
  }

  // Any thread: what a live handle names, read consistently (the generation is checked again
  // after the reads, so a slot reused meanwhile is reported as stale, not half-read).
  std::optional<RemoteView> view(const RemoteMr& r) const {
    const RemoteSlot* s = (r.generation & 1) ? slots_.find(r.slot) : nullptr;
    if (!s || s->generation.load(std::memory_order_acquire) != r.generation) return std::nullopt;
    RemoteView v{s->len.load(std::memory_order_relaxed), s->local.load(std::memory_order_relaxed),
                 s->imm_bits.load(std::memory_order_relaxed)};
    std::atomic_thread_fence(std::memory_order_acquire);
    if (s->generation.load(std::memory_order_relaxed) != r.generation) return std::nullopt;
    return v;
  }

 private:
  const size_t workers_;
  util::SlotMap<RemoteSlot> slots_;
};

}  // namespace fabric
