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

EpochStep epoch_step(uint32_t ours, bool live, uint32_t theirs, uint8_t flags, bool consistent) {
  // The peer sets kConnected at an epoch only after a message of ours at that epoch: if we are
  // below it (or have no queue pairs), the queue pairs it is connected to are not ours (we forgot
  // them, or they failed), so neither side can use them. At our own epoch, queue pairs that do
  // not match mean that one side forgot the other and made new ones under an epoch it had used.
  bool connected = flags & HandshakeMsg::kConnected;
  if (live && theirs == ours) return consistent ? EpochStep::kCurrent : EpochStep::kSupersede;
  if (live && theirs < ours) return EpochStep::kStale;
  if (theirs > ours && !connected) return EpochStep::kAdopt;
  return EpochStep::kSupersede;
}

}  // namespace fabric::verbs
