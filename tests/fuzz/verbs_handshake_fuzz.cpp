// fabric::verbs::Handshake, the verbs provider's connection state machine, driven by fuzzed message
// delivery (loss, duplication, reordering, forged flags) and fuzzed timings.
//
// Two sides A and B run the handshake over a simulated UD link. A starts at time 0; B starts at 0
// too or, like a domain accepting an unknown peer, when its first message arrives. The flags a side
// sends are checked through the real wire format (HandshakeMsg::to_bytes/from_bytes). Input:
//   byte 0: bit 0 = B starts at once       byte 1: first_retry ms (% 64)
//   byte 2: max_retry ms (% 128)           byte 3: timeout = 8 ms * byte
//   then one op per byte, kind = top 2 bits, arg = low 6 bits:
//     0: advance time by arg ms, then each side sends if due()      1: deliver in-flight message #arg
//     2: lose in-flight message #arg     3: arg & 32 ? duplicate message #(arg & 31)
//                                                    : forge flags (arg & 15) to side (arg >> 4) & 1
// After the ops, the link becomes lossless and instant and time runs on until both sides settle.
// (Time is simulated: milliseconds since 0 on Handshake::Clock, no sleeping.)
//
// Properties (each follows from handshake.cpp; see the comments at the checks):
//  - a side connects its queue pairs at most once, and is connected exactly when it was told to;
//  - ready implies connected; ready and failed exclude each other; the three never revert;
//  - the flags a side sends always parse (ready implies connected on the wire too);
//  - ready implies the *peer* is connected (unless forged messages reached this side);
//  - failure happens only at the deadline; retransmissions keep the backoff bounds
//    [min(first_retry, max_retry), max(first_retry, max_retry)] until the side settles;
//  - on a lossless link, any message exchanged while neither side has failed makes both ready, and
//    every side that exists eventually settles (no hang).
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "fuzz_support.h"
#include "providers/verbs/handshake.h"
#include "providers/verbs/verbs_wire.h"

namespace {

using fabric::verbs::Handshake;
using fabric::verbs::HandshakeMsg;
using Clock = Handshake::Clock;
using std::chrono::milliseconds;

constexpr size_t kMaxInFlight = 32;  // a full link loses what is sent

struct Side {
  std::optional<Handshake> hs;  // empty until the side starts
  int64_t start_ms = 0;
  int connects = 0;          // Actions::connect seen
  uint32_t sends = 0;        // sent() calls
  std::optional<int64_t> last_sent_ms;
  bool forged = false;       // received flags no honest peer sent: skip the cross-side check
  bool was_connected = false, was_ready = false, was_failed = false;
};

struct Sim {
  Handshake::Timing timing;
  int64_t lo = 0, hi = 0;  // bounds of a retransmission interval
  int64_t now_ms = 0;
  Side side[2];
  std::vector<std::pair<int, uint8_t>> in_flight;  // (receiver, flags), oldest first; stays small
  bool lossless = false;
  bool wire_checked[4] = {};

  Clock::time_point now() const { return Clock::time_point{} + milliseconds(now_ms); }
  int64_t deadline(const Side& s) const { return s.start_ms + timing.timeout.count(); }

  void start(int i) {
    side[i].hs.emplace(now(), timing);
    side[i].start_ms = now_ms;
  }

  void send(int from) {
    Side& s = side[from];
    s.hs->sent(now());
    s.sends++;
    s.last_sent_ms = now_ms;
    uint8_t flags = s.hs->flags();
    FUZZ_CHECK(flags <= (HandshakeMsg::kConnected | HandshakeMsg::kReady));
    if (!wire_checked[flags]) {  // once per flags value and run: the round trip allocates
      wire_checked[flags] = true;
      HandshakeMsg m;
      m.flags = flags;
      m.mtu = 3;
      m.from.ud_qpn = static_cast<uint32_t>(from + 1);
      m.msg_qpn = m.write_qpn = 7;
      if (flags & HandshakeMsg::kConnected) m.to_msg_qpn = m.to_write_qpn = 8;  // as send_handshake
      auto wire = fuzz::must([&] { return m.to_bytes(); });
      // Our own message must pass the peer's strict parser, flags included.
      auto parsed = fuzz::parse([&] { return HandshakeMsg::from_bytes(wire); });
      FUZZ_CHECK(parsed && *parsed == m);
    }
    if (lossless || in_flight.size() < kMaxInFlight) in_flight.emplace_back(1 - from, flags);
  }

  void deliver(int to, uint8_t flags) {
    Side& s = side[to];
    if (!s.hs) start(to);  // the accepting side: add_peer on its first message, then on_message
    bool was_connected = s.hs->connected();
    Handshake::Actions a = s.hs->on_message(flags);
    if (a.connect) {
      s.connects++;
      FUZZ_CHECK(!was_connected);  // connect is asked for only by the first message
    }
    if (a.reply) send(to);
  }

  void poll(int i) {
    Side& s = side[i];
    if (!s.hs) return;
    bool settled = s.hs->settled();
    // Liveness of retransmission: an unsettled side before its deadline is due at the latest one
    // full (maximal) interval after its last message, and at once when it has sent nothing yet.
    bool must_be_due = !settled && now_ms < deadline(s) &&
                       now_ms >= (s.last_sent_ms ? *s.last_sent_ms + hi : s.start_ms);
    bool due = s.hs->due(now());
    if (settled) FUZZ_CHECK(!due);
    if (must_be_due) FUZZ_CHECK(due);
    if (due && s.last_sent_ms) FUZZ_CHECK(now_ms >= *s.last_sent_ms + lo);  // backoff respected
    if (due) send(i);
  }

