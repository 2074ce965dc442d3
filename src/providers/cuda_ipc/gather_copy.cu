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

cudaError_t load_gather_copy() {
  cudaFuncAttributes attrs{};
  return cudaFuncGetAttributes(&attrs, gather_copy);
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
