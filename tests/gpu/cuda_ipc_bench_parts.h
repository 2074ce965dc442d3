// Parts of cuda_ipc_bench (tests/gpu/cuda_ipc_bench.cpp) that drive the cuda_ipc Domain and the
// GPU signalling directly, in the same run as the engine's figures:
//   - paged WRITEs through Domain::post_write_batch, in batches of caps().max_write_batch as the
//     engine's worker posts them, against one contiguous copy of the same bytes; the same pages
//     through one post_write each (the path before batches); the gather kernel alone;
//   - GPU -> CPU -> GPU round trips: the minimal ping-pong (the floor: a volatile store and
//     __threadfence_system() into cudaHostAlloc(Mapped) memory, a bare CPU thread spinning on
//     volatile loads and echoing with a store), and variants that each change one thing from
//     it (the store pattern, where the two words lie), so that the gap between the engine's
//     watcher and the floor can be told apart.
#pragma once

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "domain/domain.h"
#include "gpu_kernels.h"
#include "gpu_support.h"
#include "providers/cuda_ipc/cuda_ipc_domain.h"
#include "providers/cuda_ipc/gather_copy.h"

namespace fabric::gpu_test::bench {

using BenchClock = std::chrono::steady_clock;

inline EngineConfig raw_domain_config(int device) {
  EngineConfig c;
  c.cuda_device = device;
  c.cuda_ipc = true;
  c.transfer_timeout = std::chrono::seconds(30);
  return c;
}

// ---- paged WRITEs through the Domain ---------------------------------------------------------

// The receiving side: a cuda_ipc domain of its own over the destination buffer, polled by a
// thread that counts immediates (as the engine's worker would hand them to its ImmCounter).
class BatchReceiver {
 public:
  BatchReceiver(int device, void* dst, size_t len)
      : domain_(open_cuda_ipc_domain(raw_domain_config(device))),
        region_(domain_->register_memory(dst, len, Device::cuda(device))) {
    thread_ = std::thread([this] {
      std::vector<Completion> out(1024);
      while (!stop_.load(std::memory_order_relaxed)) {
        size_t n = domain_->poll(out);
        uint64_t k = 0;
        for (size_t i = 0; i < n; i++) k += out[i].kind == Completion::Kind::kRemoteImm;
        if (k) imms_.fetch_add(k, std::memory_order_release);
      }
    });
  }
  ~BatchReceiver() {
    stop_ = true;
    thread_.join();
    domain_->deregister_memory(region_);
  }
  const std::string& address() const { return domain_->address(); }
  uint64_t rkey() const { return region_.remote.rkey; }
  uint64_t imms() const { return imms_.load(std::memory_order_acquire); }

 private:
  std::unique_ptr<Domain> domain_;
  DomainRegion region_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> imms_{0};
  std::thread thread_;
};

// The sending side: a cuda_ipc domain of its own, the source registered with it.
class BatchSender {
 public:
  BatchSender(int device, void* src, size_t len, const std::string& peer_address, uint64_t rkey)
      : domain_(open_cuda_ipc_domain(raw_domain_config(device))),
        src_(static_cast<uint8_t*>(src)),
        region_(domain_->register_memory(src, len, Device::cuda(device))),
        peer_(domain_->insert_peer(peer_address)),
        rkey_(rkey) {}
  ~BatchSender() { domain_->deregister_memory(region_); }
  size_t max_write_batch() const { return domain_->caps().max_write_batch; }

