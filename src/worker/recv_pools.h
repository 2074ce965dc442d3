// RecvPools: a worker's pools of receive buffers for messages (SENDs), registered on the message
// domain and posted as the provider takes them; each message is copied out for its callback and
// its buffer goes straight back to the provider. Worker thread only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

#include "domain/domain.h"
#include "shared_state/callback_thread.h"
#include "worker/domain_group.h"
#include "worker/request.h"

namespace fabric {

class RecvPools {
 public:
  // Messages go to `callbacks`; while its queue is full, to the worker's `overflow` list.
  RecvPools(DomainGroup& domains, CallbackThread& callbacks, std::deque<Event>& overflow)
      : domains_(domains), callbacks_(callbacks), overflow_(overflow) {}

  // A pool of `count` buffers of `len` bytes: registered and posted here (as many as the
  // provider takes now; the rest as it frees room). Throws what registration throws.
  void add(size_t len, size_t count, std::shared_ptr<TransferEngine::RecvCallback> on_recv);
  // Offers the buffers the provider did not take yet again (every loop round, so the check of
  // whether there are any is inline); true if it took any.
  bool post_backlog() { return unposted_ > 0 && post_unposted(); }
  // A message landed in the buffer of `ctx` (a kRecv completion on domain d): copied into a
  // pooled buffer for the pool's callback, and the receive posted again.
  void received(size_t d, OpContext* ctx, size_t len);
  // Posts a receive buffer again (after its message was copied, or after it failed: a failed
  // receive still owns its buffer).
  void repost(size_t d, OpContext* ctx);
  // Deregisters every pool (the worker is closing its domains).
  void close();

 private:
  struct Pool {
    std::vector<uint8_t> buffer;
    size_t len = 0;
    DomainRegion region;
    std::vector<OpContext> contexts;
    size_t next_unposted = 0;  // contexts from here on wait for room in the receive queue
    std::shared_ptr<TransferEngine::RecvCallback> on_recv;
  };
  bool post_unposted();

  DomainGroup& domains_;
  CallbackThread& callbacks_;
  std::deque<Event>& overflow_;
  std::vector<std::unique_ptr<Pool>> pools_;
  size_t unposted_ = 0;  // receive buffers the provider did not take yet
};

}  // namespace fabric
