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

// One NIC (one libfabric domain, or one verbs device). Either field may be empty.
struct NicConfig {
  // libfabric: the provider domain to pick (e.g. "rdmap16s27-rdm" on EFA, "lo").
  // verbs: the device name (e.g. "mlx5_0", "rxe0"); empty picks the first device. Several NICs
  // may name the same device (each opens its own context and queue pairs).
  std::string domain;
  std::string node;    // libfabric: source address to bind (e.g. "127.0.0.2" for tcp on loopback)

  // One NIC as users write it: "domain@node", a node ("127.0.0.2") for libfabric, a device name
  // ("mlx5_0") for verbs, "" for the provider's default.
  static NicConfig parse(const std::string& provider, const std::string& text);
  // A comma-separated list of those (FABRIC_NICS); empty entries are skipped.
  static std::vector<NicConfig> parse_list(const std::string& provider, const std::string& list);
};

// The verbs provider (ConnectX and other RC NICs, Soft-RoCE).
struct VerbsConfig {
  uint8_t port = 1;
  // RoCE: the GID table index to use. Default: the first RoCE v2 entry with an IPv4-mapped
  // address, else the first RoCE v2 entry, else the first valid one (InfiniBand: index 0).
  std::optional<int> gid_index;
  // The connection handshake (over UD) repeats its message with backoff and fails the peer after
  // this long: writes and sends to it then end with kProvider.
  std::chrono::milliseconds handshake_timeout{10000};
  // After a failed handshake, posts to that peer fail at once for this long; the first post after
  // it tries to connect again (and a message from the peer reconnects it at any time).
  std::chrono::milliseconds reconnect_backoff{1000};
  // RC retransmission: 4.096 us * 2^ack_timeout per try, 1 + retry_count tries before the queue
  // pair fails; its requests then fail and the next post to the peer reconnects. 20 and 7 (as
  // NCCL) give about 35 s, so link flaps and pause storms do not cut connections; tests use 14
  // and 3 (about 0.3 s). Soft-RoCE (rxe) retries forever when retry_count is 7.
  uint8_t ack_timeout = 20;
  uint8_t retry_count = 7;
  // Receiver not ready (the immediate receive queue ran dry): the sender retries after this long,
  // forever (rnr_retry 7). IB encoding: 1 = 0.01 ms ... 6 = 0.08 ms ... 12 = 0.64 ms, 0 = 655 ms.
  // 6 keeps a stall below one MoE step; the receive queue is sized so that it should not happen.
  uint8_t min_rnr_timer = 6;
  // Receives posted for arriving immediates (one per WRITE with an immediate that has landed and
  // not yet been polled). 0: min(16384, the device's max_srq_wr). Raise it when many peers write
  // at once (peers x WRITEs in flight each); under a quarter still posted logs a warning naming
  // this field (at most once a second).
  uint32_t imm_receives = 0;
  // RoCE / InfiniBand traffic class of every packet this NIC sends (queue pairs and handshake):
  // the GRH traffic class (RoCE v2: DSCP << 2 | ECN, e.g. 106 for DSCP 26, as NCCL_IB_TC) and the
  // service level (0-15; on RoCE the VLAN priority). On a lossless (PFC) fabric set them to the
  // class the switches keep lossless. FABRIC_VERBS_TC / FABRIC_VERBS_SL set them from the
  // environment.
  uint8_t traffic_class = 0;
  uint8_t service_level = 0;
  // For tests: the first N handshake packets this domain sends are dropped (lost-packet recovery).
  uint32_t drop_handshake_packets = 0;
};

// Deliberate disorder for tests: completions and immediates are held back and released
// in a random order (seeded), proving that nothing above the provider depends on order.
struct ReorderConfig {
  bool enabled = false;
  uint64_t seed = 1;
  uint32_t max_hold_polls = 8;  // a completion is held for 0..max_hold_polls polls
};

// Injected faults, for tests and the soak (seeded, reproducible; every probability is per
// operation or per arriving immediate, 0 to 1). The engine must report each affected transfer's
// error exactly once and keep serving everything else.
struct FaultConfig {
  bool enabled = false;
  uint64_t seed = 1;
  double post_failure = 0;      // a WRITE or SEND is refused at post time (nothing is sent)
  double completion_error = 0;  // the operation runs, but its completion reports an error
  double stuck = 0;             // the operation runs, and its completion never comes
  double duplicate_imm = 0;     // an arriving immediate is reported twice
  double delay_imm = 0;         // an arriving immediate is held back for 1..max_delay_polls polls
  uint32_t max_delay_polls = 256;
  // Posts to these peer endpoints (NetAddr::nic(i) of the peer, per NIC) always answer
  // PostResult::kRetryPeer, as a peer whose connection never comes up: per-peer back-pressure.
  std::vector<std::string> busy_peers;
  // After this many posted operations (0: never) the domain's next poll never returns, as a
  // provider spinning on a lock that a dead peer held: the engine must still not hang its caller.
  uint64_t wedge_after_posts = 0;
  // How long that poll hangs (0: for ever); then it returns, as shm once the dead peer's lock is
  // freed. A worker the engine abandoned meanwhile must then leave the provider alone.
  std::chrono::milliseconds wedge_for{0};
};

