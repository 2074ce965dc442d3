// The sending side of a shm domain: every WRITE and SEND goes through an endpoint of its own,
// which is replaced when a dead peer blocks it, so that an engine outlives a killed neighbour.
//
// Why: libfabric 1.17's shm completes an endpoint's sends in posting order (each takes a slot
// of the endpoint's response queue, read from its head). A WRITE larger than shm's inject size
// completes when the peer writes its response; a peer killed before it does holds the head for
// ever, and every later completion of that endpoint waits behind it: WRITEs to live peers and to
// ourselves are accepted and never complete. The published endpoint (the address peers write to)
// cannot be replaced without changing the engine's address, so it only receives, and sends go
// through a private endpoint that can be.
//
// Dead peers: a peer killed while it processed commands keeps its region's lock for ever, and
// a post to it would spin inside libfabric. A ProcessWatch learns of a peer's exit from its pidfd
// (the pid is in the endpoint name, shm_names.h) and posts to it are refused from then on. The
// window left is the kernel's own exit processing, before the pidfd says so: a post in it still
// spins, and EngineConfig::worker_stall_timeout is the backstop.
//
// Recovery: when nothing has completed for kStallCheck while WRITEs are outstanding, the peers
// they wait for are checked; if one is gone,
// a fresh sending endpoint takes all new posts, posts to the dead peer are refused, and the old
// endpoint is closed kRetireGrace later. What it still held then can never complete: each
// operation comes back once as an error completion (peer_lost for the dead peer's).
#pragma once

#include <rdma/fabric.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "domain/domain.h"
#include "providers/libfabric/shm_key_board.h"
#include "util/process_watch.h"

namespace fabric {

class ShmSenders {
 public:
  static constexpr std::chrono::milliseconds kStallCheck{10};
  static constexpr std::chrono::milliseconds kRetireGrace{200};

  // The domain's handles; they outlive this object. `info` is the main endpoint's.
  ShmSenders(fid_domain* domain, fid_cq* cq, const fi_info* info);
  ~ShmSenders();
  ShmSenders(const ShmSenders&) = delete;
  ShmSenders& operator=(const ShmSenders&) = delete;

  // Cached per address. Throws kProvider when the address names a process that is gone.
  PeerId insert_peer(const std::string& address);
  void remove_peer(PeerId peer);

  // Post through the current sending endpoint. kFailed with `error` set: refused (a dead peer)
  // or the provider's failure; -FI_EAGAIN comes back as kRetry.
  PostResult write(const WriteOp& op, OpContext* ctx, std::string& error);
  PostResult send(PeerId peer, const void* buf, size_t len, void* desc, OpContext* ctx,
                  std::string& error);

  // A completion (success or error) for `ctx` was read from the CQ. False: not one of ours
  // (a receive), nothing done.
  bool completed(OpContext* ctx);

  // Once per poll, before the CQ is read: stall detection, replacement, closing retired
  // endpoints. Writes the error completions of operations a closed endpoint still held into
  // `out`; returns how many.
  size_t maintain(std::span<Completion> out);
  // The CQ read empty: no completion of a closed endpoint can still be in it, so what those
  // endpoints held is lost for good (reported by the next maintain()).
  void cq_drained();

  // For tests and logs.
  uint64_t replacements() const { return replacements_; }

 private:
  struct Endpoint;
  struct Peer {
    std::string address;
    int pid = 0;        // 0: unknown (another PID namespace, a name not ours): taken as alive
    bool dead = false;  // seen gone: posts refused
    bool removed = false;
    uint32_t ops = 0;   // outstanding on any endpoint; the slot is reused once removed and 0
    // Its live keys (shm_key_board.h); null where it offers none we can open: posted unchecked.
    std::unique_ptr<ShmKeyBoard> keys;
  };

  std::unique_ptr<Endpoint> open_endpoint();
  void close_endpoint(Endpoint& e);
  fi_addr_t address_in(Endpoint& e, PeerId peer);
  bool check_peers(Endpoint& e);  // marks dead peers among those e waits for; true if any
  bool gone(PeerId peer);         // dead, marking it so if the watch saw it exit
  void replace_current(std::chrono::steady_clock::time_point now);
  void track(Endpoint& e, OpContext* ctx, PeerId peer);
  void untrack(OpContext* ctx);
  void maybe_free(PeerId peer);

  std::unique_ptr<util::ProcessWatch> watch_;  // null where it could not start
  fid_domain* domain_;
  fid_cq* cq_;
  fi_info* info_;  // a copy with a small receive queue: nobody sends to these endpoints
  std::unique_ptr<Endpoint> current_;
  std::vector<std::unique_ptr<Endpoint>> retired_;
  std::vector<Peer> peers_;
  std::vector<PeerId> free_peers_;
  std::unordered_map<std::string, PeerId> by_address_;
  std::vector<Completion> lost_;  // error completions not yet handed to poll()
  uint64_t polls_ = 0;
  uint64_t seen_completions_ = 0;
  std::chrono::steady_clock::time_point last_progress_{};
  std::chrono::steady_clock::time_point last_check_{};
  uint64_t replacements_ = 0;
  std::string dead_names_;  // for the lost operations' message
};

// False when the process is gone or a zombie; true for pid 0 (unknown).
bool shm_process_alive(int pid);
// Whether the /dev/shm file of a peer's endpoint address is there (its engine has not closed it).
bool shm_endpoint_exists(const std::string& address);

}  // namespace fabric
