// Table of registered regions, one for all workers. Written by the worker that registers a region
// (registration runs there, it owns the domains; the engine's control mutex orders them), read
// lock-free by application threads to validate handles and bounds at submit time.
// A slot's generation is odd while the region is registered; handles carry the generation, so a
// stale handle never matches a later registration of the same slot. What submitting threads read
// (SourceView) is read as a seqlock: the generation before and after, so a slot deregistered and
// registered again meanwhile is reported as stale, never half-read.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <optional>

#include "domain/domain.h"
#include "fabric/types.h"
#include "util/slot_map.h"

namespace fabric {

struct RegionSlot {
  std::atomic<uint32_t> generation{0};
  // Read by any thread (see SourceView); stored with release while the slot is not live, so a
  // reader that sees a new value also sees the generation that made its handle stale.
  std::atomic<uint64_t> len{0};
  std::atomic<bool> on_nics{true};  // false: GPU memory the NICs cannot reach (cuda_ipc peers only)
  std::atomic<uint32_t> worker{0};  // the worker whose domains registered it (and that posts its writes)
  // The registering worker's thread only.
  uint8_t* ptr = nullptr;
  Device device;
  std::array<DomainRegion, kMaxDomains> per_nic{};  // NICs, then the local domain
  // Worker thread only: WRITEs posted from this region and not completed (dereg_mr waits for 0).
  mutable uint32_t writes_in_flight = 0;
};

// What a submitting thread may read of a live slot.
struct SourceView {
  uint64_t len = 0;
  bool on_nics = true;
  uint32_t worker = 0;
};

// Slots live in a util::SlotMap: room for all of them at once, touched only as registration
// reaches them; a slot never moves, so readers index it without a lock.
class MrTable {
 public:
  explicit MrTable(size_t capacity) : slots_(capacity) {}

  // A worker's thread, under the engine's control mutex.
  std::optional<uint32_t> take_free_slot() { return slots_.take(); }
  void return_slot(uint32_t s) { slots_.give(s); }
  RegionSlot& slot(uint32_t s) { return slots_[s]; }
  size_t capacity() const { return slots_.capacity(); }
  // Slots [0, allocated) exist (any thread).
  size_t allocated() const { return slots_.size(); }

  // The registering worker's thread: the live slot of a handle, or null.
  const RegionSlot* find(const MrHandle& h) const {
    const RegionSlot* s = (h.generation & 1) ? slots_.find(h.slot) : nullptr;
    return s && s->generation.load(std::memory_order_acquire) == h.generation ? s : nullptr;
  }

  // Any thread: what a live handle names, or nullopt for an unknown or stale one.
  std::optional<SourceView> view(const MrHandle& h) const {
    const RegionSlot* s = find(h);
    if (!s) return std::nullopt;
    SourceView v{s->len.load(std::memory_order_relaxed), s->on_nics.load(std::memory_order_relaxed),
                 s->worker.load(std::memory_order_relaxed)};
    std::atomic_thread_fence(std::memory_order_acquire);
    if (s->generation.load(std::memory_order_relaxed) != h.generation) return std::nullopt;
    return v;
  }

 private:
  util::SlotMap<RegionSlot> slots_;
};

}  // namespace fabric
