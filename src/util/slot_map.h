// SlotMap: a table of T by uint32_t slot that takes a freed slot again (the most recently freed
// first) before it grows by one. The one free-or-grow table of the engine's region and remote
// tables and of a worker's peer records. Indexing it costs what indexing a vector does (the
// posting path reads peer records per WRITE).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <new>
#include <optional>
#include <type_traits>

#include "util/free_slots.h"

namespace fabric::util {

template <class T>
class SlotMap {
 public:
  // Unbounded: its slots move when it grows (as a vector's), so only its owner's thread reads it.
  SlotMap() requires std::is_move_constructible_v<T> : capacity_(kUnbounded) {}
  // At most `capacity` slots, with room for all of them allocated at once and never moved: a slot
  // keeps its address, T may be immovable (atomics), and other threads may read slots while the
  // table grows (find()). Pages that no slot reached are never touched: a large capacity costs
  // address space, not memory.
  explicit SlotMap(size_t capacity) : capacity_(capacity) { grow_to(capacity); }
  ~SlotMap() {
    for (size_t i = 0, n = size(); i < n; i++) std::destroy_at(&slots_[i]);
    if (slots_) std::allocator<T>().deallocate(slots_, room_);
  }
  SlotMap(const SlotMap&) = delete;
  SlotMap& operator=(const SlotMap&) = delete;

  // The writer (one thread at a time): a free slot, else a new default-constructed one at the
  // end; nullopt once `capacity` slots exist and none is free. A slot keeps its value while free
  // (a generation in it survives reuse): filling it is the caller's.
  std::optional<uint32_t> take() {
    if (auto s = free_.take()) return s;
    const size_t n = size_.load(std::memory_order_relaxed);
    if (n >= capacity_) return std::nullopt;
    if (n == room_) grow_to(room_ == 0 ? 16 : 2 * room_);  // unbounded only
    std::construct_at(&slots_[n]);
    size_.store(n + 1, std::memory_order_release);  // constructed first: readers check size()
    return static_cast<uint32_t>(n);
  }
  void give(uint32_t s) { free_.give(s); }

  // Slots [0, size()) exist. Any thread, when bounded.
  size_t size() const { return size_.load(std::memory_order_acquire); }
  size_t capacity() const { return capacity_; }
  // s < size(): the writer's thread, or a reader that saw size() cover s.
  T& operator[](uint32_t s) { return slots_[s]; }
  const T& operator[](uint32_t s) const { return slots_[s]; }
  // Any thread, when bounded: slot s, or null where it does not exist (yet).
  T* find(uint32_t s) { return s < size() ? &slots_[s] : nullptr; }
  const T* find(uint32_t s) const { return s < size() ? &slots_[s] : nullptr; }

 private:
  static constexpr size_t kUnbounded = std::numeric_limits<uint32_t>::max();

  // Room for `room` slots, the existing ones moved there (bounded: once, before the first).
  void grow_to(size_t room) {
    T* fresh = std::allocator<T>().allocate(room);
    if constexpr (std::is_move_constructible_v<T>) {
      const size_t n = size_.load(std::memory_order_relaxed);
      std::uninitialized_move(slots_, slots_ + n, fresh);
      std::destroy(slots_, slots_ + n);
    }
    if (slots_) std::allocator<T>().deallocate(slots_, room_);
    slots_ = fresh;
    room_ = room;
  }

  const size_t capacity_;
  T* slots_ = nullptr;
  size_t room_ = 0;
  std::atomic<size_t> size_{0};
  FreeSlots free_{0};
};

}  // namespace fabric::util
