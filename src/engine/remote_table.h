// Table of interned remote regions (TransferEngine::add_remote). Written by the worker (interning
// resolves the owner's addresses, which only the worker may do), read lock-free by application
// threads to validate handles and bounds at submit time. As in MrTable, a slot's generation is
// odd while it is live and handles carry it, so a stale handle never matches a reused slot.
#pragma once

#include <algorithm>
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

// Slots come in chunks, allocated by the worker as interning needs them (a full table of
// 65,536 slots would cost every engine about 20 MB up front); a chunk never moves or goes before
// the table does, so readers index it without a lock.
class RemoteTable {
 public:
  static constexpr size_t kChunk = 256;
  explicit RemoteTable(size_t capacity) : capacity_(capacity), chunks_((capacity + kChunk - 1) / kChunk) {}
  ~RemoteTable() {
    for (auto& c : chunks_) delete[] c.load(std::memory_order_relaxed);
  }
  RemoteTable(const RemoteTable&) = delete;
  RemoteTable& operator=(const RemoteTable&) = delete;

  // Worker thread only.
  std::optional<uint32_t> take_free_slot() {
    if (auto s = free_.take()) return s;
    if (allocated_ >= capacity_) return std::nullopt;
    const size_t first = allocated_;
    chunks_[first / kChunk].store(new RemoteSlot[kChunk], std::memory_order_release);
    allocated_ = std::min(capacity_, first + kChunk);
    for (size_t i = allocated_; i-- > first + 1;) free_.give(static_cast<uint32_t>(i));
    return static_cast<uint32_t>(first);
  }
  void return_slot(uint32_t s) { free_.give(s); }
  RemoteSlot& slot(uint32_t s) { return chunks_[s / kChunk].load(std::memory_order_relaxed)[s % kChunk]; }
  size_t capacity() const { return capacity_; }
  size_t allocated() const { return allocated_; }  // slots [0, allocated) exist
  // The live slot of a handle, or null (worker thread: no concurrent writer).
  RemoteSlot* live(const RemoteMr& r) {
    if (r.slot >= allocated_ || (r.generation & 1) == 0) return nullptr;
    RemoteSlot& s = slot(r.slot);
    return s.generation.load(std::memory_order_relaxed) == r.generation ? &s : nullptr;
  }

  // Any thread: what a live handle names, read consistently (the generation is checked again
  // after the reads, so a slot reused meanwhile is reported as stale, not half-read).
  std::optional<RemoteView> view(const RemoteMr& r) const {
    if (r.slot >= capacity_ || (r.generation & 1) == 0) return std::nullopt;
    const RemoteSlot* chunk = chunks_[r.slot / kChunk].load(std::memory_order_acquire);
    if (!chunk) return std::nullopt;
    const RemoteSlot& s = chunk[r.slot % kChunk];
    if (s.generation.load(std::memory_order_acquire) != r.generation) return std::nullopt;
    RemoteView v{s.len.load(std::memory_order_relaxed), s.local.load(std::memory_order_relaxed)};
    std::atomic_thread_fence(std::memory_order_acquire);
    if (s.generation.load(std::memory_order_relaxed) != r.generation) return std::nullopt;
    return v;
  }

 private:
  const size_t capacity_;
  std::vector<std::atomic<RemoteSlot*>> chunks_;
  size_t allocated_ = 0;  // worker thread only
  util::FreeSlots free_{0};
};

}  // namespace fabric
