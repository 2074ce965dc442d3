// Knows, without a system call on the caller's path, which watched processes have exited: a
// thread blocks on their pidfds (readable once a process has exited, zombies included) and sets a
// flag per slot. For posting paths that must not touch a dead peer's shared memory (shm's lock).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

namespace fabric::util {

class ProcessWatch {
 public:
  static constexpr uint32_t kSlots = 1024;

  ProcessWatch();  // throws fabric::Error (kProvider) if epoll or the thread cannot start
  ~ProcessWatch();
  ProcessWatch(const ProcessWatch&) = delete;
  ProcessWatch& operator=(const ProcessWatch&) = delete;

  // Watch `pid` in `slot` (< kSlots; one thread at a time calls watch/unwatch). False: the
  // process is already gone, or cannot be watched (no pidfd: then exited() stays false).
  // `on_exit` runs on the watch's thread once the flag is set (it may block that thread briefly).
  bool watch(uint32_t slot, int pid, std::function<void()> on_exit = {});
  void unwatch(uint32_t slot);
  // Any thread; a relaxed load.
  bool exited(uint32_t slot) const { return state_[slot].load(std::memory_order_relaxed) & 1; }

 private:
  void run();

  int epoll_ = -1;
  int wake_ = -1;  // eventfd: ends the thread
  // Per slot: (generation << 1) | exited. The thread sets the bit only for the generation its
  // event names, so an event of a slot's earlier process never marks the next one.
  std::unique_ptr<std::atomic<uint64_t>[]> state_;
  std::unique_ptr<int[]> fds_;             // pidfd per slot, -1: none
  std::unique_ptr<uint32_t[]> generation_;  // the watching thread's counter per slot
  std::mutex on_exit_mu_;
  std::unique_ptr<std::function<void()>[]> on_exit_;
  std::thread thread_;
};

}  // namespace fabric::util