  void check() {
    for (int i = 0; i < 2; i++) {
      Side& s = side[i];
      if (!s.hs) {
        FUZZ_CHECK(s.connects == 0);
        continue;
      }
      const Handshake& h = *s.hs;
      FUZZ_CHECK(!h.ready() || h.connected());     // never ready without being connected
      FUZZ_CHECK(!(h.ready() && h.failed()));       // settled one way only
      FUZZ_CHECK(s.connects == (h.connected() ? 1 : 0));  // connected exactly once, by an action
      FUZZ_CHECK(h.messages_sent() == s.sends);
      FUZZ_CHECK(h.connected() || !s.was_connected);  // monotonic
      FUZZ_CHECK(h.ready() || !s.was_ready);
      FUZZ_CHECK(h.failed() || !s.was_failed);
      s.was_connected = h.connected();
      s.was_ready = h.ready();
      s.was_failed = h.failed();
      uint8_t want = (h.connected() ? HandshakeMsg::kConnected : 0) | (h.ready() ? HandshakeMsg::kReady : 0);
      FUZZ_CHECK(h.flags() == want);
      FUZZ_CHECK(!h.failed() || now_ms >= deadline(s));  // failure only at the deadline
      // Ready comes from a message with kConnected, which the peer sets only once connected, and
      // connected never reverts: so the peer is connected now.
      const Side& o = side[1 - i];
      if (h.ready() && !s.forged) FUZZ_CHECK(o.hs && o.hs->connected());
    }
  }

  // Lossless link: deliver everything, replies included. Returns how many messages were delivered.
  size_t drain() {
    size_t n = 0;
    while (!in_flight.empty()) {
      auto [to, flags] = in_flight.front();
      in_flight.erase(in_flight.begin());
      deliver(to, flags);
      check();
      FUZZ_CHECK(++n <= 4 * kMaxInFlight + 16);  // replies stop: no message storm
    }
    // Any message between two sides that have not failed completes the handshake on both: the
    // receiver connects and answers unless the sender is ready already, the answer carries
    // kConnected, and the first side to see kConnected without kReady answers with both flags.
    if (n > 0 && side[0].hs && side[1].hs && !side[0].hs->failed() && !side[1].hs->failed())
      FUZZ_CHECK(side[0].hs->ready() && side[1].hs->ready());
    return n;
  }

  bool all_settled() const {
    for (auto& s : side)
      if (s.hs && !s.hs->settled()) return false;
    return true;
  }

  // Only retransmissions into a failed peer are left: they change nothing, so jump to the deadline.
  bool only_dead_peers_left() const {
    for (int i = 0; i < 2; i++)
      if (side[i].hs && !side[i].hs->settled() && !(side[1 - i].hs && side[1 - i].hs->failed())) return false;
    return true;
  }

  void finish() {
    lossless = true;
    drain();
    for (int step = 0; !all_settled(); step++) {
      int64_t next = INT64_MAX;
      if (only_dead_peers_left()) {
        next = 0;
        for (auto& s : side)
          if (s.hs && !s.hs->settled()) next = std::max(next, deadline(s));
      } else {
        // Jump to the latest moment the next event may come: a side's retransmission (due by then,
        // which poll() checks) or its deadline. Sending later than due changes nothing on a
        // lossless link, and it saves stepping through every millisecond.
        for (auto& s : side)
          if (s.hs && !s.hs->settled())
            next = std::min({next, s.last_sent_ms ? *s.last_sent_ms + hi : s.start_ms, deadline(s)});
        // Every unsettled side sends or fails at its jump; an exchange then settles both or leaves
        // only a side whose peer failed. Needing more rounds than that would be a hang.
        FUZZ_CHECK(step < 8);
      }
      now_ms = std::max(now_ms + 1, next);
      poll(0);
      poll(1);
      check();
      drain();
    }
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 4) return 0;
  Sim sim;
  sim.in_flight.reserve(kMaxInFlight);
  sim.timing.first_retry = milliseconds(data[1] % 64);
  sim.timing.max_retry = milliseconds(data[2] % 128);
  sim.timing.timeout = milliseconds(8 * data[3]);
  sim.lo = std::min(sim.timing.first_retry, sim.timing.max_retry).count();
  sim.hi = std::max(sim.timing.first_retry, sim.timing.max_retry).count();
  sim.start(0);
  if (data[0] & 1) sim.start(1);
  sim.check();

  for (size_t k = 4; k < size; k++) {
    uint8_t kind = data[k] >> 6, arg = data[k] & 63;
    auto& q = sim.in_flight;
    switch (kind) {
      case 0:
        sim.now_ms += arg;
        sim.poll(0);
        sim.poll(1);
        break;
      case 1:
        if (!q.empty()) {
          auto it = q.begin() + static_cast<long>(arg % q.size());
          auto [to, flags] = *it;
          q.erase(it);
          sim.deliver(to, flags);
        }
        break;
      case 2:
        if (!q.empty()) q.erase(q.begin() + static_cast<long>(arg % q.size()));
        break;
      case 3:
        if (arg & 32) {
          if (!q.empty() && q.size() < kMaxInFlight) q.push_back(q[(arg & 31) % q.size()]);
        } else {
          int to = (arg >> 4) & 1;
          sim.side[to].forged = true;
          sim.deliver(to, arg & 15);  // any flags byte, also ones the wire parser would refuse
        }
        break;
    }
    sim.check();
  }
  sim.finish();
  FUZZ_CHECK(sim.all_settled());
  return 0;
}
