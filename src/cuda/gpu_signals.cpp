// GpuSignals on CUDA: an arena of cudaHostAlloc memory (mapped, portable), one word per 128 bytes
// (two cache lines: the adjacent-line prefetcher never couples two words), and one watcher thread
// that scans the active watchers' words and calls back. The thread's scan reads a dense list of
// the active watchers (not every slot up to the highest one in use: GPU counters share the slots),
// so a scan with nothing new costs a few loads per watcher and one atomic increment.
//
// Latency (docs/benchmarks.md, "GPU signals"): a round trip GPU -> callback -> GPU is bounded by
// PCIe, not by this loop; what the kernel does around its store matters more. A fence before the
// store (st.release.sys, or __threadfence_system() then the store) costs a whole system-scope
// MEMBAR (about a PCIe round trip) before the store leaves the SM; a store followed by
// __threadfence_system(), or a store alone, lets that flight overlap.
#include "cuda/gpu_signals.h"

#include <pthread.h>
#include <sched.h>

#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "cuda/cuda_check.h"
#include "cuda/driver_api.h"
#include "util/idle.h"
#include "util/log.h"

namespace fabric {
namespace {

constexpr uint32_t kSlots = 4096;
constexpr size_t kLine = 128;

class CudaGpuSignals final : public GpuSignals {
 public:
  explicit CudaGpuSignals(const EngineConfig& config)
      : config_(config), slots_(kSlots), active_ids_(kSlots), active_pos_(kSlots, UINT32_MAX) {
    cuda::use_device(*config.cuda_device);
    void* arena = nullptr;
    cuda::check("cudaHostAlloc(GPU signals)",
                cudaHostAlloc(&arena, kSlots * kLine, cudaHostAllocMapped | cudaHostAllocPortable));
    host_ = static_cast<uint8_t*>(arena);
    void* dev = nullptr;
    cuda::check("cudaHostGetDevicePointer", cudaHostGetDevicePointer(&dev, arena, 0));
    device_ = static_cast<uint8_t*>(dev);
    std::memset(host_, 0, kSlots * kLine);
    for (uint32_t i = kSlots; i-- > 0;) free_.push_back(i);
  }

  ~CudaGpuSignals() override {
    if (thread_.joinable()) {
      stop_.store(true, std::memory_order_relaxed);
      thread_.join();
    }
    cudaFreeHost(host_);
  }

  UvmWatcher add_watcher(UvmCallback cb) override {
    if (!cb) throw Error(ErrorCode::kInvalidArgument, "alloc_uvm_watcher: the callback is empty");
    std::lock_guard lock(mu_);
    uint32_t id = take_slot("alloc_uvm_watcher");
    Slot& s = slots_[id];
    s.cb = std::move(cb);
    s.last = 0;
    s.active.store(true, std::memory_order_release);
    // Onto the scan list: the entry first, then the count (release), so a scan that sees the
    // count sees the entry.
    uint32_t n = active_count_.load(std::memory_order_relaxed);
    active_ids_[n].store(id, std::memory_order_relaxed);
    active_pos_[id] = n;
    active_count_.store(n + 1, std::memory_order_release);
    if (!thread_.joinable()) thread_ = std::thread([this] { run(); });
    return {reinterpret_cast<uint64_t*>(device_ + id * kLine), word(id), id};
  }

  void remove_watcher(const UvmWatcher& w) override {
    {
      std::lock_guard lock(mu_);
      Slot& s = check_slot(w.id, "free_uvm_watcher");
      s.retiring = true;  // a second free of this id fails from now on
      // seq_cst with the epoch's increments and loads: a scan that starts after the epoch we read
      // below has moved on sees the slot inactive (the wait below relies on it).
      s.active.store(false, std::memory_order_seq_cst);
      drop_from_scan(w.id);
      // Inside a callback, on the watcher thread: the thread releases the slot itself once it
      // has left the callback (it reads the flag again before any further call).
      if (std::this_thread::get_id() == thread_.get_id()) {
        retired_.push_back(w.id);
        has_retired_.store(true, std::memory_order_release);
        return;
      }
    }
    // Wait, without the lock (a callback may be allocating a watcher right now), until the thread
    // has finished any scan that saw the watcher active.
    uint64_t seen = epoch_.load(std::memory_order_seq_cst);
    while (epoch_.load(std::memory_order_acquire) < seen + 2) std::this_thread::yield();
    std::lock_guard lock(mu_);
    slots_[w.id].cb = nullptr;
    release_slot(w.id);
  }

  GpuCounter add_counter() override {
    std::lock_guard lock(mu_);
    uint32_t id = take_slot("alloc_gpu_counter");
    slots_[id].counter = true;
    auto* a = new (host_ + id * kLine) std::atomic<uint64_t>(0);
    return {a, reinterpret_cast<const uint64_t*>(device_ + id * kLine), id};
  }

  void remove_counter(const GpuCounter& c) override {
    std::lock_guard lock(mu_);
    Slot& s = check_slot(c.id, "free_gpu_counter");
    if (!s.counter) throw Error(ErrorCode::kInvalidArgument, "free_gpu_counter: not a GPU counter");
    release_slot(c.id);
  }

