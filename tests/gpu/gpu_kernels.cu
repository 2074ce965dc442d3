// Kernels for the GPU tests and benchmark (see gpu_kernels.h).
#include "gpu_kernels.h"

namespace fabric::gpu_test {
namespace {

__device__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ void store_system(uint64_t* word, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(word), "l"(v) : "memory");
}

__global__ void bump(uint64_t* word, uint64_t n, uint64_t gap_ns) {
  for (uint64_t i = 1; i <= n; i++) {
    store_system(word, i);
    uint64_t t0 = global_ns();
    while (global_ns() - t0 < gap_ns) {
    }
  }
}

__global__ void ping_pong(uint64_t* word, const volatile uint64_t* ack, uint32_t n, uint64_t* out) {
  for (uint32_t i = 1; i <= n; i++) {
    uint64_t t0 = global_ns();
    store_system(word, i);
    while (*ack != i) {
    }
    out[i - 1] = global_ns() - t0;
  }
}

// The same round trip with the store made one of four ways (gpu_kernels.h, PingPongSignal). A
// round that sees no answer for 100 ms records UINT64_MAX and ends the kernel (a variant that
// never reaches the host must not hang the benchmark).
__global__ void ping_pong_signal(uint64_t* word, const volatile uint64_t* ack, uint32_t n, uint64_t* out,
                                 int signal) {
  volatile uint64_t* w = word;
  for (uint32_t i = 1; i <= n; i++) {
    uint64_t t0 = global_ns();
    switch (signal) {
      case 0:  // st.release.sys: a fence before the store (what launch_ping_pong does)
        store_system(word, i);
        break;
      case 1:  // the store, then the fence
        *w = i;
        __threadfence_system();
        break;
      case 2:  // the fence, then the store
        __threadfence_system();
        *w = i;
        break;
      default:  // the store alone
        *w = i;
        break;
    }
    uint32_t spins = 0;
    while (*ack != i) {
      if ((++spins & 1023) == 0 && global_ns() - t0 > 100000000ull) {
        out[i - 1] = UINT64_MAX;
        return;
      }
    }
    out[i - 1] = global_ns() - t0;
  }
}

__device__ void sum_words(const uint8_t* data, uint64_t len, unsigned long long* sum) {
  const uint64_t* w = reinterpret_cast<const uint64_t*>(data);
  unsigned long long local = 0;
  for (uint64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < len / 8; i += gridDim.x * blockDim.x)
    local += w[i];
  atomicAdd(sum, local);
}

__global__ void wait_then_sum(const volatile uint64_t* counter, uint64_t target, const uint8_t* data,
                              uint64_t len, unsigned long long* sum) {
  // One thread per block spins; the rest wait at the barrier (no hammering of the PCIe link).
  if (threadIdx.x == 0)
    while (*counter < target) {
    }
  __syncthreads();
  __threadfence_system();
  sum_words(data, len, sum);
}

__global__ void sum(const uint8_t* data, uint64_t len, unsigned long long* out) { sum_words(data, len, out); }

__global__ void spin_ns(uint64_t ns) {
  uint64_t t0 = global_ns();
  while (global_ns() - t0 < ns) {
  }
}

__global__ void fill_kv_pages(uint8_t* base, uint64_t page_bytes, const uint32_t* pages, uint32_t n,
                              const uint64_t* seed, uint32_t layer, uint32_t value) {
  const uint64_t total = uint64_t{n} * page_bytes;
  const uint64_t s = *seed;
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < total; i += uint64_t{gridDim.x} * blockDim.x) {
    const uint64_t page = i / page_bytes, b = i % page_bytes;
    base[uint64_t{pages[page]} * page_bytes + b] = kv_byte(s, layer, value, static_cast<uint32_t>(page), b);
  }
}

// The only writer of the word, one thread in stream order: a plain increment, made visible to the
// host after every earlier kernel's writes (kernel boundary, then a system fence).
__global__ void signal_next(uint64_t* word) {
  __threadfence_system();
  store_system(word, *reinterpret_cast<volatile uint64_t*>(word) + 1);
}

}  // namespace

cudaError_t launch_bump(uint64_t* word, uint64_t n, uint64_t gap_ns, cudaStream_t stream) {
  bump<<<1, 1, 0, stream>>>(word, n, gap_ns);
  return cudaGetLastError();
}

cudaError_t launch_ping_pong(uint64_t* word, const volatile uint64_t* ack, uint32_t n,
                             uint64_t* out_ns, cudaStream_t stream) {
  ping_pong<<<1, 1, 0, stream>>>(word, ack, n, out_ns);
  return cudaGetLastError();
}

cudaError_t launch_ping_pong_signal(uint64_t* word, const volatile uint64_t* ack, uint32_t n,
                                    uint64_t* out_ns, PingPongSignal signal, cudaStream_t stream) {
  ping_pong_signal<<<1, 1, 0, stream>>>(word, ack, n, out_ns, static_cast<int>(signal));
  return cudaGetLastError();
}

cudaError_t launch_wait_then_sum(const volatile uint64_t* counter, uint64_t target,
                                 const uint8_t* data, uint64_t len, uint64_t* out,
                                 cudaStream_t stream) {
  wait_then_sum<<<64, 256, 0, stream>>>(counter, target, data, len,
                                        reinterpret_cast<unsigned long long*>(out));
  return cudaGetLastError();
}

cudaError_t launch_spin_ns(uint64_t ns, cudaStream_t stream) {
  spin_ns<<<1, 1, 0, stream>>>(ns);
  return cudaGetLastError();
}

cudaError_t launch_fill_kv_pages(uint8_t* base, uint64_t page_bytes, const uint32_t* pages, uint32_t n,
                                 const uint64_t* seed, uint32_t layer, bool value, cudaStream_t stream) {
  fill_kv_pages<<<132, 256, 0, stream>>>(base, page_bytes, pages, n, seed, layer, value);
  return cudaGetLastError();
}

cudaError_t launch_signal_next(uint64_t* word, cudaStream_t stream) {
  signal_next<<<1, 1, 0, stream>>>(word);
  return cudaGetLastError();
}

cudaError_t launch_sum(const uint8_t* data, uint64_t len, uint64_t* out, cudaStream_t stream) {
  sum<<<64, 256, 0, stream>>>(data, len, reinterpret_cast<unsigned long long*>(out));
  return cudaGetLastError();
}

}  // namespace fabric::gpu_test
