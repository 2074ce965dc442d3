// RecvPools (recv_pools.h): receive buffers posted, re-posted and copied out for their callbacks.
#include "worker/recv_pools.h"

#include "util/log.h"
#include "worker/transfer.h"

namespace fabric {

void RecvPools::add(size_t len, size_t count,
                    std::shared_ptr<TransferEngine::RecvCallback> on_recv) {
  auto pool = std::make_unique<Pool>();
  pool->len = len;
  pool->buffer.resize(len * count);  // the engine checked len * count for overflow
  pool->on_recv = std::move(on_recv);
  pool->region = domains_.register_on(DomainGroup::kMessageDomain, pool->buffer.data(),
                                      pool->buffer.size(), Device::host());
  pool->contexts.resize(count);
  for (size_t i = 0; i < count; i++) {
    OpContext& ctx = pool->contexts[i];
    ctx.owner = pool.get();
    ctx.kind = kOpRecv;
    ctx.aux = i;
  }
  unposted_ += count;
  callbacks_.prepare_buffers(count, len);  // one copy per buffer can be queued without allocating
  pools_.push_back(std::move(pool));
  post_backlog();  // what the provider takes now; the rest as it frees room
}

// Receive buffers the provider did not take when their pool was added (its receive queue was
// full): offered again every round until taken.
bool RecvPools::post_unposted() {
  bool any = false;
  for (auto& pool : pools_) {
    while (pool->next_unposted < pool->contexts.size()) {
      OpContext& ctx = pool->contexts[pool->next_unposted];
      PostResult res =
          domains_.post_recv(DomainGroup::kMessageDomain, pool->buffer.data() + ctx.aux * pool->len,
                             pool->len, pool->region.desc, &ctx);
      if (res == PostResult::kRetry || res == PostResult::kRetryPeer) return any;
      if (res == PostResult::kFailed)
        log::error("posting receive buffer {} failed: {}", ctx.aux,
                   domains_.last_error(DomainGroup::kMessageDomain));
      pool->next_unposted++;
      unposted_--;
      any = true;
    }
  }
  return any;
}

void RecvPools::received(size_t d, OpContext* ctx, size_t len) {
  auto* pool = static_cast<Pool*>(ctx->owner);
  uint8_t* buf = pool->buffer.data() + ctx->aux * pool->len;
  Event e;
  e.on_recv = pool->on_recv;
  e.data = callbacks_.take_buffer();
  e.data->assign(reinterpret_cast<std::byte*>(buf), reinterpret_cast<std::byte*>(buf) + len);
  callbacks_.push(std::move(e), overflow_);
  repost(d, ctx);  // the bytes were copied: the buffer goes straight back
}

void RecvPools::repost(size_t d, OpContext* ctx) {
  auto* pool = static_cast<Pool*>(ctx->owner);
  uint8_t* buf = pool->buffer.data() + ctx->aux * pool->len;
  if (domains_.post_recv(d, buf, pool->len, pool->region.desc, ctx) != PostResult::kPosted)
    log::error("re-posting a receive buffer failed: {}", domains_.last_error(d));
}

void RecvPools::close() {
  for (auto& pool : pools_) domains_.deregister_on(DomainGroup::kMessageDomain, pool->region);
}

}  // namespace fabric