// One worker of a multi-GPU engine: the GPU it serves, its NICs (its rail) and its cores. Built by
// engine_config_for(detect_topology()) or by hand.
struct WorkerConfig {
  std::optional<int> cuda_device;  // none: a host-memory worker (only as the engine's only worker)
  std::vector<NicConfig> nics = {NicConfig{}};  // 1 to 4; every worker has as many
  std::optional<int> worker_cpu;
  std::optional<int> watcher_cpu;
};

struct EngineConfig {
  // "efa" or "verbs" in production; "tcp;ofi_rxm" or "shm" here ("verbs" on Soft-RoCE in a VM).
  // Any other name is a libfabric provider.
  std::string provider = "tcp;ofi_rxm";
  std::vector<NicConfig> nics = {NicConfig{}};  // 1 to 4
  PollMode worker_poll = PollMode::kBusy;
  PollMode callback_poll = PollMode::kAdaptive;
  // How long an adaptive worker sleeps between polls once it has spun and yielded in vain (its
  // timer slack is 1 us, so the sleep lasts about this long, not 50 us more).
  std::chrono::microseconds idle_sleep{50};
  std::optional<int> worker_cpu;  // pin the worker to this core (before it allocates NIC state)

  // A transfer (or send) that has not completed after this long fails with kTimeout.
  std::chrono::milliseconds transfer_timeout{30000};
  // A worker that makes no progress for this long is wedged inside a provider call that does not
  // return (seen: shm spinning on a lock a killed peer held). Calls that wait for it throw
  // kTimeout instead of hanging, and closing the engine abandons the worker (its thread and
  // memory are left behind, its pending transfers never report) instead of waiting for ever.
  std::chrono::milliseconds worker_stall_timeout{30000};

  size_t request_queue_capacity = 16384;
  size_t event_queue_capacity = 65536;
  size_t max_regions = 4096;         // registered regions at once
  size_t max_remotes = 65536;        // remote regions interned at once (add_remote)
  size_t max_message_size = 16384;   // largest submit_send payload
  size_t send_slots = 256;           // send buffers per engine (sends wait when all are in use)
  size_t cq_batch = 64;              // completions read per poll
  // WRITEs and SENDs posted and not yet completed, per NIC. Beyond what hides the round trip,
  // more in flight only spreads the copies over more cache (measured: docs/benchmarks.md).
  size_t max_in_flight_per_nic = 64;
  // Distinct immediate values counted while no expectation waits for them (early arrivals). An
  // arrival of one more such value is dropped and counted in NicStats::imms_dropped: memory
  // stays bounded whatever senders do.
  size_t max_unexpected_imms = 65536;

  ReorderConfig reorder;
  FaultConfig faults;
  VerbsConfig verbs;

  // The CUDA device (GPU) this engine serves, if any. With it, NIC providers are asked for GPU
  // memory support (libfabric FI_HMEM) and the cuda_ipc domain and GPU signals use this device.
  std::optional<int> cuda_device;
  // Also reach GPU peers on this host through CUDA IPC (copies over NVLink or PCIe by the GPU),
  // chosen per destination when both engines offer it. Needs cuda_device and a CUDA build.
  bool cuda_ipc = false;
  // Also reach host-memory peers on this host by copying straight into their registered memory
  // (process_vm_writev by the initiator: one copy, none by the peer's CPU), chosen per destination
  // when both engines offer it; messages and immediates go through shared memory. Needs ptrace
  // access between the processes (same user; the domain allows it under Yama's ptrace_scope 1):
  // where a peer cannot be written, its NICs carry it. Not with cuda_ipc (one local domain per
  // worker). Environment: FABRIC_HOST_IPC=1.
  bool host_ipc = false;
  // UVM watchers' polling thread: pinned to this core if given; polls as worker_poll says.
  std::optional<int> watcher_cpu;

  // A multi-GPU engine: one worker per entry (at most kMaxWorkers), each with its own thread,
  // request queue, NICs and UVM watcher thread; requests go to the worker of their source region's
  // device (host memory: the first worker). Empty: one worker made of the fields above (nics,
  // cuda_device, worker_cpu, watcher_cpu), as a one-GPU or host-only engine has always been.
  std::vector<WorkerConfig> workers;

  // Record, per transfer, the time from the submit call to its first and its last WRITE handed to
  // the provider (TransferEngine::take_post_timings). For benchmarks; costs two clock reads per
  // transfer when on.
  bool record_post_timings = false;

  // Serve GET /metrics (TransferEngine::metrics_text) over HTTP on this TCP port, for processes
  // without Python (0: off). A small thread of its own answers one request at a time; it never
  // touches a worker's data path. Bound to metrics_address (loopback unless said otherwise:
  // metrics name peers). The engine throws kInvalidArgument when it cannot bind.
  uint16_t metrics_port = 0;
  std::string metrics_address = "127.0.0.1";

  // Reads FABRIC_PROVIDER, FABRIC_NICS (comma-separated, NicConfig::parse_list),
  // FABRIC_GID_INDEX (verbs), FABRIC_POLL (busy|adaptive), FABRIC_CUDA_DEVICE (index) and
  // FABRIC_CUDA_IPC (1) on top of the defaults; used by examples and tests.
  static EngineConfig from_env();
};

}  // namespace fabric
