// Helpers for the GPU tests and benchmark: how many GPUs there are (asked in a child process, so
// that this one can still fork CUDA-using children), CUDA checks, device buffers, test patterns.
#pragma once

#include <cuda_runtime_api.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "fabric/fabric.h"

namespace fabric::gpu_test {

inline void ck(cudaError_t rc, const char* what) {
  if (rc != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(rc));
}

// CUDA must not be initialised in a process that forks CUDA-using children: count in a child.
inline int gpu_count() {
  static int cached = -1;
  if (cached >= 0) return cached;
  pid_t pid = fork();
  if (pid == 0) {
    int n = 0;
    _exit(cudaGetDeviceCount(&n) == cudaSuccess ? n : 0);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  cached = WIFEXITED(status) ? WEXITSTATUS(status) : 0;
  return cached;
}

struct DeviceBuffer {
  uint8_t* ptr = nullptr;
  size_t len = 0;
  DeviceBuffer(size_t n, int device) : len(n) {
    ck(cudaSetDevice(device), "cudaSetDevice");
    void* p = nullptr;
    ck(cudaMalloc(&p, n), "cudaMalloc");
    ptr = static_cast<uint8_t*>(p);
  }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void upload(const std::vector<uint8_t>& host, size_t offset = 0) {
    ck(cudaMemcpy(ptr + offset, host.data(), host.size(), cudaMemcpyDefault), "cudaMemcpy (upload)");
  }
  std::vector<uint8_t> download(size_t offset, size_t n) const {
    std::vector<uint8_t> out(n);
    ck(cudaMemcpy(out.data(), ptr + offset, n, cudaMemcpyDefault), "cudaMemcpy (download)");
    return out;
  }
  void fill(uint8_t byte) { ck(cudaMemset(ptr, byte, len), "cudaMemset"); }
};

inline std::vector<uint8_t> pattern(size_t n, uint64_t seed) {
  std::vector<uint8_t> v(n);
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (size_t i = 0; i < n; i++) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    v[i] = static_cast<uint8_t>(x);
  }
  return v;
}

// An engine for GPU `device`: tcp on loopback for host memory and messages, cuda_ipc for
// same-host GPU peers (unless `cuda_ipc` is false).
inline EngineConfig gpu_engine_config(int device, bool cuda_ipc = true) {
  EngineConfig c;
  c.provider = "tcp;ofi_rxm";
  c.nics = {NicConfig{"", "127.0.0.1"}};
  c.cuda_device = device;
  c.cuda_ipc = cuda_ipc;
  c.transfer_timeout = std::chrono::seconds(30);
  // FABRIC_GPU_FROM_TOPOLOGY=1: the same engine as one worker of engine_config_for(the detected
  // topology): that GPU's NICs (none here: loopback tcp stays) and its two cores.
  if (const char* t = std::getenv("FABRIC_GPU_FROM_TOPOLOGY"); t && std::string(t) == "1") {
    const int gpus[] = {device};
    c = engine_config_for(detect_topology(), c, gpus);
  }
  return c;
}

inline bool wait_for(const std::atomic<uint64_t>& counter, uint64_t target,
                     std::chrono::seconds timeout = std::chrono::seconds(30)) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (counter.load(std::memory_order_acquire) < target) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::yield();
  }
  return true;
}

}  // namespace fabric::gpu_test
