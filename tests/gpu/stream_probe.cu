// Does GPU work that a process issues on its own non-blocking streams run while a kernel of the
// same process spins on another stream? The MoE node boundary in device memory needs it (the
// engine's cuda_ipc copies and the proxy's routing read run while the rank's receive kernel
// waits for them). One probe: a spinning kernel (--blocks x 512 threads) on the compute stream
// (the legacy default stream, as torch's, or a stream of its own), then on each of --streams
// non-blocking streams (--high-priority: of the highest priority) a small kernel, a device-to-host copy into pinned memory and a
// device-to-device copy, each waited for up to 500 ms. --queued N: N more kernels queued behind
// the spinning one on the compute stream, as the MoE receive kernel has the rest of its step (or
// twenty CUDA-graph replays) behind it: a stream that shares a hardware queue with them waits
// behind the first (which cannot start), not only behind the spinning kernel. Prints one
// `probe ...` line per process.
// Build: nvcc -O2 -arch=sm_90 -o stream_probe tests/gpu/stream_probe.cu
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

#include <unistd.h>

namespace {

__device__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Spins until *go is set or 3 s pass; *gave_up counts the blocks that timed out.
__global__ void spin(volatile int* go, int* gave_up) {
  const unsigned long long end = global_ns() + 3000000000ull;
  while (*go == 0) {
    if (global_ns() > end) {
      if (threadIdx.x == 0) atomicAdd(gave_up, 1);
      return;
    }
  }
}

__global__ void small_copy(const int4* src, int4* dst, size_t n) {
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) dst[i] = src[i];
}

#define CHECK(x)                                                                        \
  do {                                                                                  \
    cudaError_t rc_ = (x);                                                              \
    if (rc_ != cudaSuccess) {                                                           \
      std::fprintf(stderr, "%s failed: %s\n", #x, cudaGetErrorString(rc_));             \
      std::exit(1);                                                                     \
    }                                                                                   \
  } while (0)

// Microseconds until `e` completes, or -1 after 500 ms.
double wait_us(cudaEvent_t e) {
  const auto t0 = std::chrono::steady_clock::now();
  for (;;) {
    cudaError_t rc = cudaEventQuery(e);
    const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    if (rc == cudaSuccess) return us;
    if (rc != cudaErrorNotReady) CHECK(rc);
    if (us > 500000) return -1;
  }
}

}  // namespace

int main(int argc, char** argv) {
  int blocks = 16, streams = 4, queued = 0;
  bool own_compute = false, high_priority = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--blocks") && i + 1 < argc) blocks = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--streams") && i + 1 < argc) streams = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--queued") && i + 1 < argc) queued = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--own-compute-stream")) own_compute = true;
    else if (!std::strcmp(argv[i], "--high-priority")) high_priority = true;
  }
  CHECK(cudaSetDevice(0));
  int* go_host;
  CHECK(cudaHostAlloc(&go_host, 64, cudaHostAllocMapped));
  std::memset(go_host, 0, 64);
  int* go_dev;
  CHECK(cudaHostGetDevicePointer(&go_dev, go_host, 0));
  int* gave_up;
  CHECK(cudaMalloc(&gave_up, 4));
  CHECK(cudaMemset(gave_up, 0, 4));
  const size_t bytes = 8 << 20;
  int4 *a, *b;
  void* pinned;
  CHECK(cudaMalloc(&a, bytes));
  CHECK(cudaMalloc(&b, bytes));
  CHECK(cudaMallocHost(&pinned, 64 << 10));
  // Load both kernels now (lazy loading would wait for the spinning kernel).
  small_copy<<<1, 32>>>(a, b, 1);
  go_host[0] = 1;
  spin<<<1, 32>>>(go_dev, gave_up);
  CHECK(cudaDeviceSynchronize());
  go_host[0] = 0;
  cudaStream_t compute = nullptr;  // the legacy default stream, as torch's current stream
  if (own_compute) CHECK(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking));
  std::string line = "probe pid=" + std::to_string(getpid()) + " conns=" +
                     (std::getenv("CUDA_DEVICE_MAX_CONNECTIONS") ? std::getenv("CUDA_DEVICE_MAX_CONNECTIONS") : "default") +
                     " compute=" + (own_compute ? "own" : "legacy") + " blocks=" + std::to_string(blocks) +
                     (high_priority ? " streams=high-priority" : "");
  if (queued > 0) line += " queued=" + std::to_string(queued);
  streams = std::min(streams, 16);
  cudaStream_t st[16];
  cudaEvent_t ev[16][3];
  for (int s = 0; s < streams; ++s) {
    int least = 0, greatest = 0;
    CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    CHECK(cudaStreamCreateWithPriority(&st[s], cudaStreamNonBlocking, high_priority ? greatest : least));
    for (auto& e : ev[s]) CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  }
  spin<<<blocks, 512, 0, compute>>>(go_dev, gave_up);
  CHECK(cudaGetLastError());
  for (int i = 0; i < queued; ++i) small_copy<<<1, 32, 0, compute>>>(a, b, 1);
  std::this_thread::sleep_for(std::chrono::milliseconds(5));  // the spin kernel is resident
  int blocked = 0;
  for (int s = 0; s < streams; ++s) {
    small_copy<<<8, 256, 0, st[s]>>>(a, b, (1 << 20) / 16);
    CHECK(cudaEventRecord(ev[s][0], st[s]));
    const double k = wait_us(ev[s][0]);
    CHECK(cudaMemcpyAsync(pinned, a, 64 << 10, cudaMemcpyDeviceToHost, st[s]));
    CHECK(cudaEventRecord(ev[s][1], st[s]));
    const double h = wait_us(ev[s][1]);
    CHECK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, st[s]));
    CHECK(cudaEventRecord(ev[s][2], st[s]));
    const double d = wait_us(ev[s][2]);
    blocked += (k < 0) + (h < 0) + (d < 0);
    char buf[160];
    std::snprintf(buf, sizeof buf, " s%d=%.0f/%.0f/%.0f", s, k, h, d);
    line += buf;
  }
  go_host[0] = 1;
  CHECK(cudaDeviceSynchronize());
  int timed_out = 0;
  CHECK(cudaMemcpy(&timed_out, gave_up, 4, cudaMemcpyDeviceToHost));
  std::printf("%s blocked=%d spin_gave_up=%d (us for kernel/d2h/d2d per stream, -1: not done in 500 ms)\n",
              line.c_str(), blocked, timed_out);
  return 0;
}
