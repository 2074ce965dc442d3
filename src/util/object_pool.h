// Pool of objects with stable addresses (allocated in chunks, never moved), recycled through a
// free list. Owned by one thread; handed to NICs as completion contexts.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

namespace fabric::util {

template <class T>
class ObjectPool {
 public:
  explicit ObjectPool(size_t chunk = 256) : chunk_(chunk) {}
  ObjectPool(const ObjectPool&) = delete;
  ObjectPool& operator=(const ObjectPool&) = delete;

  T* acquire() {
    if (free_.empty()) grow();
    T* p = free_.back();
    free_.pop_back();
    in_use_++;
    return p;
  }
  // Resets the object (its reuse() where it has one, to keep what it holds allocated).
  void release(T* p) {
    if constexpr (requires { p->reuse(); }) {
      p->reuse();
    } else {
      *p = T{};
    }
    free_.push_back(p);
    in_use_--;
  }
  size_t in_use() const { return in_use_; }

 private:
  void grow() {
    chunks_.push_back(std::make_unique<T[]>(chunk_));
    T* c = chunks_.back().get();
    if constexpr (requires { c->prepare(); })  // what each object holds, allocated up front
      for (size_t i = 0; i < chunk_; i++) c[i].prepare();
    free_.reserve(free_.size() + chunk_);
    for (size_t i = chunk_; i-- > 0;) free_.push_back(&c[i]);
  }
  size_t chunk_;
  size_t in_use_ = 0;
  std::vector<std::unique_ptr<T[]>> chunks_;
  std::vector<T*> free_;
};

}  // namespace fabric::util
