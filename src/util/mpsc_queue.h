// Bounded lock-free queue (Vyukov's array queue): many producers, one consumer. Used for
// application-to-worker requests and worker-to-callback-thread events.
#pragma once

#include <atomic>
#include <cstddef>
#include <memory>
#include <new>
#include <optional>
#include <stdexcept>

namespace fabric::util {

template <class T>
class MpscQueue {
 public:
  explicit MpscQueue(size_t capacity) : mask_(round_up_pow2(capacity) - 1) {
    cells_ = std::make_unique<Cell[]>(mask_ + 1);
    for (size_t i = 0; i <= mask_; i++) cells_[i].seq.store(i, std::memory_order_relaxed);
  }
  MpscQueue(const MpscQueue&) = delete;
  MpscQueue& operator=(const MpscQueue&) = delete;

  size_t capacity() const { return mask_ + 1; }

  // Returns false when full (value is left untouched).
  bool try_push(T& value) {
    size_t pos = tail_.load(std::memory_order_relaxed);
    for (;;) {
      Cell& c = cells_[pos & mask_];
      size_t seq = c.seq.load(std::memory_order_acquire);
      auto diff = static_cast<std::ptrdiff_t>(seq) - static_cast<std::ptrdiff_t>(pos);
      if (diff == 0) {
        if (tail_.compare_exchange_weak(pos, pos + 1, std::memory_order_relaxed)) {
          c.value.emplace(std::move(value));
          c.seq.store(pos + 1, std::memory_order_release);
          return true;
        }
      } else if (diff < 0) {
        return false;
      } else {
        pos = tail_.load(std::memory_order_relaxed);
      }
    }
  }

  // Single consumer only.
  std::optional<T> try_pop() {
    Cell& c = cells_[head_ & mask_];
    size_t seq = c.seq.load(std::memory_order_acquire);
    if (static_cast<std::ptrdiff_t>(seq) - static_cast<std::ptrdiff_t>(head_ + 1) < 0)
      return std::nullopt;
    std::optional<T> out(std::move(*c.value));
    c.value.reset();
    c.seq.store(head_ + mask_ + 1, std::memory_order_release);
    head_++;
    return out;
  }

 private:
  static size_t round_up_pow2(size_t n) {
    if (n < 2) n = 2;
    size_t p = 1;
    while (p < n) p <<= 1;
    return p;
  }
  struct alignas(64) Cell {
    std::atomic<size_t> seq;
    std::optional<T> value;
  };
  size_t mask_;
  std::unique_ptr<Cell[]> cells_;
  alignas(64) std::atomic<size_t> tail_{0};
  alignas(64) size_t head_ = 0;
};

}  // namespace fabric::util
