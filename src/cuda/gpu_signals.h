// GPU signals: UVM watchers (a word the GPU writes, a CPU thread calls back on each change) and
// GPU-visible completion counters, all in one arena of pinned, device-mapped host memory.
#pragma once

#include <memory>

#include "fabric/config.h"
#include "fabric/transfer_engine.h"

namespace fabric {

class GpuSignals {
 public:
  virtual ~GpuSignals() = default;
  virtual UvmWatcher add_watcher(UvmCallback cb) = 0;
  virtual void remove_watcher(const UvmWatcher& w) = 0;
  virtual GpuCounter add_counter() = 0;
  virtual void remove_counter(const GpuCounter& c) = 0;
};

// Throws kUnsupported in builds without CUDA or without EngineConfig::cuda_device.
std::unique_ptr<GpuSignals> make_gpu_signals(const EngineConfig& config);
void gpu_stream_wait(void* cuda_stream, const GpuCounter& counter, uint64_t at_least);

}  // namespace fabric
