#include "providers/verbs/handshake.h"

#include <algorithm>

#include "providers/verbs/verbs_wire.h"

namespace fabric::verbs {

Handshake::Actions Handshake::on_message(uint8_t flags) {
  Actions a;
  if (failed_) return a;  // too late: the transfers waiting for this peer have failed already
  if (!connected_) {
    connected_ = true;
    a.connect = true;
  }
  if (flags & HandshakeMsg::kConnected) ready_ = true;
  a.reply = !(flags & HandshakeMsg::kReady);
  return a;
}

bool Handshake::due(Clock::time_point now) {
  if (settled()) return false;
  if (now >= deadline_) {
    failed_ = true;
    return false;
  }
  return now >= next_send_;
}

void Handshake::sent(Clock::time_point now) {
  sent_++;
  next_send_ = now + interval_;
  interval_ = std::min(interval_ * 2, timing_.max_retry);
}

uint8_t Handshake::flags() const {
  uint8_t f = 0;
  if (connected_) f |= HandshakeMsg::kConnected;
  if (ready_) f |= HandshakeMsg::kReady;
  return f;
}

}  // namespace fabric::verbs
