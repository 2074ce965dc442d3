// The gather-copy kernel. Each block copies whole descriptors (pages), blocks take them
// round-robin, and a block loads its next descriptor before it copies the current one, so the
// descriptor's trip from pinned host memory overlaps the copy. Inside a page every thread keeps
// four 16-byte loads in flight before it stores them (the old loop did one load, waited for it and
// stored: one HBM latency per 16 bytes per thread). Pages whose source and destination are not
// 16-byte aligned alike copy in the widest word they share (8, 4, 2 or 1 bytes), with byte heads
// and tails, so any length and offset is right.
#include <cuda_runtime.h>

#include <atomic>

#include "providers/cuda_ipc/gather_copy.h"

namespace fabric::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;  // loads in flight per thread: 4 x 16 B x 256 threads = 16 KiB per block

// [s, s + len) to [t, t + len) where s and t are congruent modulo sizeof(W): a byte head that
// aligns t (and so s) to W, the body in W words, four loads in flight per thread, a byte tail.
template <class W>
__device__ __forceinline__ void copy_span(const uint8_t* s, uint8_t* t, uint64_t len) {
  constexpr uint64_t w = sizeof(W);
  uint64_t head = (w - (reinterpret_cast<uintptr_t>(t) & (w - 1))) & (w - 1);
  if (head > len) head = len;
  if (threadIdx.x < head) t[threadIdx.x] = s[threadIdx.x];
  const uint64_t n = (len - head) / w;
  const W* sw = reinterpret_cast<const W*>(s + head);
  W* tw = reinterpret_cast<W*>(t + head);
  uint64_t k = threadIdx.x;
  for (; k + (kUnroll - 1) * kThreads < n; k += kUnroll * kThreads) {
    W v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; u++) v[u] = sw[k + u * kThreads];
#pragma unroll
    for (int u = 0; u < kUnroll; u++) tw[k + u * kThreads] = v[u];
  }
  for (; k < n; k += kThreads) tw[k] = sw[k];
  const uint64_t done = head + n * w;  // the tail is shorter than W (<= 15 bytes)
  if (threadIdx.x < len - done) t[done + threadIdx.x] = s[done + threadIdx.x];
}

__device__ __forceinline__ void copy_one(const CopyDesc& d) {
  auto* s = static_cast<const uint8_t*>(d.src);
  auto* t = static_cast<uint8_t*>(d.dst);
  const uintptr_t shared = reinterpret_cast<uintptr_t>(s) ^ reinterpret_cast<uintptr_t>(t);
  if ((shared & 15) == 0) {
    copy_span<uint4>(s, t, d.len);
  } else if ((shared & 7) == 0) {
    copy_span<uint2>(s, t, d.len);
  } else if ((shared & 3) == 0) {
    copy_span<uint32_t>(s, t, d.len);
  } else if ((shared & 1) == 0) {
    copy_span<uint16_t>(s, t, d.len);
  } else {
    copy_span<uint8_t>(s, t, d.len);
  }
}

__global__ void __launch_bounds__(kThreads) gather_copy(const CopyDesc* __restrict__ descs, uint32_t count) {
  uint32_t i = blockIdx.x;
  if (i >= count) return;
  CopyDesc d = descs[i];
  for (;;) {
    const uint32_t next = i + gridDim.x;
    CopyDesc nd{};
    if (next < count) nd = descs[next];  // in flight while this page is copied
    copy_one(d);
    if (next >= count) break;
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
