// FIFO queue in a growable circular buffer: unlike std::deque, which allocates and frees a block
// as its front and back move through memory, it keeps its storage, so a queue that cycles
// forever at a steady size allocates nothing. Single thread.
#pragma once

#include <cstddef>
#include <utility>
#include <vector>

namespace fabric::util {

template <class T>
class Ring {
 public:
  bool empty() const { return size_ == 0; }
  size_t size() const { return size_; }
  T& front() { return slots_[head_]; }
  void push_back(T value) {
    if (size_ == slots_.size()) grow();
    slots_[(head_ + size_) & (slots_.size() - 1)] = std::move(value);
    size_++;
  }
  void pop_front() {
    slots_[head_] = T{};
    head_ = (head_ + 1) & (slots_.size() - 1);
    size_--;
  }

 private:
  void grow() {  // to the next power of two, the elements in order from index 0
    std::vector<T> bigger(slots_.empty() ? 16 : slots_.size() * 2);
    for (size_t i = 0; i < size_; i++) bigger[i] = std::move(slots_[(head_ + i) & (slots_.size() - 1)]);
    slots_ = std::move(bigger);
    head_ = 0;
  }
  std::vector<T> slots_;
  size_t head_ = 0;
  size_t size_ = 0;
};

}  // namespace fabric::util
