// Engine configuration: provider, NICs, polling policy, limits and timeouts.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace fabric {

// How a thread waits for work. kBusy spins (one core each, lowest latency: production).
// kAdaptive spins for a while, then yields, then sleeps briefly (for machines with few cores).
enum class PollMode { kBusy, kAdaptive };

// One NIC (one libfabric domain). Either field may be empty.
struct NicConfig {
  std::string domain;  // provider domain name to pick (e.g. "rdmap16s27-rdm" on EFA, "lo")
  std::string node;    // source address to bind (e.g. "127.0.0.2" for tcp on loopback)
};

// Deliberate disorder for tests: completions and immediates are held back and released
// in a random order (seeded), proving that nothing above the provider depends on order.
struct ReorderConfig {
  bool enabled = false;
  uint64_t seed = 1;
  uint32_t max_hold_polls = 8;  // a completion is held for 0..max_hold_polls polls
};

struct EngineConfig {
  std::string provider = "tcp;ofi_rxm";  // "efa" in production; "tcp;ofi_rxm" or "shm" here
  std::vector<NicConfig> nics = {NicConfig{}};  // 1 to 4
  PollMode worker_poll = PollMode::kBusy;
  PollMode callback_poll = PollMode::kAdaptive;
  // How long an adaptive worker sleeps between polls once it has spun and yielded in vain.
  std::chrono::microseconds idle_sleep{50};
  std::optional<int> worker_cpu;  // pin the worker to this core (before it allocates NIC state)

  // A transfer (or send) that has not completed after this long fails with kTimeout.
  std::chrono::milliseconds transfer_timeout{30000};

  size_t request_queue_capacity = 16384;
  size_t event_queue_capacity = 65536;
  size_t max_regions = 4096;         // registered regions at once
  size_t max_message_size = 16384;   // largest submit_send payload
  size_t send_slots = 256;           // send buffers per engine (sends wait when all are in use)
  size_t cq_batch = 64;              // completions read per poll
  // WRITEs and SENDs posted and not yet completed, per NIC. Beyond what hides the round trip,
  // more in flight only spreads the copies over more cache (measured: docs/benchmarks.md).
  size_t max_in_flight_per_nic = 64;

  ReorderConfig reorder;

  // The CUDA device (GPU) this engine serves, if any. With it, NIC providers are asked for GPU
  // memory support (libfabric FI_HMEM) and the cuda_ipc domain and GPU signals use this device.
  std::optional<int> cuda_device;
  // Also reach GPU peers on this host through CUDA IPC (copies over NVLink or PCIe by the GPU),
  // chosen per destination when both engines offer it. Needs cuda_device and a CUDA build.
  bool cuda_ipc = false;
  // UVM watchers' polling thread: pinned to this core if given; polls as worker_poll says.
  std::optional<int> watcher_cpu;

  // Record, per transfer, the time from the submit call to its first and its last WRITE handed to
  // the provider (TransferEngine::take_post_timings). For benchmarks; costs two clock reads per
  // transfer when on.
  bool record_post_timings = false;

  // Reads FABRIC_PROVIDER, FABRIC_NICS (comma-separated nodes), FABRIC_POLL (busy|adaptive),
  // FABRIC_CUDA_DEVICE (index) and FABRIC_CUDA_IPC (1) on top of the defaults; used by examples
  // and tests.
  static EngineConfig from_env();
};

}  // namespace fabric
