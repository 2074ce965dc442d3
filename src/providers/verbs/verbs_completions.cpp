#include "providers/verbs/verbs_completions.h"

#include <arpa/inet.h>
#include <fmt/format.h>

#include <algorithm>

#include "providers/verbs/verbs_connections.h"
#include "util/log.h"

namespace fabric::verbs {
namespace {

constexpr uint64_t kImmRecvId = 1;  // wr_id of the zero-length receives (contexts are aligned)

}  // namespace

CompletionReader::CompletionReader(const DeviceContext& dev, const SharedQueues& queues,
                                   RequestPoster& poster, Connections& connections,
                                   CompletionBacklog& backlog)
    : dev_(dev), queues_(queues), poster_(poster), connections_(connections), backlog_(backlog) {
  imm_reposts_ = queues_.sizes.imm_srq;
  repost_imm_recvs();
}

template <size_t (CompletionReader::*on_completion)(const ibv_wc&, Completion&)>
size_t CompletionReader::drain(ibv_cq* cq, std::span<Completion> out, size_t n, size_t limit) {
  ibv_wc wcs[32];
  while (n < limit) {
    int got = ibv_poll_cq(cq, static_cast<int>(std::min<size_t>(std::size(wcs), limit - n)), wcs);
    if (got <= 0) break;
    for (int i = 0; i < got; i++) n += (this->*on_completion)(wcs[i], out[n]);
  }
  return n;
}

size_t CompletionReader::read(std::span<Completion> out) {
  size_t n = 0;
  while (n < out.size() && !backlog_.empty()) {
    out[n++] = std::move(backlog_.front());
    backlog_.pop_front();
  }
  const size_t half = n + (out.size() - n + 1) / 2;
  n = drain<&CompletionReader::on_send_completion>(queues_.send_cq, out, n, half);
  n = drain<&CompletionReader::on_recv_completion>(queues_.recv_cq, out, n, out.size());
  const uint32_t depth = queues_.sizes.imm_srq;  // under a quarter of it still posted:
  if (imm_reposts_ > depth - depth / 4) warn_imm_receives_low();
  n = drain<&CompletionReader::on_send_completion>(queues_.send_cq, out, n, out.size());
  if (imm_reposts_ >= kImmRefill) repost_imm_recvs();
  return n;
}

void CompletionReader::read_out_receives() {
  ibv_wc wcs[32];
  int got;
  while ((got = ibv_poll_cq(queues_.recv_cq, static_cast<int>(std::size(wcs)), wcs)) > 0)
    for (int i = 0; i < got; i++) {
      Completion c;
      if (on_recv_completion(wcs[i], c)) backlog_.push_back(std::move(c));
    }
}

// Fewer than a quarter of the immediate receives still posted: senders are about to meet
// receiver-not-ready and wait min_rnr_timer. Said at most once a second.
void CompletionReader::warn_imm_receives_low() {
  const auto now = std::chrono::steady_clock::now();
  if (now < next_low_warning_) return;
  next_low_warning_ = now + std::chrono::seconds(1);
  log::warn(
      "verbs: only {} of {} immediate receives posted on {} (WRITEs with immediates arrive "
      "faster than this worker polls): raise VerbsConfig::imm_receives (device max {}) or poll "
      "more often",
      queues_.sizes.imm_srq - imm_reposts_, queues_.sizes.imm_srq, dev_.name,
      dev_.dev_attr.max_srq_wr);
}

size_t CompletionReader::on_send_completion(const ibv_wc& wc, Completion& c) {
  auto* ctx = reinterpret_cast<OpContext*>(wc.wr_id);
  if (wc.status == IBV_WC_SUCCESS) return poster_.request_done(ctx, nullptr, c);
  SendQueue& q = *op_state(ctx).queue;
  if (q.error.empty()) {  // the first failure says why; the requests flushed after it repeat it
    q.error = fmt::format("verbs: peer {} on {} failed: {} (vendor error 0x{:x})",
                          q.peer ? q.peer->addr.describe() : "?", dev_.name,
                          ibv_wc_status_str(wc.status), wc.vendor_err);
  }
  if (q.peer) connections_.lose_connection(*q.peer, q.error);  // retires q (valid until drained)
  return poster_.request_done(ctx, &q.error, c);
}

size_t CompletionReader::on_recv_completion(const ibv_wc& wc, Completion& c) {
  if (wc.wr_id == kImmRecvId) {
    imm_reposts_++;
    if (wc.status != IBV_WC_SUCCESS) {
      log::warn("verbs: immediate receive on {} failed: {}", dev_.name,
                ibv_wc_status_str(wc.status));
      return 0;
    }
    c.kind = Completion::Kind::kRemoteImm;
    c.context = nullptr;
    c.imm = ntohl(wc.imm_data);
    c.error.clear();
    return 1;
  }
  c.context = reinterpret_cast<OpContext*>(wc.wr_id);
  c.error.clear();
  if (wc.status == IBV_WC_SUCCESS) {
    c.kind = Completion::Kind::kRecv;
    c.len = wc.byte_len;
  } else {
    c.kind = Completion::Kind::kError;
    c.error =
        fmt::format("verbs: receive on {} failed: {}", dev_.name, ibv_wc_status_str(wc.status));
  }
  return 1;
}

void CompletionReader::repost_imm_recvs() {
  ibv_recv_wr wrs[64];
  while (imm_reposts_ > 0) {
    uint32_t n = std::min<uint32_t>(imm_reposts_, std::size(wrs));
    for (uint32_t i = 0; i < n; i++) {
      wrs[i] = {};
      wrs[i].wr_id = kImmRecvId;
      wrs[i].num_sge = 0;  // WRITE_WITH_IMM carries no payload into the receive
      wrs[i].next = i + 1 < n ? &wrs[i + 1] : nullptr;
    }
    ibv_recv_wr* bad = nullptr;
    if (int rc = ibv_post_srq_recv(queues_.imm_srq, wrs, &bad)) {
      log::error("verbs: refilling immediate receives on {} failed: {}", dev_.name, errno_text(rc));
      return;
    }
    imm_reposts_ -= n;
  }
}

}  // namespace fabric::verbs
