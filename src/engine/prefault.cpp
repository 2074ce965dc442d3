// prefault_host: MADV_POPULATE_WRITE over pieces of the ranges, shared by a few threads.
#include "engine/prefault.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include <fmt/format.h>

namespace fabric {

namespace {

// Large enough that a thread's start-up is noise against its piece, small enough to spread a
// single large region over every thread.
constexpr size_t kPiece = size_t{256} << 20;
constexpr size_t kMaxThreads = 8;

struct Piece {
  uintptr_t start = 0, end = 0;  // page-aligned start
  size_t range = 0;              // index into the ranges
};

}  // namespace

std::optional<std::pair<size_t, Error>> prefault_host(std::span<const HostRange> ranges, const char* what) {
  const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  std::vector<Piece> pieces;
  for (size_t r = 0; r < ranges.size(); r++) {
    // Whole pages: madvise wants a page-aligned start, and a page partly in the range is faulted
    // in all the same by the first WRITE into it.
    const uintptr_t start = reinterpret_cast<uintptr_t>(ranges[r].ptr) & ~(page - 1);
    const uintptr_t end = reinterpret_cast<uintptr_t>(ranges[r].ptr) + ranges[r].len;
    for (uintptr_t p = start; p < end; p += kPiece) pieces.push_back({p, std::min(end, p + kPiece), r});
  }
  std::atomic<size_t> next{0};
  std::atomic<bool> stop{false};
  std::mutex mu;
  std::optional<std::pair<size_t, int>> failed;  // the range and errno of the first failure
  auto work = [&] {
    for (size_t i; !stop.load(std::memory_order_relaxed) && (i = next.fetch_add(1)) < pieces.size();) {
      const Piece& p = pieces[i];
      if (madvise(reinterpret_cast<void*>(p.start), p.end - p.start, MADV_POPULATE_WRITE) == 0) continue;
      const int err = errno;
      std::lock_guard l(mu);
      if (!failed || p.range < failed->first) failed.emplace(p.range, err);
      stop.store(true, std::memory_order_relaxed);
    }
  };
  const size_t cores = std::max<size_t>(1, std::thread::hardware_concurrency());
  std::vector<std::thread> helpers;
  for (size_t t = 1; t < std::min({cores, kMaxThreads, pieces.size()}); t++) helpers.emplace_back(work);
  work();
  for (auto& t : helpers) t.join();
  if (!failed) return std::nullopt;
  const auto [r, err] = *failed;
  // EINVAL: memory the kernel will not populate writable (read-only, a device mapping), or a
  // kernel before 5.14 without MADV_POPULATE_WRITE; EFAULT / ENOMEM: a page that cannot be had.
  return std::make_pair(
      ranges[r].entry,
      Error(ErrorCode::kInvalidArgument,
            fmt::format("{}: prefault of [{}, +{}) failed: madvise(MADV_POPULATE_WRITE): {} (memory that is "
                        "not writable, out of memory, or a kernel before 5.14: register it without prefault)",
                        what, ranges[r].ptr, ranges[r].len, std::strerror(err))));
}

}  // namespace fabric
