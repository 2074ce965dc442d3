#include "providers/verbs/verbs_handshake_channel.h"

#include <cstring>

#include "util/log.h"

namespace fabric::verbs {
namespace {

constexpr uint32_t kQkey = 0x0FAB1C00;  // UD queue key (high bit clear: unprivileged)
constexpr uint32_t kRecvs = 256;        // receive buffers
constexpr uint32_t kSends = 64;         // send buffers
constexpr size_t kGrh = 40;             // UD receives start with room for the global route header
constexpr size_t kSlot = 128;           // >= HandshakeMsg::kSize
constexpr uint64_t kSendTag = 1ull << 32;  // in a send's wr_id, beside its slot

static_assert(HandshakeMsg::kSize <= kSlot);

}  // namespace

HandshakeChannel::HandshakeChannel(const DeviceContext& dev, uint32_t drop_sends)
    : dev_(dev), drops_left_(drop_sends) {
  cq_ = check_ptr(ibv_create_cq(dev_.ctx, kRecvs + kSends, nullptr, nullptr, 0),
                  "ibv_create_cq(ud)", dev_.name);
  buf_.resize((kRecvs + kSends) * (kGrh + kSlot));
  mr_ = check_ptr(ibv_reg_mr(dev_.pd, buf_.data(), buf_.size(), IBV_ACCESS_LOCAL_WRITE),
                  "ibv_reg_mr(ud)", dev_.name);
  ibv_qp_init_attr a{};
  a.send_cq = cq_;
  a.recv_cq = cq_;
  a.qp_type = IBV_QPT_UD;
  a.cap.max_send_wr = kSends;
  a.cap.max_recv_wr = kRecvs;
  a.cap.max_send_sge = a.cap.max_recv_sge = 1;
  qp_ = check_ptr(ibv_create_qp(dev_.pd, &a), "ibv_create_qp(UD)", dev_.name);
  ibv_qp_attr m{};
  m.qp_state = IBV_QPS_INIT;
  m.port_num = dev_.port;
  m.qkey = kQkey;
  int rc = ibv_modify_qp(qp_, &m, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY);
  m = {};
  m.qp_state = IBV_QPS_RTR;
  if (!rc) rc = ibv_modify_qp(qp_, &m, IBV_QP_STATE);
  m.qp_state = IBV_QPS_RTS;
  m.sq_psn = 0;
  if (!rc) rc = ibv_modify_qp(qp_, &m, IBV_QP_STATE | IBV_QP_SQ_PSN);
  if (rc) fail("ibv_modify_qp(UD)", rc, dev_.name);
  for (uint32_t i = 0; i < kRecvs; i++) post_recv(i);
  for (uint32_t i = 0; i < kSends; i++) free_sends_.push_back(i);
}

HandshakeChannel::~HandshakeChannel() {
  ibv_destroy_qp(qp_);
  ibv_dereg_mr(mr_);
  ibv_destroy_cq(cq_);
}

uint8_t* HandshakeChannel::slot(uint32_t i) { return buf_.data() + i * (kGrh + kSlot); }

void HandshakeChannel::post_recv(uint32_t i) {
  ibv_sge sge{reinterpret_cast<uint64_t>(slot(i)), kGrh + kSlot, mr_->lkey};
  ibv_recv_wr wr{};
  wr.wr_id = i;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  ibv_recv_wr* bad = nullptr;
  if (int rc = ibv_post_recv(qp_, &wr, &bad))
    log::error("verbs: handshake receive lost: {}", errno_text(rc));
}

void HandshakeChannel::receive(const std::function<void(std::span<const uint8_t>)>& on_message) {
  ibv_wc wcs[16];
  int got = ibv_poll_cq(cq_, static_cast<int>(std::size(wcs)), wcs);
  for (int i = 0; i < got; i++) {
    const ibv_wc& wc = wcs[i];
    if (wc.wr_id & kSendTag) {
      free_sends_.push_back(static_cast<uint32_t>(wc.wr_id & 0xFFFFFFFF));
      continue;
    }
    auto recv_slot = static_cast<uint32_t>(wc.wr_id);
    if (wc.status == IBV_WC_SUCCESS && wc.byte_len > kGrh)
      on_message(std::span<const uint8_t>(slot(recv_slot) + kGrh, wc.byte_len - kGrh));
    post_recv(recv_slot);
  }
}

void HandshakeChannel::send(const HandshakeMsg& m, ibv_ah* ah, uint32_t remote_qpn) {
  if (drops_left_ > 0) {
    drops_left_--;
    return;
  }
  if (free_sends_.empty()) return;
  uint32_t send_slot = free_sends_.back();
  std::vector<uint8_t> bytes = m.to_bytes();
  uint8_t* buf = slot(kRecvs + send_slot);
  std::memcpy(buf, bytes.data(), bytes.size());
  ibv_sge sge{reinterpret_cast<uint64_t>(buf), static_cast<uint32_t>(bytes.size()), mr_->lkey};
  ibv_send_wr wr{};
  wr.wr_id = kSendTag | send_slot;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_SEND;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.wr.ud.ah = ah;
  wr.wr.ud.remote_qpn = remote_qpn;
  wr.wr.ud.remote_qkey = kQkey;
  ibv_send_wr* bad = nullptr;
  if (int rc = ibv_post_send(qp_, &wr, &bad)) {
    log::warn("verbs: handshake send on {} failed: {}", dev_.name, errno_text(rc));
    return;
  }
  free_sends_.pop_back();
}

}  // namespace fabric::verbs