  // GB/s of pages (src_off[i] -> dst_off[i], `page` bytes each) posted as the engine's worker
  // posts a paged transfer: batches of max_write_batch() WriteOps built from the page lists,
  // one OpContext each, kRetry answered by polling; timed until the last batch has completed.
  double paged_batches(const std::vector<uint64_t>& src_off, const std::vector<uint64_t>& dst_off,
                       uint64_t page, bool with_imm) {
    const size_t batch = domain_->caps().max_write_batch;
    const size_t pages = src_off.size();
    std::vector<OpContext> ctx((pages + batch - 1) / batch);
    std::vector<WriteOp> ops;
    ops.reserve(batch);
    size_t done = 0;
    auto t0 = BenchClock::now();
    for (size_t k = 0; k < ctx.size(); k++) {
      const size_t first = k * batch, n = std::min(batch, pages - first);
      ops.clear();
      WriteOp op;
      op.desc = region_.desc;
      op.peer = peer_;
      op.rkey = rkey_;
      op.has_imm = with_imm;
      op.imm = 3;
      op.len = page;
      for (size_t p = first; p < first + n; p++) {
        op.src = src_ + src_off[p];
        op.remote_addr = dst_off[p];
        ops.push_back(op);
      }
      PostResult r;
      while ((r = domain_->post_write_batch(ops, &ctx[k])) == PostResult::kRetry) done += poll();
      if (r != PostResult::kPosted) throw std::runtime_error("post_write_batch: " + domain_->last_error());
      done += poll();
    }
    const auto posted = BenchClock::now();
    while (done < ctx.size()) done += poll();
    const double total = std::chrono::duration<double>(BenchClock::now() - t0).count();
    last_host_share = std::chrono::duration<double>(posted - t0).count() / total;
    return double(page) * pages / total / 1e9;
  }
  // Of the last paged_batches: the share of its time until the last batch was posted (the host
  // building WriteOps and descriptors), the rest waiting for the GPU.
  double last_host_share = 0;

  // The same pages through one post_write and one OpContext each (the path before batches).
  double paged_single_posts(const std::vector<uint64_t>& src_off, const std::vector<uint64_t>& dst_off,
                            uint64_t page) {
    std::vector<OpContext> ctx(src_off.size());
    size_t done = 0;
    auto t0 = BenchClock::now();
    for (size_t p = 0; p < src_off.size(); p++) {
      WriteOp op;
      op.src = src_ + src_off[p];
      op.len = page;
      op.desc = region_.desc;
      op.peer = peer_;
      op.remote_addr = dst_off[p];
      op.rkey = rkey_;
      PostResult r;
      while ((r = domain_->post_write(op, &ctx[p])) == PostResult::kRetry) done += poll();
      if (r != PostResult::kPosted) throw std::runtime_error("post_write: " + domain_->last_error());
      if ((p & 255) == 255) done += poll();  // the worker polls between rounds of posts
    }
    while (done < ctx.size()) done += poll();
    return double(page) * src_off.size() / std::chrono::duration<double>(BenchClock::now() - t0).count() / 1e9;
  }

 private:
  size_t poll() {
    size_t n = domain_->poll(out_);
    for (size_t i = 0; i < n; i++)
      if (out_[i].kind == Completion::Kind::kError) throw std::runtime_error("batch failed: " + out_[i].error);
    return n;
  }

  std::unique_ptr<Domain> domain_;
  uint8_t* src_;
  DomainRegion region_;
  PeerId peer_;
  uint64_t rkey_;
  std::vector<Completion> out_ = std::vector<Completion>(256);
};

// GB/s of the gather kernel alone on `stream` (cudaEvent-timed): the pages as launches of
// `per_launch` descriptors, back to back, descriptors in pinned mapped host memory.
inline double gather_kernel_alone(uint8_t* src, uint8_t* dst, const std::vector<uint64_t>& src_off,
                                  const std::vector<uint64_t>& dst_off, uint64_t page, uint32_t per_launch,
                                  cudaStream_t stream) {
  int dev = 0, sms = 0;
  ck(cudaGetDevice(&dev), "cudaGetDevice");
  ck(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), "SM count");
  void* mem = nullptr;
  ck(cudaHostAlloc(&mem, src_off.size() * sizeof(cuda::CopyDesc), cudaHostAllocMapped | cudaHostAllocPortable),
     "cudaHostAlloc");
  auto* descs = static_cast<cuda::CopyDesc*>(mem);
  for (size_t i = 0; i < src_off.size(); i++) descs[i] = {src + src_off[i], dst + dst_off[i], page};
  cudaEvent_t a, b;
  ck(cudaEventCreate(&a), "event");
  ck(cudaEventCreate(&b), "event");
  ck(cudaEventRecord(a, stream), "record");
  for (size_t first = 0; first < src_off.size(); first += per_launch) {
    auto n = static_cast<uint32_t>(std::min<size_t>(per_launch, src_off.size() - first));
    ck(cuda::launch_gather_copy(descs + first, n, sms, stream), "gather launch");
  }
  ck(cudaEventRecord(b, stream), "record");
  ck(cudaEventSynchronize(b), "sync");
  float ms = 0;
  ck(cudaEventElapsedTime(&ms, a, b), "elapsed");
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  cudaFreeHost(mem);
  return double(page) * src_off.size() / (ms / 1e3) / 1e9;
}

