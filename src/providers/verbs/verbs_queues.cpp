#include "providers/verbs/verbs_queues.h"

#include <algorithm>

namespace fabric::verbs {
namespace {

constexpr uint32_t kMaxInline = 64;  // asked for; the device may give less, or none

ibv_cq* create_cq(const DeviceContext& dev, uint32_t depth, const char* call) {
  return check_ptr(ibv_create_cq(dev.ctx, static_cast<int>(depth), nullptr, nullptr, 0), call,
                   dev.name);
}

ibv_srq* create_srq(const DeviceContext& dev, uint32_t depth) {
  ibv_srq_init_attr a{};
  a.attr.max_wr = depth;
  a.attr.max_sge = 1;
  return check_ptr(ibv_create_srq(dev.pd, &a), "ibv_create_srq", dev.name);
}

}  // namespace

QueueSizes QueueSizes::for_device(const DeviceContext& dev, uint32_t imm_receives) {
  const ibv_device_attr& da = dev.dev_attr;
  QueueSizes s;
  s.max_message = std::max<uint64_t>(dev.port_attr.max_msg_sz, 4096);
  s.qp_depth = static_cast<uint32_t>(std::min<int>(da.max_qp_wr, 1024));
  s.msg_srq = static_cast<uint32_t>(std::min<int>(da.max_srq_wr, 8192));
  s.imm_srq =
      imm_receives ? imm_receives : static_cast<uint32_t>(std::min<int>(da.max_srq_wr, 16384));
  s.send_cq = static_cast<uint32_t>(std::min<int>(da.max_cqe, 8192));
  s.recv_cq = static_cast<uint32_t>(std::min<int>(da.max_cqe, s.msg_srq + s.imm_srq));
  if (s.recv_cq < s.msg_srq + s.imm_srq) {
    s.msg_srq = s.recv_cq / 2;
    s.imm_srq = s.recv_cq - s.msg_srq;
  }
  return s;
}

SharedQueues::SharedQueues(const DeviceContext& dev, const QueueSizes& queue_sizes)
    : sizes(queue_sizes),
      send_cq(create_cq(dev, sizes.send_cq, "ibv_create_cq(send)")),
      recv_cq(create_cq(dev, sizes.recv_cq, "ibv_create_cq(recv)")),
      msg_srq(create_srq(dev, sizes.msg_srq)),
      imm_srq(create_srq(dev, sizes.imm_srq)),
      dev_(dev) {
  ibv_destroy_qp(create_rc_qp(msg_srq, 0));  // sets max_inline_: caps() is known before a peer
}

SharedQueues::~SharedQueues() {
  ibv_destroy_srq(msg_srq);
  ibv_destroy_srq(imm_srq);
  ibv_destroy_cq(send_cq);
  ibv_destroy_cq(recv_cq);
}

ibv_qp* SharedQueues::create_rc_qp(ibv_srq* srq, int remote_access) {
  ibv_qp_init_attr a{};
  a.send_cq = send_cq;
  a.recv_cq = recv_cq;
  a.srq = srq;
  a.qp_type = IBV_QPT_RC;
  a.cap.max_send_wr = sizes.qp_depth;
  a.cap.max_send_sge = 1;
  a.cap.max_inline_data = kMaxInline;
  ibv_qp* qp = ibv_create_qp(dev_.pd, &a);
  if (!qp) {  // some devices have no inline data: ask again without
    a.cap.max_inline_data = 0;
    qp = check_ptr(ibv_create_qp(dev_.pd, &a), "ibv_create_qp(RC)", dev_.name);
  }
  max_inline_ = a.cap.max_inline_data;
  ibv_qp_attr m{};
  m.qp_state = IBV_QPS_INIT;
  m.port_num = dev_.port;
  m.qp_access_flags = static_cast<unsigned>(remote_access);
  if (int rc = ibv_modify_qp(
          qp, &m, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS)) {
    ibv_destroy_qp(qp);
    fail("ibv_modify_qp(RC INIT)", rc, dev_.name);
  }
  return qp;
}

}  // namespace fabric::verbs
