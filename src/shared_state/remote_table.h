// Table of interned remote regions (TransferEngine::add_remote), one for all workers. Slots are
// taken and published by the engine under its control mutex; each worker writes only its own
// route in a slot (resolving the owner's addresses, which only that worker may do); application
// threads read it lock-free to validate handles and bounds at submit time. As in MrTable, a slot's
// generation is odd while it is live and handles carry it, so a stale handle never matches a
// reused slot.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <optional>
#include <vector>

#include "fabric/types.h"
#include "shared_state/resolved_target.h"
#include "util/free_slots.h"

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
  ResolvedTarget* targets = nullptr;  // one per worker, owned by the table
};

// What a submitting thread may read of a live slot.
struct RemoteView {
  uint64_t len = 0;
  bool local = false;
  uint8_t imm_bits = 32;
};

// Slots come in chunks, allocated by the worker as interning needs them (a full table of
// 65,536 slots would cost every engine about 20 MB up front); a chunk never moves or goes before
// the table does, so readers index it without a lock.
class RemoteTable {
 public:
  static constexpr size_t kChunk = 256;
  RemoteTable(size_t capacity, size_t workers)
      : capacity_(capacity), workers_(workers), chunks_((capacity + kChunk - 1) / kChunk),
        routes_(chunks_.size()) {}
  ~RemoteTable() {
    for (auto& c : chunks_) delete[] c.load(std::memory_order_relaxed);
    for (auto* r : routes_) delete[] r;
  }
  RemoteTable(const RemoteTable&) = delete;
  RemoteTable& operator=(const RemoteTable&) = delete;

  // Under the engine's control mutex.
  std::optional<uint32_t> take_free_slot() {
    if (auto s = free_.take()) return s;
    const size_t first = allocated_.load(std::memory_order_relaxed);
    if (first >= capacity_) return std::nullopt;
    auto* chunk = new RemoteSlot[kChunk];
    auto* routes = new ResolvedTarget[kChunk * workers_];
    for (size_t i = 0; i < kChunk; i++) chunk[i].targets = routes + i * workers_;
    routes_[first / kChunk] = routes;
    chunks_[first / kChunk].store(chunk, std::memory_order_release);
    const size_t end = std::min(capacity_, first + kChunk);
    allocated_.store(end, std::memory_order_release);
    for (size_t i = end; i-- > first + 1;) free_.give(static_cast<uint32_t>(i));
    return static_cast<uint32_t>(first);
  }
  void return_slot(uint32_t s) { free_.give(s); }
  RemoteSlot& slot(uint32_t s) { return chunks_[s / kChunk].load(std::memory_order_relaxed)[s % kChunk]; }
  size_t capacity() const { return capacity_; }
  // Slots [0, allocated) exist (any thread).
  size_t allocated() const { return allocated_.load(std::memory_order_acquire); }
  // The live slot of a handle, or null (a worker's thread).
  RemoteSlot* live(const RemoteMr& r) {
    if (r.slot >= allocated() || (r.generation & 1) == 0) return nullptr;
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
    RemoteView v{s.len.load(std::memory_order_relaxed), s.local.load(std::memory_order_relaxed),
                 s.imm_bits.load(std::memory_order_relaxed)};
    std::atomic_thread_fence(std::memory_order_acquire);
    if (s.generation.load(std::memory_order_relaxed) != r.generation) return std::nullopt;
    return v;
  }

 private:
  const size_t capacity_;
  const size_t workers_;
  std::vector<std::atomic<RemoteSlot*>> chunks_;
  std::vector<ResolvedTarget*> routes_;  // per chunk: kChunk x workers_ routes
  std::atomic<size_t> allocated_{0};     // written under the engine's control mutex
  util::FreeSlots free_{0};
};

}  // namespace fabric
