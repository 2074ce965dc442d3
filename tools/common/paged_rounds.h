// The workload shared by fabric-demo and the raw libfabric loop, so both move identical data: a
// byte pattern, and the page permutation of each round (rounds alternate between the two halves of
// the destination, so one round can be in flight while the next is posted).
#pragma once

#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <random>
#include <vector>

namespace fabric::tools {

inline uint8_t pattern(uint64_t byte_index) {
  return static_cast<uint8_t>(byte_index * 131 + (byte_index >> 13) + 7);
}

// Round r writes source page i to destination page result[i], in half (r % 2).
inline std::vector<uint32_t> round_permutation(uint32_t round, uint32_t pages) {
  std::vector<uint32_t> p(pages);
  for (uint32_t i = 0; i < pages; i++) p[i] = i;
  std::shuffle(p.begin(), p.end(), std::mt19937(1234 + round));
  for (auto& x : p) x += (round % 2) * pages;
  return p;
}

// Workload memory as the peers' drivers (bench/peers/) get it from numpy: numpy advises buffers
// of 4 MiB or more for transparent huge pages on Linux, and a kernel copy (CMA: libfabric shm,
// host_ipc, UCX's cma) into or out of 2 MiB pages costs about half as much as with 4 KiB pages on
// the 2-core VM. Every side of a comparison copies the same kind of pages.
class WorkloadBuffer {
 public:
  explicit WorkloadBuffer(size_t len, uint8_t fill = 0) : len_(len) {
    constexpr size_t kHuge = size_t{2} << 20;
    const size_t rounded = (len + kHuge - 1) / kHuge * kHuge;
    data_.reset(static_cast<uint8_t*>(std::aligned_alloc(kHuge, rounded == 0 ? kHuge : rounded)));
    if (!data_) throw std::bad_alloc();
    if (len >= (size_t{4} << 20)) (void)madvise(data_.get(), rounded, MADV_HUGEPAGE);
    std::memset(data_.get(), fill, len);
  }
  uint8_t* data() { return data_.get(); }
  const uint8_t* data() const { return data_.get(); }
  size_t size() const { return len_; }
  uint8_t& operator[](size_t i) { return data_.get()[i]; }
  const uint8_t& operator[](size_t i) const { return data_.get()[i]; }

 private:
  struct Free {
    void operator()(uint8_t* p) const { std::free(p); }
  };
  std::unique_ptr<uint8_t, Free> data_;
  size_t len_;
};

}  // namespace fabric::tools
