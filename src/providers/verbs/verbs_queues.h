// The queues every RC queue pair of one verbs domain shares: one send CQ, one receive CQ and two
// shared receive queues, sized once from the device's limits, and the factory of RC queue pairs
// on them. Sharing them bounds the CQs by the domain's limits, never by its number of peers.
#pragma once

#include <infiniband/verbs.h>

#include <cstdint>

#include "providers/verbs/verbs_device.h"

namespace fabric::verbs {

struct QueueSizes {
  // The device's sizes, capped where larger ones buy nothing; `imm_receives` is
  // VerbsConfig::imm_receives (0: the default). The receive CQ holds every receive both SRQs
  // have posted, so the SRQs shrink where the device's CQs are smaller than their sum.
  static QueueSizes for_device(const DeviceContext& dev, uint32_t imm_receives);

  // Largest single work request (the port's max_msg_sz, at least 4 KiB): longer WRITEs are cut.
  uint64_t max_message = 0;
  uint32_t qp_depth = 0;  // max_send_wr of every RC queue pair
  uint32_t msg_srq = 0;   // the application's receive buffers for SENDs
  uint32_t imm_srq = 0;   // zero-length receives that WRITE_WITH_IMM consumes
  uint32_t send_cq = 0;
  uint32_t recv_cq = 0;
};

class SharedQueues {
 public:
  SharedQueues(const DeviceContext& dev, const QueueSizes& sizes);
  ~SharedQueues();
  SharedQueues(const SharedQueues&) = delete;
  SharedQueues& operator=(const SharedQueues&) = delete;

  // A new RC queue pair in the INIT state, completing into the shared CQs, receiving from `srq`.
  // Throws fabric::Error.
  ibv_qp* create_rc_qp(ibv_srq* srq, int remote_access);
  // The inline size the device gave the last RC queue pair (0 where it has none); known from
  // the open on, where a queue pair is made and destroyed to ask.
  uint32_t max_inline() const { return max_inline_; }

  const QueueSizes sizes;
  ibv_cq* const send_cq;
  ibv_cq* const recv_cq;
  ibv_srq* const msg_srq;
  ibv_srq* const imm_srq;

 private:
  const DeviceContext& dev_;
  uint32_t max_inline_ = 0;
};

}  // namespace fabric::verbs
