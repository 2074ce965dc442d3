// The connection handshake of one peer, as a state machine without I/O (unit-tested with lossy,
// duplicating delivery). Both sides may start it at once; UD loses packets, so each side repeats
// its message with exponential backoff until it knows the other side is connected, and gives up
// after a timeout (the peer is then failed: a dead or lost peer gives an error, never a hang).
//
//   A -> B  {A's QPs}                      B connects its QPs to A's
//   B -> A  {B's QPs, connected}           A connects, and knows B is connected: A is ready
//   A -> B  {A's QPs, connected, ready}    B knows A is connected: B is ready
//
// A message is answered whenever its sender does not yet know that we are connected, so any lost
// message is recovered by the next retransmission of the side that is not ready yet.
#pragma once

#include <chrono>
#include <cstdint>

namespace fabric::verbs {

class Handshake {
 public:
  using Clock = std::chrono::steady_clock;
  struct Timing {
    std::chrono::milliseconds first_retry{20};
    std::chrono::milliseconds max_retry{500};
    std::chrono::milliseconds timeout{10000};
  };

  // `start`: when the peer became known; the first message is due at once.
  Handshake(Clock::time_point start, Timing timing)
      : timing_(timing), next_send_(start), deadline_(start + timing.timeout), interval_(timing.first_retry) {}

  // What to do about a message from the peer.
  struct Actions {
    bool connect = false;  // first message: connect our QPs to the QPs it names
    bool reply = false;    // send our message now (the peer does not know we are connected)
  };
  Actions on_message(uint8_t flags);

  // Whether a (re)transmission is due at `now`; marks the handshake failed past its deadline.
  bool due(Clock::time_point now);
  // Call after a message went out (answers included): the next retransmission waits a full interval.
  void sent(Clock::time_point now);

  // Flags for our outgoing message.
  uint8_t flags() const;
  bool connected() const { return connected_; }  // our QPs point at the peer's
  bool ready() const { return ready_; }          // the peer's point at ours too: writes may go
  bool failed() const { return failed_; }
  bool settled() const { return ready_ || failed_; }
  uint32_t messages_sent() const { return sent_; }

 private:
  Timing timing_;
  Clock::time_point next_send_;
  Clock::time_point deadline_;
  std::chrono::milliseconds interval_;
  bool connected_ = false;
  bool ready_ = false;
  bool failed_ = false;
  uint32_t sent_ = 0;
};

}  // namespace fabric::verbs
