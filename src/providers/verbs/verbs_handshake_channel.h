// The unreliable-datagram (UD) queue pair a verbs domain's connection handshakes travel on: its own
// CQ, receive buffers posted again as soon as their message is read, and a few send buffers. UD
// loses packets; the handshake (handshake.h) repeats its messages, so a send that cannot go now
// is simply dropped.
#pragma once

#include <infiniband/verbs.h>

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "providers/verbs/verbs_device.h"
#include "providers/verbs/verbs_wire.h"

namespace fabric::verbs {

class HandshakeChannel {
 public:
  // Throws fabric::Error. The first `drop_sends` messages are dropped unsent
  // (VerbsConfig::drop_handshake_packets, for tests).
  HandshakeChannel(const DeviceContext& dev, uint32_t drop_sends);
  ~HandshakeChannel();
  HandshakeChannel(const HandshakeChannel&) = delete;
  HandshakeChannel& operator=(const HandshakeChannel&) = delete;

  uint32_t qp_num() const { return qp_->qp_num; }

  // Reads one batch of the channel's completions, in order: each message received goes to
  // `on_message` (its bytes are valid during the call), each finished send frees its buffer.
  void receive(const std::function<void(std::span<const uint8_t>)>& on_message);
  // Sends `m` to the handshake queue pair `remote_qpn` behind `ah`. A message that cannot go now
  // (no send buffer free; the post failed, which is logged) is lost like a dropped packet.
  void send(const HandshakeMsg& m, ibv_ah* ah, uint32_t remote_qpn);

 private:
  uint8_t* slot(uint32_t i);
  void post_recv(uint32_t slot);

  const DeviceContext& dev_;
  uint32_t drops_left_;
  ibv_cq* cq_ = nullptr;
  ibv_qp* qp_ = nullptr;
  ibv_mr* mr_ = nullptr;
  std::vector<uint8_t> buf_;  // receive slots, then send slots
  std::vector<uint32_t> free_sends_;
};

}  // namespace fabric::verbs
