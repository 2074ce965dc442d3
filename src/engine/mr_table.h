// Table of registered regions, one for all workers. Written by the worker that registers a region
// (registration runs there, it owns the domains; the engine's control mutex orders them), read
// lock-free by application threads to validate handles and bounds at submit time.
// A slot's generation is odd while the region is registered; handles carry the generation, so a
// stale handle never matches a later registration of the same slot.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "domain/domain.h"
#include "fabric/types.h"
#include "util/free_slots.h"

namespace fabric {

struct RegionSlot {
  std::atomic<uint32_t> generation{0};
  uint8_t* ptr = nullptr;
  uint64_t len = 0;
  Device device;
  bool on_nics = true;  // false: GPU memory the NICs cannot reach (cuda_ipc peers only)
  uint32_t worker = 0;  // the worker whose domains registered it (and that posts its writes)
  std::array<DomainRegion, kMaxDomains> per_nic{};  // NICs, then the local domain
  // Worker thread only: WRITEs posted from this region and not completed (dereg_mr waits for 0).
  mutable uint32_t writes_in_flight = 0;
};

class MrTable {
 public:
  explicit MrTable(size_t capacity) : slots_(capacity), free_(capacity) {}

  // A worker's thread, under the engine's control mutex.
  std::optional<uint32_t> take_free_slot() { return free_.take(); }
  void return_slot(uint32_t s) { free_.give(s); }
  RegionSlot& slot(uint32_t s) { return slots_[s]; }
  size_t capacity() const { return slots_.size(); }

  // Any thread: the live slot of a handle, or null.
  const RegionSlot* find(const MrHandle& h) const {
    if (h.slot >= slots_.size() || (h.generation & 1) == 0) return nullptr;
    const RegionSlot& s = slots_[h.slot];
    return s.generation.load(std::memory_order_acquire) == h.generation ? &s : nullptr;
  }

 private:
  std::vector<RegionSlot> slots_;
  util::FreeSlots free_;
};

}  // namespace fabric
