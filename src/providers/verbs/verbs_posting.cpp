#include "providers/verbs/verbs_posting.h"

#include <arpa/inet.h>
#include <fmt/format.h>

#include <algorithm>
#include <cerrno>

#include "util/log.h"

namespace fabric::verbs {
namespace {

uint32_t lkey_of(void* desc) { return desc ? static_cast<ibv_mr*>(desc)->lkey : 0; }

// Work requests a WRITE of `len` bytes takes, each at most `max_message` long.
uint64_t requests_of(uint64_t len, uint64_t max_message) {
  return len <= max_message ? 1 : (len + max_message - 1) / max_message;
}

}  // namespace

RequestPoster::RequestPoster(const DeviceContext& dev, const SharedQueues& queues,
                             CompletionBacklog& backlog, PeerLost peer_lost)
    : dev_(dev), queues_(queues), backlog_(backlog), peer_lost_(std::move(peer_lost)) {}

RequestPoster::~RequestPoster() {
  for (auto& q : retired_) ibv_destroy_qp(q->qp);
}

PostResult RequestPoster::check_write(uint64_t len, std::string& error) const {
  uint64_t requests = requests_of(len, queues_.sizes.max_message);
  if (requests <= queues_.sizes.qp_depth) return PostResult::kPosted;
  error = fmt::format(
      "verbs: a WRITE of {} bytes needs {} requests of at most {} bytes, more than "
      "the queue pair holds ({})",
      len, requests, queues_.sizes.max_message, queues_.sizes.qp_depth);
  return PostResult::kFailed;
}

PostResult RequestPoster::check_send(uint64_t len, std::string& error) const {
  if (len <= queues_.sizes.max_message) return PostResult::kPosted;
  error = fmt::format("verbs: a SEND of {} bytes exceeds the port's largest message ({})", len,
                      queues_.sizes.max_message);
  return PostResult::kFailed;
}

PostResult RequestPoster::write(SendQueue& q, const WriteOp& op, OpContext* ctx) {
  const uint64_t max = queues_.sizes.max_message;
  uint64_t requests = requests_of(op.len, max);
  if (PostResult r = room(q, requests); r != PostResult::kPosted) return r;
  op_state(ctx) = OpState{requests, &q, 0};
  for (uint64_t i = 0; i < requests; i++) {
    uint64_t off = i * max;
    uint64_t len = std::min<uint64_t>(op.len - off, max);
    bool last = i + 1 == requests;
    ibv_send_wr& wr =
        next_request(q, ctx, static_cast<const uint8_t*>(op.src) + off, len, lkey_of(op.desc));
    wr.opcode = last && op.has_imm ? IBV_WR_RDMA_WRITE_WITH_IMM : IBV_WR_RDMA_WRITE;
    wr.imm_data = htonl(op.imm);
    wr.wr.rdma.remote_addr = op.remote_addr + off;
    wr.wr.rdma.rkey = static_cast<uint32_t>(op.rkey);
    commit_request(q);
  }
  return PostResult::kPosted;
}

PostResult RequestPoster::send(SendQueue& q, const void* buf, size_t len, void* desc,
                               OpContext* ctx) {
  if (PostResult r = room(q, 1); r != PostResult::kPosted) return r;
  op_state(ctx) = OpState{1, &q, 0};
  ibv_send_wr& wr = next_request(q, ctx, buf, len, lkey_of(desc));
  wr.opcode = IBV_WR_SEND;
  commit_request(q);
  return PostResult::kPosted;
}

PostResult RequestPoster::recv(void* buf, size_t len, void* desc, OpContext* ctx,
                               std::string& error) {
  ibv_sge sge{reinterpret_cast<uint64_t>(buf), static_cast<uint32_t>(len), lkey_of(desc)};
  ibv_recv_wr wr{};
  wr.wr_id = reinterpret_cast<uint64_t>(ctx);
  wr.sg_list = &sge;
  wr.num_sge = 1;
  ibv_recv_wr* bad = nullptr;
  int rc = ibv_post_srq_recv(queues_.msg_srq, &wr, &bad);
  if (rc == 0) return PostResult::kPosted;
  if (rc == ENOMEM) return PostResult::kRetry;
  error = fmt::format("verbs: ibv_post_srq_recv on {} failed: {}", dev_.name, errno_text(rc));
  return PostResult::kFailed;
}

// The send CQ is the domain's (kRetry when full), the queue pair the peer's (kRetryPeer).
PostResult RequestPoster::room(const SendQueue& q, uint64_t requests) const {
  if (send_outstanding_ + requests > queues_.sizes.send_cq) return PostResult::kRetry;
  if (q.outstanding + requests > q.depth) return PostResult::kRetryPeer;
  return PostResult::kPosted;
}

ibv_send_wr& RequestPoster::next_request(SendQueue& q, OpContext* ctx, const void* src,
                                         uint64_t len, uint32_t lkey) {
  if (q.chained == kChain) flush(q);
  uint32_t i = q.chained;
  ibv_sge& sge = q.sge[i];
  sge = {reinterpret_cast<uint64_t>(src), static_cast<uint32_t>(len), lkey};
  ibv_send_wr& wr = q.wr[i];
  wr = {};
  wr.wr_id = reinterpret_cast<uint64_t>(ctx);
  wr.sg_list = &sge;
  wr.num_sge = len ? 1 : 0;
  wr.send_flags =
      IBV_SEND_SIGNALED | (len > 0 && len <= queues_.max_inline() ? IBV_SEND_INLINE : 0);
  return wr;
}

void RequestPoster::commit_request(SendQueue& q) {
  q.chained++;
  q.outstanding++;
  send_outstanding_++;
  if (!q.dirty) {
    q.dirty = true;
    dirty_.push_back(&q);
  }
}

void RequestPoster::flush_chains() {
  for (SendQueue* q : dirty_) flush(*q);
  dirty_.clear();
}

void RequestPoster::flush(SendQueue& q) {
  q.dirty = false;  // (flush_chains clears dirty_ after flushing every listed queue)
  if (q.chained == 0) return;
  for (uint32_t i = 0; i + 1 < q.chained; i++) q.wr[i].next = &q.wr[i + 1];
  q.wr[q.chained - 1].next = nullptr;
  ibv_send_wr* bad = nullptr;
  int rc = ibv_post_send(q.qp, q.wr, &bad);
  if (rc) {  // requests from `bad` on never reached the NIC: they fail here, once each
    std::string why =
        fmt::format("verbs: ibv_post_send on {} failed: {}", dev_.name, errno_text(rc));
    for (ibv_send_wr* w = bad; w; w = w->next) fail_unposted(w->wr_id, why);
    q.chained = 0;
    if (q.peer) peer_lost_(*q.peer, why);  // the queue pair is unusable (error state?)
    return;
  }
  q.chained = 0;
}

bool RequestPoster::request_done(OpContext* ctx, const std::string* error, Completion& c) {
  OpState& s = op_state(ctx);
  s.queue->outstanding--;
  send_outstanding_--;
  if (error) {
    if (!s.failed) op_errors_[ctx] = *error;
    s.failed = 1;
  }
  if (--s.requests_left > 0) return false;
  c.context = ctx;
  c.error.clear();
  if (s.failed) {
    c.kind = Completion::Kind::kError;
    auto it = op_errors_.find(ctx);
    c.error = std::move(it->second);
    op_errors_.erase(it);
  } else {
    c.kind = Completion::Kind::kLocal;
  }
  return true;
}

void RequestPoster::fail_unposted(uint64_t wr_id, const std::string& why) {
  Completion c;
  if (request_done(reinterpret_cast<OpContext*>(wr_id), &why, c)) backlog_.push_back(std::move(c));
}

void RequestPoster::retire(std::unique_ptr<SendQueue> q, const std::string& why) {
  if (!q) return;
  if (q->error.empty()) q->error = why;
  q->peer = nullptr;
  // Chained requests never reached the NIC: they fail here.
  for (uint32_t i = 0; i < q->chained; i++) fail_unposted(q->wr[i].wr_id, q->error);
  q->chained = 0;
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_ERR;  // the NIC flushes what it holds: each request completes with an error
  if (int rc = ibv_modify_qp(q->qp, &a, IBV_QP_STATE))
    log::warn("verbs: moving a queue pair of {} to the error state failed: {}", dev_.name,
              errno_text(rc));
  retired_.push_back(std::move(q));
}

bool RequestPoster::has_idle_retired() const {
  return std::any_of(retired_.begin(), retired_.end(),
                     [](const auto& q) { return q->outstanding == 0; });
}

void RequestPoster::destroy_idle_retired() {
  for (size_t i = 0; i < retired_.size();) {
    SendQueue& q = *retired_[i];
    if (q.outstanding > 0) {
      i++;
      continue;
    }
    if (int rc = ibv_destroy_qp(q.qp))
      log::warn("verbs: ibv_destroy_qp on {} failed: {}", dev_.name, errno_text(rc));
    std::erase(dirty_, &q);
    retired_[i] = std::move(retired_.back());
    retired_.pop_back();
  }
}

}  // namespace fabric::verbs
