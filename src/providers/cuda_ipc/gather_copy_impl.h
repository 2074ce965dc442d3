// The per-thread body of the gather-copy kernel (gather_copy.cu), written for any thread index
// and block size so that the CPU unit tests can run it thread by thread (tests/unit/
// gather_copy_test.cpp): every length and every source and destination alignment must copy
// exactly its bytes. The threads of a block write disjoint bytes, so running them one after
// another on the CPU gives the result the block gives.
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#define FABRIC_HD __host__ __device__ __forceinline__
#else
#define FABRIC_HD inline
#endif
#ifdef __CUDA_ARCH__  // the device pass only: host compilers warn about the pragma
#define FABRIC_UNROLL _Pragma("unroll")
#else
#define FABRIC_UNROLL
#endif

namespace fabric::cuda::gather {

inline constexpr int kUnroll = 4;  // loads in flight per thread before it stores them

// [s, s + len) to [t, t + len) where s and t are congruent modulo sizeof(W): a byte head that
// aligns t (and so s) to W, the body in W words with kUnroll loads in flight per thread, a byte
// tail (shorter than W). Thread `tid` of `threads` (threads > sizeof(W)).
template <class W>
FABRIC_HD void copy_span(const uint8_t* s, uint8_t* t, uint64_t len, uint32_t tid, uint32_t threads) {
  constexpr uint64_t w = sizeof(W);
  uint64_t head = (w - (reinterpret_cast<uintptr_t>(t) & (w - 1))) & (w - 1);
  if (head > len) head = len;
  if (tid < head) t[tid] = s[tid];
  const uint64_t n = (len - head) / w;
  const W* sw = reinterpret_cast<const W*>(s + head);
  W* tw = reinterpret_cast<W*>(t + head);
  uint64_t k = tid;
  for (; k + (kUnroll - 1) * uint64_t{threads} < n; k += kUnroll * uint64_t{threads}) {
    W v[kUnroll];
FABRIC_UNROLL
    for (int u = 0; u < kUnroll; u++) v[u] = sw[k + u * threads];
FABRIC_UNROLL
    for (int u = 0; u < kUnroll; u++) tw[k + u * threads] = v[u];
  }
  for (; k < n; k += threads) tw[k] = sw[k];
  const uint64_t done = head + n * w;
  if (tid < len - done) t[done + tid] = s[done + tid];
}

// One copy in the widest word its source and destination share: W16 (16 bytes), 8, 4, 2 or 1.
template <class W16, class W8>
FABRIC_HD void copy_one(const void* src, void* dst, uint64_t len, uint32_t tid, uint32_t threads) {
  auto* s = static_cast<const uint8_t*>(src);
  auto* t = static_cast<uint8_t*>(dst);
  const uintptr_t shared = reinterpret_cast<uintptr_t>(s) ^ reinterpret_cast<uintptr_t>(t);
  if ((shared & 15) == 0) {
    copy_span<W16>(s, t, len, tid, threads);
  } else if ((shared & 7) == 0) {
    copy_span<W8>(s, t, len, tid, threads);
  } else if ((shared & 3) == 0) {
    copy_span<uint32_t>(s, t, len, tid, threads);
  } else if ((shared & 1) == 0) {
    copy_span<uint16_t>(s, t, len, tid, threads);
  } else {
    copy_span<uint8_t>(s, t, len, tid, threads);
  }
}

}  // namespace fabric::cuda::gather

#undef FABRIC_HD
#undef FABRIC_UNROLL