// ---- round trips GPU -> CPU -> GPU -----------------------------------------------------------

inline std::string stats_line(std::vector<double> v) {
  if (v.empty()) return "{\"n\": 0}";
  std::sort(v.begin(), v.end());
  double mean = std::accumulate(v.begin(), v.end(), 0.0) / v.size();
  char buf[256];
  std::snprintf(buf, sizeof buf,
                "{\"n\": %zu, \"mean_us\": %.3f, \"p50_us\": %.3f, \"p90_us\": %.3f, \"p99_us\": %.3f, \"max_us\": %.3f}",
                v.size(), mean, v[v.size() / 2], v[v.size() * 9 / 10], v[v.size() * 99 / 100], v.back());
  return buf;
}

inline double p50(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The NUMA node of a CPU, or -1.
inline int node_of_cpu(int cpu) {
  std::error_code ec;
  for (int node = 0; node < 64; node++)
    if (std::filesystem::exists("/sys/devices/system/node/node" + std::to_string(node) + "/cpu" + std::to_string(cpu), ec))
      return node;
  return cpu >= 0 && std::filesystem::exists("/sys/devices/system/node/node0", ec) ? 0 : -1;
}

// The NUMA node the GPU hangs off (its PCI device's numa_node), or -1.
inline int node_of_gpu(int device) {
  char bus[32] = {};
  if (cudaDeviceGetPCIBusId(bus, sizeof bus, device) != cudaSuccess) return -1;
  std::string id(bus);
  std::transform(id.begin(), id.end(), id.begin(), [](unsigned char c) { return std::tolower(c); });
  std::ifstream f("/sys/bus/pci/devices/" + id + "/numa_node");
  int node = -1;
  if (!(f >> node)) {
    if (id.size() > 12) {  // "00000000:..." -> "0000:..."
      std::ifstream g("/sys/bus/pci/devices/" + id.substr(4) + "/numa_node");
      if (!(g >> node)) node = -1;
    }
  }
  return node;
}

// kRounds round trips of the kernel `signal` through `word` / `ack` (device pointers), the CPU
// side running `echo_step` in a loop on its own thread until the kernel ends (for the bare
// thread and the minimal ping-pong; the engine's watcher passes none). The first 100 rounds
// are dropped; a round that timed out ends the list. `cpu_seen` gets the CPU the echo ran on.
inline std::vector<double> round_trips(uint64_t* word, const volatile uint64_t* ack, PingPongSignal signal,
                                       cudaStream_t stream, const std::function<void()>& echo_step,
                                       int* cpu_seen = nullptr) {
  constexpr uint32_t kRounds = 20000;
  uint64_t* out = nullptr;
  ck(cudaMalloc(reinterpret_cast<void**>(&out), kRounds * 8), "cudaMalloc");
  ck(cudaMemset(out, 0, kRounds * 8), "cudaMemset");
  std::atomic<bool> stop{false};
  std::thread t;
  if (echo_step)
    t = std::thread([&] {
      if (cpu_seen) *cpu_seen = sched_getcpu();
      while (!stop.load(std::memory_order_relaxed)) echo_step();
    });
  cudaError_t rc = launch_ping_pong_signal(word, ack, kRounds, out, signal, stream);
  if (rc == cudaSuccess) rc = cudaStreamSynchronize(stream);
  stop = true;
  if (t.joinable()) t.join();  // before any throw: a joinable thread must not be destroyed
  ck(rc, "ping_pong_signal");
  std::vector<uint64_t> ns(kRounds);
  ck(cudaMemcpy(ns.data(), out, kRounds * 8, cudaMemcpyDefault), "copy back");
  cudaFree(out);
  std::vector<double> us;
  for (uint32_t i = 100; i < kRounds && ns[i] != UINT64_MAX && ns[i] != 0; i++) us.push_back(ns[i] / 1000.0);
  return us;
}

// Two words of their own cudaHostAlloc(Mapped) allocation, `gap` bytes apart, and a bare CPU
// thread that spins on the first with volatile loads and echoes into the second with a store.
inline std::vector<double> minimal_ping_pong(PingPongSignal signal, size_t gap, cudaStream_t stream,
                                             int* cpu_seen = nullptr) {
  void* host = nullptr;
  ck(cudaHostAlloc(&host, 8192, cudaHostAllocMapped), "cudaHostAlloc(mapped)");
  std::memset(host, 0, 8192);
  void* dev = nullptr;
  ck(cudaHostGetDevicePointer(&dev, host, 0), "cudaHostGetDevicePointer");
  auto* word_h = static_cast<volatile uint64_t*>(host);
  auto* ack_h = reinterpret_cast<volatile uint64_t*>(static_cast<uint8_t*>(host) + gap);
  auto* word_d = static_cast<uint64_t*>(dev);
  auto* ack_d = reinterpret_cast<const volatile uint64_t*>(static_cast<uint8_t*>(dev) + gap);
  uint64_t last = 0;
  auto us = round_trips(word_d, ack_d, signal, stream,
                        [&] {
                          uint64_t v = *word_h;
                          if (v != last) *ack_h = last = v;
                        },
                        cpu_seen);
  cudaFreeHost(host);
  return us;
}

// The bare thread on two of the engine's GPU counter words (its signal arena) instead.
inline std::vector<double> engine_words_ping_pong(TransferEngine& engine, PingPongSignal signal, cudaStream_t stream) {
  GpuCounter ack = engine.alloc_gpu_counter();
  GpuCounter word = engine.alloc_gpu_counter();
  uint64_t last = 0;
  auto us = round_trips(const_cast<uint64_t*>(word.device), ack.device, signal, stream, [&] {
    uint64_t v = word.host->load(std::memory_order_acquire);
    if (v != last) ack.host->store(last = v, std::memory_order_release);
  });
  engine.free_gpu_counter(word);
  engine.free_gpu_counter(ack);
  return us;
}

// The engine's UVM watcher: the kernel stores into the watcher's word, the callback answers into
// a GPU counter of the same engine.
inline std::vector<double> watcher_ping_pong(TransferEngine& engine, PingPongSignal signal, cudaStream_t stream,
                                             int* cpu_seen = nullptr) {
  GpuCounter ack = engine.alloc_gpu_counter();
  std::atomic<int> cpu{-1};
  UvmWatcher w = engine.alloc_uvm_watcher([&](uint64_t, uint64_t v) {
    ack.host->store(v, std::memory_order_release);
    if (cpu.load(std::memory_order_relaxed) < 0) cpu.store(sched_getcpu(), std::memory_order_relaxed);
  });
  auto us = round_trips(w.device, ack.device, signal, stream, nullptr);
  engine.free_uvm_watcher(w);
  engine.free_gpu_counter(ack);
  if (cpu_seen) *cpu_seen = cpu.load();
  return us;
}

}  // namespace fabric::gpu_test::bench
