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

// What one Domain (one NIC) can do: every capability of a provider is a field here, none is a
// virtual with a default. Filled once while the domain opens, from the provider's own attributes
// and the values its code runs on (never a second guess), and fixed for the domain's life. The
// first fields are for logs, topology and placement; the last two are limits the posting path
// keeps to (DomainGroup copies them when it opens the domain).
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
  // Operations (WRITEs, batches, SENDs; not receives) the engine keeps posted and uncompleted
  // here at most: libfabric EngineConfig::max_in_flight_per_nic; verbs that, bounded by its send
  // CQ; cuda_ipc its descriptor ring; host_ipc 65,536.
  size_t max_in_flight = 0;
  // Most WRITEs one post_write_batch takes (cuda_ipc 4,096, host_ipc 1,024). 0: the domain takes
  // no batches, and the engine never calls post_write_batch (libfabric, verbs, the test wrappers).
  size_t max_write_batch = 0;
};

// The contract. Lifecycle: the factory (providers/open_domain.h) constructs a Domain on the worker
// thread that will own it, after that thread is pinned, and throws fabric::Error if it cannot
// open; the same thread destroys it at shutdown, after it deregistered every region and stopped
// posting; the destructor closes the endpoints and registrations it still holds, after which
// nothing in the provider may refer to a context the engine handed it. A worker abandoned by its owner (wedged inside a provider) leaves its
// domains alive for the process exit to tear down.
//
// Threading: one thread (the owning worker; a test driving a Domain directly) makes every call,
// except where a group below says "any thread". A Domain takes no locks for the engine's sake and
// calls nothing back: results go out through return values and poll().
//
// Errors: the control calls (registration, peers) throw fabric::Error; the posts report through
// PostResult, the message of a kFailed in last_error(); failures of posted operations come back
// as Completion::Kind::kError. Provider return codes are translated here, with the call that
// failed.
class Domain {
 public:
  virtual ~Domain() = default;

  // ---- Identity and capabilities. Any thread, once the domain is open; fixed for its life. ----
  virtual const std::string& provider_name() const = 0;  // "tcp;ofi_rxm", "efa", "verbs", ...
  // This endpoint's name, as bytes a peer passes to insert_peer (NetAddr carries it).
  virtual const std::string& address() const = 0;
  virtual const DomainCaps& caps() const = 0;  // the same object every time
  // Immediates: every provider carries at least 32 bits; remote CQ data is masked to 32.

  // ---- Memory registration. The owning thread; any thread, also several at once, where
  // caps().concurrent_registration. ----
  // Throws fabric::Error on failure; kUnsupported when the provider cannot reach that device's
  // memory (the engine may then register it with its other domains only).
  virtual DomainRegion register_memory(void* ptr, size_t len, Device device) = 0;
  // Only once nothing posted from or to the region is in flight here.
  virtual void deregister_memory(DomainRegion& region) = 0;
  // A zero-length registered buffer and its descriptor, for immediate-only writes (EFA wants a
  // valid descriptor on every write). Registered when the domain opens, valid until it closes;
  // the owning thread.
  virtual void* scratch_desc() const = 0;
  virtual void* scratch_buffer() const = 0;

  // ---- Peers. The owning thread. ----
  // Cached: the same address gives the same PeerId without a new insertion. Throws
  // fabric::Error for an address the provider cannot use. May return before the connection
  // exists (verbs connects on the first post: kRetryPeer meanwhile).
  virtual PeerId insert_peer(const std::string& address) = 0;
  // Forgets a peer and releases what it holds here (address-vector entry, queue pairs, shared
  // memory and IPC mappings). The engine calls it when the peer failed or the application
  // removed it; operations still posted to it may complete later (with success or an error) and
  // must still come back through poll() with their context, never touching released state.
  // Inserting the same address again afterwards gives a working peer (a restarted process at the
  // same address). An unknown id is ignored.
  virtual void remove_peer(PeerId peer) = 0;

  // ---- Posting. The owning thread; a post must not wait for the peer. ----
  // kPosted: ctx comes back through poll() exactly once (kLocal, kRecv or kError). kRetry /
  // kRetryPeer: nothing was posted, ctx stays the caller's (see PostResult). kFailed: nothing was
  // posted; the message is in last_error().
  // A provider may hold posted work back until its next poll() and hand it to the hardware as
  // one batch (cuda_ipc gathers many WRITEs into one kernel launch); poll() must flush it.
  virtual PostResult post_write(const WriteOp& op, OpContext* ctx) = 0;
  // Only where caps().max_write_batch > 0, with 1 to max_write_batch ops to one peer that
  // complete together: a single Completion for ctx once every op has landed (or an error for the
  // batch), each op's immediate delivered as with post_write. The engine posts the pages of a
  // paged transfer to a same-host peer this way (cuda_ipc: one gather kernel for many pages). A
  // domain that sets max_write_batch 0 is never called here and returns kFailed.
  virtual PostResult post_write_batch(std::span<const WriteOp> ops, OpContext* ctx) = 0;
  // A two-sided message to a peer, matched by one of its post_recv buffers (in any order).
  virtual PostResult post_send(PeerId peer, const void* buf, size_t len, void* desc,
                               OpContext* ctx) = 0;
  // A receive buffer for any peer's SEND; it comes back as kRecv. Receives do not count against
  // caps().max_in_flight.
  virtual PostResult post_recv(void* buf, size_t len, void* desc, OpContext* ctx) = 0;
  // Why the last post returned kFailed.
  virtual const std::string& last_error() const = 0;

  // ---- Completions. The owning thread. ----
  // Progresses the provider (manual progress, held-back work, connection handshakes) and reads
  // up to out.size() completions; returns how many were written. Must not wait for completions
  // (the worker polls in a loop, and may sleep between polls where it is idle).
  virtual size_t poll(std::span<Completion> out) = 0;
};

// A local domain's (cuda_ipc, host_ipc) address is "<host scope>/<endpoint>": two local domains
// reach each other exactly when their host scopes are equal. The host scope of such an address
// (the part before the first '/'). Domains are opened by the factory, providers/open_domain.h.
inline std::string_view local_scope(std::string_view local_address) {
  return local_address.substr(0, local_address.find('/'));
}

}  // namespace fabric
