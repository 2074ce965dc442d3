// The peers of a verbs domain and their connections: the peer table, and per peer two RC queue
// pairs (one for SEND/RECV, one for WRITEs, so that immediates, which consume a receive on the
// target, never take the application's message buffers) connected by the handshake over UD.
//
// Connections come and go: an error completion (a transient fault that outlasted the RC retries,
// a bad remote key) leaves a queue pair in the error state for good, so the peer's two queue
// pairs are retired (RequestPoster::retire) and the next post to that peer connects new ones
// under a higher epoch; the peer sees the epoch and replaces its own. remove_peer retires them
// the same way.
#pragma once

#include <infiniband/verbs.h>

#include <cstdint>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "domain/domain.h"
#include "providers/verbs/handshake.h"
#include "providers/verbs/verbs_handshake_channel.h"
#include "providers/verbs/verbs_posting.h"
#include "providers/verbs/verbs_queues.h"
#include "providers/verbs/verbs_wire.h"
#include "util/slot_map.h"

namespace fabric::verbs {

// kDown: no queue pairs (never connected, or lost); the next post connects.
// kConnecting: queue pairs made, handshake under way. kReady: writes may go.
// kFailed: the last handshake went unanswered; posts fail at once until retry_at, then connect.
enum class PeerState { kDown, kConnecting, kReady, kFailed };

struct Peer {
  Peer(Handshake::Clock::time_point now, Handshake::Timing t) : hs(now, t) {}
  VerbsAddress addr;
  std::string key;  // the address bytes (Connections::peer_ids_)
  PeerId id = 0;
  ibv_ah* ah = nullptr;                   // towards the peer's handshake QP
  std::unique_ptr<SendQueue> msg, write;  // both or neither
  uint32_t remote_msg_qpn = 0, remote_write_qpn = 0;
  uint32_t epoch = 0;  // of the current (or last) connection; 0: none yet
  uint32_t connections = 0;
  Handshake hs;
  PeerState state = PeerState::kDown;
  bool handshaking = false;  // listed in Connections::handshaking_
  std::string error;         // why it failed (kFailed) or was lost (kDown)
  Handshake::Clock::time_point retry_at{};
};

class Connections {
 public:
  // Opens the handshake channel and picks this incarnation's nonce. `dev`, `queues` and `poster`
  // outlive this object. Throws fabric::Error.
  Connections(const VerbsConfig& cfg, const DeviceContext& dev, SharedQueues& queues,
              RequestPoster& poster);
  ~Connections();  // destroys every peer's queue pairs and address handle
  Connections(const Connections&) = delete;
  Connections& operator=(const Connections&) = delete;

  // Where peers reach this domain's handshake.
  const VerbsAddress& me() const { return me_; }

  // Domain::insert_peer: cached by address; the connection is made by the first post to the
  // peer, or by its first message.
  PeerId insert_peer(const std::string& address);
  // Domain::remove_peer: its queue pairs are retired (what is posted on them fails, once each,
  // through poll()); the slot is reused with a new generation, so the old id stays unknown.
  void remove_peer(PeerId id);
  Peer* find(PeerId id);  // null: not known (removed?)

  // kPosted when `p` (find(id)) can take a request now, else why not, with `error` set for
  // kFailed. A lost connection is re-made here, at the first post after it: the post waits
  // (kRetryPeer) for the handshake.
  PostResult check_peer(Peer* p, PeerId id, std::string& error);
  // A request on one of the peer's current queue pairs failed: that queue pair is in the error
  // state for good, so both are retired and the next post connects anew.
  void lose_connection(Peer& p, const std::string& why);

  // poll(): reads the handshake messages that arrived, sends the retransmissions that are due
  // and fails the handshakes that timed out.
  void progress_handshakes();

 private:
  Peer& add_peer(const VerbsAddress& a, const std::string& key);
  std::unique_ptr<SendQueue> new_queue(Peer& p, ibv_srq* srq, int remote_access);
  void begin_connection(Peer& p, uint32_t epoch, Handshake::Clock::time_point now);
  void drop_connection(Peer& p, const std::string& why);
  void fail_connection(Peer& p, const std::string& why);
  void unlist_handshake(Peer& p);
  void on_handshake(std::span<const uint8_t> bytes);
  void connect(SendQueue& q, uint32_t remote_qpn, uint32_t remote_psn, ibv_mtu mtu,
               const VerbsAddress& to);
  void log_connected(SendQueue& q);
  void send_handshake(Peer& p, Handshake::Clock::time_point now);

  const VerbsConfig cfg_;
  const DeviceContext& dev_;
  SharedQueues& queues_;
  RequestPoster& poster_;
  Handshake::Timing timing_;
  HandshakeChannel channel_;
  std::mt19937_64 rng_;  // nonce and first packet sequence numbers
  VerbsAddress me_;
  uint32_t polls_ = 0;

  struct PeerSlot {
    uint32_t generation = 0;     // of the PeerId that names it now
    std::unique_ptr<Peer> peer;  // null: free
  };
  util::SlotMap<PeerSlot> slots_;  // by the slot of a PeerId
  size_t peer_count_ = 0;
  std::unordered_map<std::string, PeerId> peer_ids_;
  std::vector<Peer*> handshaking_;
};

}  // namespace fabric::verbs
