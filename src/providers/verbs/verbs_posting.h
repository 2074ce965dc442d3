// Posting on a verbs domain: work requests built into a per-queue-pair chain and handed to the NIC
// four at a time, or at the next poll(), so that one doorbell carries several; the requests in
// flight counted against the send CQ and each queue pair; the queue pairs a lost connection
// retired, kept until their last request is back.
#pragma once

#include <infiniband/verbs.h>

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "domain/domain.h"
#include "providers/verbs/verbs_queues.h"

namespace fabric::verbs {

constexpr uint32_t kChain = 4;  // work requests per doorbell

struct Peer;  // verbs_connections.h

// The send side of one RC queue pair, with its chain of requests not yet handed to the NIC. Owned
// by its peer while in use, then by the RequestPoster's retired list until its last request is
// back.
struct SendQueue {
  ibv_qp* qp = nullptr;
  Peer* peer = nullptr;  // null once retired
  uint32_t psn = 0;
  uint32_t depth = 0;        // max_send_wr
  uint32_t outstanding = 0;  // posted or chained, not completed
  uint32_t chained = 0;
  bool dirty = false;  // listed for flushing at the next poll
  std::string error;   // set when it failed or was retired: its remaining requests fail with it
  ibv_send_wr wr[kChain]{};
  ibv_sge sge[kChain]{};
};

// What an OpContext carries while its requests are out (provider_space).
struct OpState {
  uint64_t requests_left;
  SendQueue* queue;
  uint64_t failed;  // 1 once a request of it failed
};
static_assert(sizeof(OpState) <= sizeof(OpContext::provider_space));
inline OpState& op_state(OpContext* ctx) {
  return *reinterpret_cast<OpState*>(ctx->provider_space);
}

// Completions made without the CQ (requests that never reached the NIC; receives read out before
// a retired queue pair is destroyed), handed out first by the next poll().
using CompletionBacklog = std::deque<Completion>;

class RequestPoster {
 public:
  // Told when a post to a peer's queue pair is refused: the queue pair is unusable, so the
  // peer's connection is lost (Connections::lose_connection, which sits above this class).
  using PeerLost = std::function<void(Peer&, const std::string& why)>;

  // `queues`, `backlog` and `dev` outlive this object.
  RequestPoster(const DeviceContext& dev, const SharedQueues& queues, CompletionBacklog& backlog,
                PeerLost peer_lost);
  ~RequestPoster();  // destroys the retired queue pairs
  RequestPoster(const RequestPoster&) = delete;
  RequestPoster& operator=(const RequestPoster&) = delete;

  // kPosted where a WRITE (SEND) of `len` bytes fits a queue pair, else kFailed with `error` set.
  PostResult check_write(uint64_t len, std::string& error) const;
  PostResult check_send(uint64_t len, std::string& error) const;
  // Chained on `q` (a connected queue pair of the peer), cut into requests of at most the
  // largest message; `ctx` completes once, when the last of them has. kRetry / kRetryPeer where
  // the send CQ / the queue pair has no room.
  PostResult write(SendQueue& q, const WriteOp& op, OpContext* ctx);
  PostResult send(SendQueue& q, const void* buf, size_t len, void* desc, OpContext* ctx);
  // A receive buffer on the message SRQ, for any peer's SEND.
  PostResult recv(void* buf, size_t len, void* desc, OpContext* ctx, std::string& error);

  // Every queue pair's chain to the NIC (poll()).
  void flush_chains();
  // One request of an operation ended (`error`: how it failed, else null); true, and `c`
  // filled, when it was the operation's last.
  bool request_done(OpContext* ctx, const std::string* error, Completion& c);

  // Takes a queue pair off its peer: its chained requests fail here, and the error state makes
  // the NIC flush every request it holds, each failing once with `why`. Null: nothing.
  void retire(std::unique_ptr<SendQueue> q, const std::string& why);
  // Some retired queue pair has all its requests back: destroy_idle_retired() may run, once the
  // receive CQ is read out (some providers, mlx5, drop a destroyed queue pair's entries from
  // it, and an immediate that arrived on it must still be counted).
  bool has_idle_retired() const;
  void destroy_idle_retired();

 private:
  PostResult room(const SendQueue& q, uint64_t requests) const;
  ibv_send_wr& next_request(SendQueue& q, OpContext* ctx, const void* src, uint64_t len,
                            uint32_t lkey);
  void commit_request(SendQueue& q);
  void flush(SendQueue& q);
  // A request (its wr_id) that never reached the NIC fails here, through the backlog.
  void fail_unposted(uint64_t wr_id, const std::string& why);

  const DeviceContext& dev_;
  const SharedQueues& queues_;
  CompletionBacklog& backlog_;
  PeerLost peer_lost_;
  uint32_t send_outstanding_ = 0;                    // requests on the send CQ, posted or chained
  std::vector<SendQueue*> dirty_;                    // chains to flush at the next poll
  std::vector<std::unique_ptr<SendQueue>> retired_;  // error state, waiting for their requests
  std::unordered_map<OpContext*, std::string> op_errors_;  // the first error of a failed op
};

}  // namespace fabric::verbs
