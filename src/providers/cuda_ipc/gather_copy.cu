// The gather-copy kernels (plain, and fed while they run). Each block copies whole descriptors
// (pages), blocks take them round-robin, and a block loads its next descriptor before it copies the current one, so the
// descriptor's trip from pinned host memory overlaps the copy. Inside a page every thread keeps
// four 16-byte loads in flight before it stores them (the old loop did one load, waited for it and
// stored: one HBM latency per 16 bytes per thread). Pages whose source and destination are not
// 16-byte aligned alike copy in the widest word they share (8, 4, 2 or 1 bytes), with byte heads
// and tails, so any length and offset is right.
#include <cuda_runtime.h>

#include <atomic>

#include "providers/cuda_ipc/gather_copy.h"
#include "providers/cuda_ipc/gather_copy_impl.h"

namespace fabric::cuda {
namespace {

constexpr int kThreads = 256;  // x 4 loads of 16 bytes in flight: 16 KiB per block

__global__ void __launch_bounds__(kThreads) gather_copy(const CopyDesc* __restrict__ descs, uint32_t count) {
  uint32_t i = blockIdx.x;
  if (i >= count) return;
  CopyDesc d = descs[i];
  for (;;) {
    const uint32_t next = i + gridDim.x;
    CopyDesc nd{};
    if (next < count) nd = descs[next];  // in flight while this page is copied
    gather::copy_one<uint4, uint2>(d.src, d.dst, d.len, threadIdx.x, kThreads);
    if (next >= count) break;
    i = next;
    d = nd;
  }
}

__device__ __forceinline__ uint32_t load_acquire_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// What a block of fed_gather_copy knows of its feed: descriptors [0, avail) are written.
struct FeedView {
  uint32_t avail = 0;
  bool closed = false;
};

// Waits (thread 0 polling the host word, the block then reading its answer) until descriptor i
// is written or the feed is closed; true when i is there. Block-uniform.
__device__ bool wait_for(const CopyFeed* feed, uint32_t i, FeedView& v) {
  __shared__ uint32_t word;
  while (i >= v.avail) {
    if (v.closed) return false;
    if (threadIdx.x == 0) {
      const uint64_t t0 = global_ns();
      uint32_t w = load_acquire_sys(&feed->published);
      while ((w & ~kFeedClosed) <= i && !(w & kFeedClosed)) {
        if (global_ns() - t0 > kFeedWaitNs) {  // never closed: give up rather than hang
          w |= kFeedClosed;
          break;
        }
        __nanosleep(128);
        w = load_acquire_sys(&feed->published);
      }
      word = w;
    }
    __syncthreads();
    const uint32_t w = word;
    __syncthreads();
    v.avail = w & ~kFeedClosed;
    v.closed = (w & kFeedClosed) != 0;
  }
  return true;
}

// gather_copy over a feed: block b copies descriptors b, b + grid, ... as they are published,
// loading the next one (when already published) before it copies the current.
__global__ void __launch_bounds__(kThreads) fed_gather_copy(const CopyDesc* __restrict__ descs, const CopyFeed* feed) {
  FeedView v;
  uint32_t i = blockIdx.x;
  if (!wait_for(feed, i, v)) return;
  CopyDesc d = descs[i];
  for (;;) {
    const uint32_t next = i + gridDim.x;
    const bool known = next < v.avail;
    CopyDesc nd{};
    if (known) nd = descs[next];  // in flight while this page is copied
    gather::copy_one<uint4, uint2>(d.src, d.dst, d.len, threadIdx.x, kThreads);
    if (!known) {
      if (!wait_for(feed, next, v)) return;
      nd = descs[next];
    }
    i = next;
    d = nd;
  }
}

// Resident blocks per SM for this kernel (registers decide it), asked once.
int blocks_per_sm() {
  static std::atomic<int> cached{0};
  int n = cached.load(std::memory_order_relaxed);
  if (n > 0) return n;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, gather_copy, kThreads, 0) != cudaSuccess || n <= 0) {
    cudaGetLastError();
    n = 4;
  }
  cached.store(n, std::memory_order_relaxed);
  return n;
}

}  // namespace

cudaError_t launch_fed_gather_copy(const CopyDesc* descs, const CopyFeed* feed, uint32_t max_count, int sm_count,
                                   cudaStream_t stream) {
  if (max_count == 0) return cudaSuccess;
  const uint64_t full = static_cast<uint64_t>(sm_count > 0 ? sm_count : 1) * blocks_per_sm();
  const auto blocks = static_cast<uint32_t>(max_count < full ? max_count : full);
  fed_gather_copy<<<blocks, kThreads, 0, stream>>>(descs, feed);
  return cudaGetLastError();
}

cudaError_t launch_gather_copy(const CopyDesc* descs, uint32_t count, int sm_count,
                               cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  // Every SM full: 1,024 or more threads per SM, each with 64 bytes of loads in flight, is several
  // times the bytes in flight that HBM bandwidth times latency asks for.
  uint64_t full = static_cast<uint64_t>(sm_count > 0 ? sm_count : 1) * blocks_per_sm();
  auto blocks = static_cast<uint32_t>(count < full ? count : full);
  gather_copy<<<blocks, kThreads, 0, stream>>>(descs, count);
  return cudaGetLastError();
}

}  // namespace fabric::cuda
