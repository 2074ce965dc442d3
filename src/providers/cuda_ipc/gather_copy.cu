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

__device__ __forceinline__ uint64_t load_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint64_t load_acquire_gpu(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void store_release_gpu(uint64_t* p, uint64_t v) {
  asm volatile("st.release.gpu.global.u64 [%0], %1;" : : "l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ bool is_closed(uint64_t w) { return (w & kFeedClosed) != 0; }
__device__ __forceinline__ uint32_t written(uint64_t w) { return static_cast<uint32_t>(w & (kFeedClosed - 1)); }
// Whether w (this batch's, or zero, or an earlier batch's) says descriptor i is there or no more come.
__device__ __forceinline__ bool answers(uint64_t w, uint32_t seq, uint32_t i) {
  return (w >> 32) == seq && (written(w) > i || is_closed(w));
}

// What a copying block knows of its feed: descriptors [0, avail) are written.
struct FeedView {
  uint32_t avail = 0;
  bool closed = false;
};

// Waits until descriptor i is written or the feed is closed; true when i is there. Thread 0
// reads the mirror; when it does not answer, it reads the host word itself if no other block
// is doing so (the mirror's lock) and publishes what it read in the mirror. Block-uniform.
__device__ bool wait_for(CopyFeed* feed, FeedMirror* mirror, uint32_t seq, uint32_t i, FeedView& v) {
  __shared__ uint64_t word;
  while (i >= v.avail) {
    if (v.closed) return false;
    if (threadIdx.x == 0) {
      const uint64_t t0 = global_ns();
      uint64_t w = load_acquire_gpu(&mirror->word);
      while (!answers(w, seq, i)) {
        if (atomicCAS(&mirror->busy, 0u, 1u) == 0u) {
          const uint64_t h = load_acquire_sys(&feed->published);
          if ((h >> 32) == seq) {
            const uint64_t m = load_acquire_gpu(&mirror->word);
            if ((m >> 32) != seq || written(h) > written(m) || is_closed(h)) store_release_gpu(&mirror->word, h);
            w = h;
          }
          atomicExch(&mirror->busy, 0u);
          if (answers(w, seq, i)) break;
        }
        if (global_ns() - t0 > kFeedWaitNs) {  // the host never closed: stop, and say so
          *reinterpret_cast<volatile uint32_t*>(&feed->gave_up) = seq;  // a plain store: no PCIe atomics needed
          __threadfence_system();
          w = uint64_t{seq} << 32 | kFeedClosed;
          break;
        }
        __nanosleep(64);
        w = load_acquire_gpu(&mirror->word);
      }
      word = w;
    }
    __syncthreads();
    const uint64_t w = word;
    __syncthreads();
    v.avail = written(w);
    v.closed = is_closed(w);
  }
  return true;
}

// gather_copy over a feed: block b takes descriptors b, b + grid, ... as they are published,
// loading the next one (when already published) before it copies the current.
__global__ void __launch_bounds__(kThreads)
    fed_gather_copy(const CopyDesc* __restrict__ descs, CopyFeed* feed, FeedMirror* mirror, uint32_t seq) {
  FeedView v;
  uint32_t i = blockIdx.x;
  if (!wait_for(feed, mirror, seq, i, v)) return;
  CopyDesc d = descs[i];
  for (;;) {
    const uint32_t next = i + gridDim.x;
    const bool known = next < v.avail;
    CopyDesc nd{};
    if (known) nd = descs[next];  // in flight while this page is copied
    gather::copy_one<uint4, uint2>(d.src, d.dst, d.len, threadIdx.x, kThreads);
    if (!known) {
      if (!wait_for(feed, mirror, seq, next, v)) return;
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

cudaError_t launch_fed_gather_copy(const CopyDesc* descs, CopyFeed* feed, FeedMirror* mirror, uint32_t seq,
                                   uint32_t max_count, int sm_count, cudaStream_t stream) {
  if (max_count == 0) return cudaSuccess;
  const uint64_t full = static_cast<uint64_t>(sm_count > 0 ? sm_count : 1) * blocks_per_sm();
  const auto blocks = static_cast<uint32_t>(max_count < full ? max_count : full);
  fed_gather_copy<<<blocks, kThreads, 0, stream>>>(descs, feed, mirror, seq);
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
