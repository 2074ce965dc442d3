// The Domain contract: what a provider (one NIC of libfabric, verbs, ...) must do for the engine.
// A Domain is owned by one worker thread; it never sees callbacks, transfer ids or other providers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "fabric/config.h"
#include "fabric/error.h"
#include "fabric/types.h"

namespace fabric {

// Completion context of one posted operation. The engine owns it (pooled, stable address); the
// provider may use `provider_space` for its own per-operation state (libfabric's fi_context2) and
// hands the OpContext back in the Completion. provider_space must stay the first member.
struct OpContext {
  alignas(16) void* provider_space[8] = {};
  // The provider's own words beside provider_space, which libfabric may take whole (shm's
  // sending endpoints link their outstanding operations through them: shm_senders.h).
  void* provider_words[4] = {};
  void* owner = nullptr;  // engine's object (transfer, receive slot, ...)
  uint32_t kind = 0;      // engine's tag
  uint32_t nic = 0;
  uint32_t peer = UINT32_MAX;  // engine's peer record the op goes to
  uint64_t aux = 0;       // engine's per-op value (e.g. bytes)
  uint32_t writes = 1;    // engine's: WRITEs the op stands for (a batch: its length)

  // Back to the pool: the engine's fields reset; provider_space is left as it is (a provider
  // fills it when the context is posted), which saves clearing 64 bytes per WRITE.
  void reuse() {
    owner = nullptr;
    kind = 0;
    nic = 0;
    peer = UINT32_MAX;
    aux = 0;
    writes = 1;
  }
};

// Handle of a peer inside one Domain (libfabric fi_addr_t, verbs QP index).
using PeerId = uint64_t;

// Domains per worker: its NICs, and one local (cuda_ipc) domain for same-host GPU peers.
inline constexpr size_t kMaxDomains = kMaxNics + 1;

// One registration of a region with one Domain.
struct DomainRegion {
  void* desc = nullptr;        // local descriptor to pass with posts (may be null where unused)
  RemoteKey remote;            // what a peer needs to write here
  bool remote_access = true;   // false: usable as a source only (cuda_ipc and host memory)
  void* provider = nullptr;    // provider's handle (fid_mr*, cuda_ipc region)
};

struct WriteOp {
  const void* src = nullptr;
  size_t len = 0;
  void* desc = nullptr;
  PeerId peer = 0;
  uint64_t remote_addr = 0;  // RemoteKey::base + offset
  uint64_t rkey = 0;
  bool has_imm = false;
  uint32_t imm = 0;
};

// kRetry: this domain cannot take work now (its queues are full): poll, then try again.
// kRetryPeer: only this peer cannot take work now (its connection is being set up, its queue
// pair or inbox is full); other peers of the domain can, and the engine keeps posting to them.
enum class PostResult { kPosted, kRetry, kRetryPeer, kFailed };

struct Completion {
  enum class Kind : uint8_t { kLocal, kRecv, kRemoteImm, kError };
  Kind kind = Kind::kLocal;
  OpContext* context = nullptr;  // null for kRemoteImm
  size_t len = 0;                // bytes received (kRecv)
  uint32_t imm = 0;              // kRemoteImm
  std::string error;             // kError: the provider's message
  // kError: the connection to the operation's peer is gone (reset, refused, unreachable, its
  // queue pair failed): the engine releases the peer once nothing of it is in flight, and the
  // next operation to its address connects afresh. False for errors that leave the peer usable.
  bool peer_lost = false;
};

// What one Domain (one NIC) can do, read once when it is opened (the provider's own attributes,
// the values its code runs on, never a second guess). For logs, topology and placement decisions;
// nothing on the posting path reads it.
struct DomainCaps {
  // What a person calls this NIC: the libfabric domain name ("rdmap16s27-rdm", "lo", "shm"), the
  // verbs device ("mlx5_0"), "cuda_ipc".
  std::string nic_name;
  // Can register CUDA device memory (libfabric FI_HMEM; verbs in a CUDA build: dma-buf or peer
  // memory; cuda_ipc).
  bool gpu_memory = false;
  // Largest single WRITE the provider takes (libfabric ep_attr->max_msg_size, SIZE_MAX where it
  // reports 0; verbs the port's max_msg_sz). Longer WRITEs are split inside the domain.
  size_t max_message = 0;
  // Largest payload sent inline (libfabric tx_attr->inject_size, verbs max_inline_data); 0: none.
  size_t inject_size = 0;
  // Link speed where the provider says (libfabric nic->link_attr->speed, verbs active speed x
  // width), in Gb/s; 0: unknown (loopback tcp, shm, cuda_ipc).
  double link_gbps = 0;
  // Data moves only while the application polls (libfabric FI_PROGRESS_MANUAL; verbs and cuda_ipc
  // hand held-back work to the hardware at poll()): the worker must poll even when idle.
  bool manual_progress = false;
  // register_memory / deregister_memory may run on any thread while the worker posts and polls
  // (verbs: ibv_reg_mr is thread-safe). The engine then pins a region on the caller's thread, so
  // pinning tens of GB stalls none of the worker's NICs. False for libfabric domains (opened
  // FI_THREAD_DOMAIN: the worker owns every call) and the local domains.
  bool concurrent_registration = false;
};

class Domain {
 public:
  virtual ~Domain() = default;

