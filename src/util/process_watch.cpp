// A thread that learns of watched processes' exits through their pidfds (see process_watch.h).
#include "util/process_watch.h"

#include <fmt/format.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "fabric/error.h"

namespace fabric::util {

ProcessWatch::ProcessWatch()
    : state_(new std::atomic<uint64_t>[kSlots]),
      fds_(new int[kSlots]),
      generation_(new uint32_t[kSlots]),
      on_exit_(new std::function<void()>[kSlots]) {
  for (uint32_t i = 0; i < kSlots; i++) {
    state_[i].store(0, std::memory_order_relaxed);
    fds_[i] = -1;
    generation_[i] = 0;
  }
  epoll_ = epoll_create1(EPOLL_CLOEXEC);
  wake_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = UINT64_MAX;
  if (epoll_ < 0 || wake_ < 0 || epoll_ctl(epoll_, EPOLL_CTL_ADD, wake_, &ev) != 0) {
    const int err = errno;
    if (epoll_ >= 0) close(epoll_);
    if (wake_ >= 0) close(wake_);
    throw Error(ErrorCode::kProvider,
                fmt::format("process watch: epoll/eventfd failed: {}", std::strerror(err)));
  }
  thread_ = std::thread([this] { run(); });
}

ProcessWatch::~ProcessWatch() {
  uint64_t one = 1;
  if (write(wake_, &one, sizeof one) != sizeof one) {
  }  // the thread also ends on any error of epoll_wait
  thread_.join();
  for (uint32_t i = 0; i < kSlots; i++)
    if (fds_[i] >= 0) close(fds_[i]);
  close(wake_);
  close(epoll_);
}

bool ProcessWatch::watch(uint32_t slot, int pid, std::function<void()> on_exit) {
  unwatch(slot);
  const uint32_t gen = ++generation_[slot];
  {
    std::lock_guard l(on_exit_mu_);
    on_exit_[slot] = std::move(on_exit);
  }
  state_[slot].store(uint64_t{gen} << 1, std::memory_order_relaxed);
  if (pid <= 0) return false;
  const int fd = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
  if (fd < 0) {
    if (errno == ESRCH) state_[slot].store((uint64_t{gen} << 1) | 1, std::memory_order_relaxed);
    return false;  // gone; or no pidfd here (old kernel, seccomp): not watched
  }
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = (uint64_t{gen} << 32) | slot;
  if (epoll_ctl(epoll_, EPOLL_CTL_ADD, fd, &ev) != 0) {
    close(fd);
    return false;
  }
  fds_[slot] = fd;
  return true;
}

void ProcessWatch::unwatch(uint32_t slot) {
  state_[slot].store(uint64_t{++generation_[slot]} << 1, std::memory_order_relaxed);  // late events: ignored
  {
    std::lock_guard l(on_exit_mu_);
    on_exit_[slot] = nullptr;
  }
  if (fds_[slot] < 0) return;
  epoll_ctl(epoll_, EPOLL_CTL_DEL, fds_[slot], nullptr);
  close(fds_[slot]);
  fds_[slot] = -1;
}

void ProcessWatch::run() {
  epoll_event events[16];
  for (;;) {
    const int n = epoll_wait(epoll_, events, 16, -1);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return;
    for (int i = 0; i < n; i++) {
      const uint64_t data = events[i].data.u64;
      if (data == UINT64_MAX) return;
      const auto slot = static_cast<uint32_t>(data);
      const auto gen = static_cast<uint32_t>(data >> 32);
      uint64_t expected = uint64_t{gen} << 1;
      if (slot >= kSlots ||
          !state_[slot].compare_exchange_strong(expected, expected | 1, std::memory_order_relaxed))
        continue;
      std::function<void()> fn;
      {
        std::lock_guard l(on_exit_mu_);
        fn = on_exit_[slot];
      }
      if (fn) fn();
    }
  }
}

}  // namespace fabric::util