 private:
  struct Slot {
    std::atomic<bool> active{false};
    bool in_use = false;
    bool retiring = false;  // freed, waiting for the watcher thread to let go of it
    bool counter = false;
    uint64_t last = 0;
    UvmCallback cb;
  };

  volatile uint64_t* word(uint32_t id) const { return reinterpret_cast<volatile uint64_t*>(host_ + id * kLine); }

  // Off the scan list (under mu_, after the slot went inactive): the last entry moves into its
  // place. A scan running meanwhile may read the moved watcher twice (the second read sees no
  // change) or the old entry (inactive: skipped), never miss one that stays: the moved entry is
  // still at the end until the count drops, and the count drops after it was copied.
  void drop_from_scan(uint32_t id) {
    uint32_t k = active_pos_[id];
    if (k == UINT32_MAX) return;
    uint32_t last = active_count_.load(std::memory_order_relaxed) - 1;
    uint32_t moved = active_ids_[last].load(std::memory_order_relaxed);
    active_ids_[k].store(moved, std::memory_order_relaxed);
    active_pos_[moved] = k;
    active_pos_[id] = UINT32_MAX;
    active_count_.store(last, std::memory_order_release);
  }

  uint32_t take_slot(const char* what) {
    if (free_.empty())
      throw Error(ErrorCode::kResourceExhausted,
                  fmt::format("{}: all {} GPU signal words are in use", what, kSlots));
    uint32_t id = free_.back();
    free_.pop_back();
    slots_[id].in_use = true;
    *word(id) = 0;
    return id;
  }

  Slot& check_slot(uint32_t id, const char* what) {
    if (id >= kSlots || !slots_[id].in_use || slots_[id].retiring)
      throw Error(ErrorCode::kNotFound, fmt::format("{}: unknown or already freed id {}", what, id));
    return slots_[id];
  }

  void release_slot(uint32_t id) {
    Slot& s = slots_[id];
    s.in_use = s.retiring = s.counter = false;
    *word(id) = 0;
    free_.push_back(id);
  }

  // Watcher thread, between scans: watchers freed from inside their own callbacks.
  void release_retired() {
    std::lock_guard lock(mu_);
    for (uint32_t id : retired_) {
      slots_[id].cb = nullptr;
      release_slot(id);
    }
    retired_.clear();
    has_retired_.store(false, std::memory_order_relaxed);
  }

  void run() {
    if (config_.watcher_cpu) {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(*config_.watcher_cpu, &set);
      pthread_setaffinity_np(pthread_self(), sizeof set, &set);
    }
    util::Idle idle(config_.worker_poll, config_.idle_sleep);
    while (!stop_.load(std::memory_order_relaxed)) {
      bool any = false;
      const uint32_t n = active_count_.load(std::memory_order_acquire);
      for (uint32_t k = 0; k < n; k++) {
        const uint32_t id = active_ids_[k].load(std::memory_order_relaxed);
        Slot& s = slots_[id];
        if (!s.active.load(std::memory_order_seq_cst)) continue;  // a plain load on x86
        uint64_t v = *word(id);
        if (v == s.last) continue;
        uint64_t old = s.last;
        s.last = v;
        any = true;
        try {
          s.cb(old, v);
        } catch (const std::exception& e) {
          log::error("UVM watcher {} callback threw: {}", id, e.what());
        }
      }
      // seq_cst (a locked add on x86, some 10 ns): together with the seq_cst store of a freed
      // watcher's flag and its loads above, the next scan after this one sees a watcher freed
      // before this increment as inactive. (A plain store would let this thread's next loads
      // pass it in the store buffer.)
      epoch_.fetch_add(1, std::memory_order_seq_cst);
      if (has_retired_.load(std::memory_order_acquire)) release_retired();
      if (any) {
        idle.reset();
      } else {
        idle.wait();
      }
    }
  }

  EngineConfig config_;
  uint8_t* host_ = nullptr;
  uint8_t* device_ = nullptr;
  std::vector<Slot> slots_;
  std::vector<uint32_t> free_;
  std::vector<uint32_t> retired_;
  std::mutex mu_;  // allocation and release (control path)
  std::vector<std::atomic<uint32_t>> active_ids_;  // the scan list: active watchers' ids
  std::vector<uint32_t> active_pos_;                // id -> its index in the list (under mu_)
  std::atomic<uint32_t> active_count_{0};
  std::atomic<uint64_t> epoch_{0};
  std::atomic<bool> has_retired_{false};
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace

std::unique_ptr<GpuSignals> make_gpu_signals(const EngineConfig& config) {
  if (!config.cuda_device)
    throw Error(ErrorCode::kInvalidArgument,
                "GPU signals need EngineConfig::cuda_device (the GPU this engine serves)");
  return std::make_unique<CudaGpuSignals>(config);
}

void gpu_stream_wait(void* cuda_stream, const GpuCounter& counter, uint64_t at_least) {
  cuda::stream_wait_geq(cuda_stream, counter.device, at_least);
}

}  // namespace fabric