  virtual const std::string& provider_name() const = 0;
  virtual const std::string& address() const = 0;  // endpoint name, bytes
  // Fixed for the domain's life; any thread may read it once the domain is open.
  virtual const DomainCaps& caps() const = 0;
  // Largest immediate the provider carries is at least 32 bits; remote CQ data is masked to 32.

  // Throw fabric::Error on failure; kUnsupported when the provider cannot reach that device's
  // memory (the engine may then register it with its other domains only).
  virtual DomainRegion register_memory(void* ptr, size_t len, Device device) = 0;
  virtual void deregister_memory(DomainRegion& region) = 0;
  // Cached: the same address gives the same PeerId without a new insertion.
  virtual PeerId insert_peer(const std::string& address) = 0;
  // Forgets a peer and releases what it holds here (address-vector entry, queue pairs, shared
  // memory and IPC mappings). The engine calls it when the peer failed or the application
  // removed it; operations still posted to it may complete later (with success or an error) and
  // must still come back through poll() with their context, never touching released state.
  // Inserting the same address again afterwards gives a working peer (a restarted process at the
  // same address). An unknown id is ignored.
  virtual void remove_peer(PeerId peer) = 0;

  // kRetry / kRetryPeer: see PostResult; poll and try again later.
  // kFailed: the message is in last_error().
  // A provider may hold posted work back until its next poll() and hand it to the hardware as
  // one batch (cuda_ipc gathers many WRITEs into one kernel launch); poll() must flush it.
  virtual PostResult post_write(const WriteOp& op, OpContext* ctx) = 0;
  // WRITEs to one peer that complete together: a single Completion for ctx once every op has
  // landed (or an error for the batch), each op's immediate delivered as with post_write. The
  // engine uses it for paged transfers where max_write_batch() > 0 (cuda_ipc: one gather kernel
  // for many pages), with at most max_write_batch() ops per call.
  virtual size_t max_write_batch() const { return 0; }
  virtual PostResult post_write_batch(std::span<const WriteOp> ops, OpContext* ctx) {
    (void)ops;
    (void)ctx;
    return PostResult::kFailed;
  }
  virtual PostResult post_send(PeerId peer, const void* buf, size_t len, void* desc,
                               OpContext* ctx) = 0;
  virtual PostResult post_recv(void* buf, size_t len, void* desc, OpContext* ctx) = 0;
  virtual const std::string& last_error() const = 0;

  // Reads up to out.size() completions; returns how many were written.
  virtual size_t poll(std::span<Completion> out) = 0;
  // A zero-length registered buffer's descriptor, for immediate-only writes (EFA wants a valid
  // descriptor on every write).
  virtual void* scratch_desc() const = 0;
  virtual void* scratch_buffer() const = 0;
  // Operations the engine may keep posted and uncompleted here; 0: EngineConfig's per-NIC limit.
  virtual size_t max_in_flight() const { return 0; }

  // Faults a test wrapper injected (zero for real providers). Any thread may read them.
  struct InjectedFaults {
    uint64_t total = 0;
    uint64_t duplicated_imms = 0;
  };
  virtual InjectedFaults injected_faults() const { return {}; }
};

// A local domain's (cuda_ipc, host_ipc) address is "<host scope>/<endpoint>": two local domains
// reach each other exactly when their host scopes are equal. The host scope of such an address
// (the part before the first '/'). Domains are opened by the factory, providers/open_domain.h.
inline std::string_view local_scope(std::string_view local_address) {
  return local_address.substr(0, local_address.find('/'));
}

}  // namespace fabric
