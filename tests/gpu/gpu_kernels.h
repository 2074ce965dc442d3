// Small kernels the GPU tests and the GPU benchmark launch, behind plain C++ declarations (the
// kernels build as CUDA C++17, the tests as C++20 with the public headers).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fabric::gpu_test {

// word = 1, 2, ..., n, with ~gap_ns between stores (system-scope stores: the host sees them).
cudaError_t launch_bump(uint64_t* word, uint64_t n, uint64_t gap_ns, cudaStream_t stream);

// n round trips: store i to word, spin until ack == i; out_ns[i-1] = the round trip, timed with
// the GPU's global timer. The CPU side (a UVM watcher callback) answers by writing ack.
cudaError_t launch_ping_pong(uint64_t* word, const volatile uint64_t* ack, uint32_t n,
                             uint64_t* out_ns, cudaStream_t stream);

// How the GPU side of a round trip stores its sequence number into the watched word (all
// system-scope; the spin on `ack` is volatile loads in every case):
//   kReleaseStore:   st.release.sys (a MEMBAR.SYS issued before the store, as launch_ping_pong)
//   kStoreThenFence: a volatile store, then __threadfence_system() (the minimal ping-pong)
//   kFenceThenStore: __threadfence_system(), then a volatile store
//   kStoreOnly:      a volatile store, no fence
enum class PingPongSignal : int { kReleaseStore = 0, kStoreThenFence = 1, kFenceThenStore = 2, kStoreOnly = 3 };
// launch_ping_pong with the store made as `signal` says; a round without an answer for 100 ms
// records UINT64_MAX and ends the kernel.
cudaError_t launch_ping_pong_signal(uint64_t* word, const volatile uint64_t* ack, uint32_t n,
                                    uint64_t* out_ns, PingPongSignal signal, cudaStream_t stream);

// Spins until *counter >= target, then sums `len` bytes of data (as uint64 words) into *sum.
cudaError_t launch_wait_then_sum(const volatile uint64_t* counter, uint64_t target,
                                 const uint8_t* data, uint64_t len, uint64_t* sum,
                                 cudaStream_t stream);
// A "model" for the KV tests, captured in a CUDA graph: a layer is launch_spin_ns (its compute),
// launch_fill_kv_pages for its K and V pages (byte b of prompt page i = kv_byte(*seed, layer,
// value, i, b), written to page pages[i] of base), then launch_signal_next (the KvSender trigger:
// word + 1, after the pages are visible). *seed and pages[] are read when the graph runs.
__host__ __device__ inline uint8_t kv_byte(uint64_t seed, uint32_t layer, uint32_t value, uint32_t page, uint64_t b) {
  return static_cast<uint8_t>((seed * 7 + layer * 13 + value * 29 + page * 17 + b) % 251 + 1);
}
cudaError_t launch_spin_ns(uint64_t ns, cudaStream_t stream);
cudaError_t launch_fill_kv_pages(uint8_t* base, uint64_t page_bytes, const uint32_t* pages, uint32_t n,
                                 const uint64_t* seed, uint32_t layer, bool value, cudaStream_t stream);
cudaError_t launch_signal_next(uint64_t* word, cudaStream_t stream);

// The same sum without waiting (queued behind a stream wait).
cudaError_t launch_sum(const uint8_t* data, uint64_t len, uint64_t* sum, cudaStream_t stream);

}  // namespace fabric::gpu_test
