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
//
// Reconnection. One Handshake connects one pair of queue pair sets, numbered by an epoch that both
// sides share. A side whose queue pairs failed (a transient fault exhausted the RC retries) retires
// them and, at its next post, makes new ones under epoch + 1; the other side sees the higher epoch
// and replaces its own (epoch_step). A side that forgot the peer (remove_peer, then the same
// address again) starts again at epoch 1: the other side answers that stale epoch with its
// current message, which says that it is connected to queue pairs the forgetful side no longer
// has, and the forgetful side moves past that epoch (kSupersede). Each message names the sender's
// queue pairs and, once connected, the receiver's that it points at, so new queue pairs at an
// epoch already used are told apart too.
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

// What a message at the peer's epoch `theirs`, with flags `flags`, means for our side of the
// connection, which is at epoch `ours` and has queue pairs (`live`: connecting or connected) or
// none (never connected, failed, or lost). `consistent`: the message names the queue pairs we
// connected to (if we did) and, if it says kConnected, our current ones as the ones it points at.
enum class EpochStep {
  kCurrent,    // our epoch: an ordinary handshake message
  kStale,      // an older epoch: answer with our current message (a forgetful peer learns ours)
  kAdopt,      // the peer started a new connection: replace our queue pairs, take its epoch
  kSupersede,  // the peer's queue pairs and ours do not belong together: new ones at a new epoch
};
EpochStep epoch_step(uint32_t ours, bool live, uint32_t theirs, uint8_t flags, bool consistent);
// The epoch after a kSupersede.
inline uint32_t superseding_epoch(uint32_t ours, uint32_t theirs) { return (ours > theirs ? ours : theirs) + 1; }

}  // namespace fabric::verbs
