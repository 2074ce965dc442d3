// Table of interned remote regions (TransferEngine::add_remote). Written by the worker (interning
// resolves the owner's addresses, which only the worker may do), read lock-free by application
// threads to validate handles and bounds at submit time. As in MrTable, a slot's generation is
// odd while it is live and handles carry it, so a stale handle never matches a reused slot.
#pragma once

#include <atomic>
#include <cstdint>
#include <optional>
#include <vector>

#include "fabric/types.h"
#include "util/free_slots.h"
#include "worker/transfer.h"

namespace fabric {

struct RemoteSlot {
  std::atomic<uint32_t> generation{0};
  // Written while the slot is not live, read by any thread (atomics: a reader may race with a
  // reuse, which the generation check then reports as stale).
  std::atomic<uint64_t> len{0};
  std::atomic<bool> local{false};  // reached through this engine's cuda_ipc domain, not its NICs
  // Worker thread only: the descriptor (to resolve its owner again after a failure) and the
  // route, which holds the owner's peer record.
  MrDesc desc;
  ResolvedTarget target;
};

// What a submitting thread may read of a live slot.
struct RemoteView {
  uint64_t len = 0;
  bool local = false;
};

class RemoteTable {
 public:
  explicit RemoteTable(size_t capacity) : slots_(capacity), free_(capacity) {}

  // Worker thread only.
  std::optional<uint32_t> take_free_slot() { return free_.take(); }
  void return_slot(uint32_t s) { free_.give(s); }
  RemoteSlot& slot(uint32_t s) { return slots_[s]; }
  size_t capacity() const { return slots_.size(); }
  // The live slot of a handle, or null (worker thread: no concurrent writer).
  RemoteSlot* live(const RemoteMr& r) {
    if (r.slot >= slots_.size() || (r.generation & 1) == 0) return nullptr;
    RemoteSlot& s = slots_[r.slot];
    return s.generation.load(std::memory_order_relaxed) == r.generation ? &s : nullptr;
  }

  // Any thread: what a live handle names, read consistently (the generation is checked again
  // after the reads, so a slot reused meanwhile is reported as stale, not half-read).
  std::optional<RemoteView> view(const RemoteMr& r) const {
    if (r.slot >= slots_.size() || (r.generation & 1) == 0) return std::nullopt;
    const RemoteSlot& s = slots_[r.slot];
    if (s.generation.load(std::memory_order_acquire) != r.generation) return std::nullopt;
    RemoteView v{s.len.load(std::memory_order_relaxed), s.local.load(std::memory_order_relaxed)};
    std::atomic_thread_fence(std::memory_order_acquire);
    if (s.generation.load(std::memory_order_relaxed) != r.generation) return std::nullopt;
    return v;
  }

 private:
  std::vector<RemoteSlot> slots_;
  util::FreeSlots free_;
};

}  // namespace fabric
