// Pool of reusable objects shared by threads: application threads take one per request, the
// worker gives it back when the request ends. Objects are never freed while the pool lives, so
// what they hold (vector capacity) is reused: after warm-up, taking and giving allocate nothing.
// A mutex, not a lock-free list: each side holds it for a push or a pop.
#pragma once

#include <memory>
#include <mutex>
#include <vector>

namespace fabric::util {

template <class T>
class SharedPool {
 public:
  SharedPool() = default;
  SharedPool(const SharedPool&) = delete;
  SharedPool& operator=(const SharedPool&) = delete;

  T* take() {
    std::lock_guard lock(mu_);
    if (free_.empty()) {
      all_.push_back(std::make_unique<T>());
      free_.reserve(all_.capacity());  // giving back never allocates
      return all_.back().get();
    }
    T* p = free_.back();
    free_.pop_back();
    return p;
  }
  // A new object, even when free ones exist (to add warmed objects to the pool).
  T* fresh() {
    std::lock_guard lock(mu_);
    all_.push_back(std::make_unique<T>());
    free_.reserve(all_.capacity());
    return all_.back().get();
  }
  void give(T* p) {
    if (!p) return;
    std::lock_guard lock(mu_);
    free_.push_back(p);
  }

 private:
  std::mutex mu_;
  std::vector<std::unique_ptr<T>> all_;
  std::vector<T*> free_;
};

}  // namespace fabric::util
