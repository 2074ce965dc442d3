// The verbs provider's wire formats and its connection handshake, without a device: round trips,
// strict rejection of malformed bytes, the handshake converging under loss, duplication and
// reordering, or failing cleanly at its deadline, and reconnection (epochs) after either side lost
// its queue pairs or forgot the other.
#include <gtest/gtest.h>

#include <deque>
#include <optional>
#include <random>

#include "fabric/error.h"
#include "providers/verbs/handshake.h"
#include "providers/verbs/verbs_wire.h"

namespace fabric::verbs {
namespace {

using Clock = Handshake::Clock;
using std::chrono::milliseconds;

VerbsAddress sample_address(uint32_t qpn) {
  VerbsAddress a;
  for (size_t i = 0; i < a.gid.size(); i++) a.gid[i] = static_cast<uint8_t>(i * 7);
  a.ud_qpn = qpn;
  a.nonce = 0x1234567890abcdefull + qpn;
  return a;
}

HandshakeMsg sample_msg() {
  HandshakeMsg m;
  m.flags = HandshakeMsg::kConnected;
  m.mtu = 3;
  m.from = sample_address(17);
  m.to_nonce = 99;
  m.msg_qpn = 100;
  m.write_qpn = 101;
  m.msg_psn = 0xABCDEF;
  m.write_psn = 1;
  m.epoch = 3;
  m.to_msg_qpn = 200;
  m.to_write_qpn = 201;
  return m;
}

template <class F>
void expect_malformed(F parse, const char* what) {
  try {
    parse();
    ADD_FAILURE() << "accepted malformed " << what;
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kMalformed) << e.what();
  }
}

TEST(VerbsWire, AddressAndMessageRoundTrip) {
  VerbsAddress a = sample_address(5);
  std::string bytes = a.to_bytes();
  ASSERT_EQ(bytes.size(), VerbsAddress::kSize);
  EXPECT_EQ(VerbsAddress::from_bytes(std::span(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size())), a);
  HandshakeMsg m = sample_msg();
  auto mb = m.to_bytes();
  ASSERT_EQ(mb.size(), HandshakeMsg::kSize);
  EXPECT_EQ(HandshakeMsg::from_bytes(mb), m);
}

TEST(VerbsWire, MalformedBytesAreRejected) {
  auto good = sample_msg().to_bytes();
  for (size_t n = 0; n < good.size(); n++) {  // every truncation
    std::vector<uint8_t> cut(good.begin(), good.begin() + static_cast<long>(n));
    expect_malformed([&] { HandshakeMsg::from_bytes(cut); }, "truncated message");
  }
  auto longer = good;
  longer.push_back(0);
  expect_malformed([&] { HandshakeMsg::from_bytes(longer); }, "trailing byte");
  auto mutate = [&](size_t at, uint8_t v) {
    auto b = good;
    b[at] = v;
    return b;
  };
  expect_malformed([&] { HandshakeMsg::from_bytes(mutate(0, 0)); }, "magic");
  expect_malformed([&] { HandshakeMsg::from_bytes(mutate(1, 9)); }, "version");
  expect_malformed([&] { HandshakeMsg::from_bytes(mutate(2, 0x80)); }, "flags");
  expect_malformed([&] { HandshakeMsg::from_bytes(mutate(2, HandshakeMsg::kReady)); }, "ready, not connected");
  expect_malformed([&] { HandshakeMsg::from_bytes(mutate(3, 0)); }, "mtu 0");
  expect_malformed([&] { HandshakeMsg::from_bytes(mutate(3, 6)); }, "mtu 6");
  expect_malformed([&] { HandshakeMsg::from_bytes(mutate(4, 2)); }, "address version");
  HandshakeMsg big = sample_msg();
  big.msg_psn = 1u << 24;
  expect_malformed([&] { HandshakeMsg::from_bytes(big.to_bytes()); }, "psn over 24 bits");
  HandshakeMsg zero = sample_msg();
  zero.write_qpn = 0;
  expect_malformed([&] { HandshakeMsg::from_bytes(zero.to_bytes()); }, "qpn 0");
  HandshakeMsg e0 = sample_msg();
  e0.epoch = 0;
  expect_malformed([&] { HandshakeMsg::from_bytes(e0.to_bytes()); }, "epoch 0");
  HandshakeMsg unnamed = sample_msg();  // connected, but to which queue pairs?
  unnamed.to_write_qpn = 0;
  expect_malformed([&] { HandshakeMsg::from_bytes(unnamed.to_bytes()); }, "connected without to_*_qpn");
  HandshakeMsg named = sample_msg();  // not connected, yet names the receiver's queue pairs
  named.flags = 0;
  expect_malformed([&] { HandshakeMsg::from_bytes(named.to_bytes()); }, "to_*_qpn without connected");
  named.to_msg_qpn = named.to_write_qpn = 0;
  EXPECT_EQ(HandshakeMsg::from_bytes(named.to_bytes()), named);
  HandshakeMsg wide = sample_msg();
  wide.to_msg_qpn = 1u << 24;
  expect_malformed([&] { HandshakeMsg::from_bytes(wide.to_bytes()); }, "to_msg_qpn over 24 bits");
  VerbsAddress a = sample_address(0);
  std::string ab = a.to_bytes();
  expect_malformed([&] { VerbsAddress::from_bytes(std::span(reinterpret_cast<const uint8_t*>(ab.data()), ab.size())); },
                   "address with qpn 0");
}

// Two handshakes over a simulated datagram link that loses, duplicates and reorders messages.
struct Side {
  Handshake hs;
  bool connected_by_message = false;
  int connects = 0;
};

struct LossyLink {
  std::mt19937 rng;
  double loss, dup;
  std::deque<std::pair<int, uint8_t>> in_flight;  // (receiver, flags)
  void send(int to, uint8_t flags) {
    std::uniform_real_distribution<double> u(0, 1);
    if (u(rng) < loss) return;
    in_flight.emplace_back(to, flags);
    if (u(rng) < dup) in_flight.emplace_back(to, flags);
    if (in_flight.size() > 1 && u(rng) < 0.3) std::swap(in_flight.front(), in_flight.back());
  }
};

// Runs both sides in 1 ms steps until both settle; returns the simulated time taken.
milliseconds run(Side (&s)[2], LossyLink& link, bool both_start, milliseconds limit) {
  auto t = Clock::time_point{};
  for (milliseconds now{0}; now < limit; now += milliseconds(1)) {
    t = Clock::time_point{} + now;
    for (int i = 0; i < 2; i++)
      if ((i == 0 || both_start || s[i].hs.connected()) && s[i].hs.due(t)) {
        s[i].hs.sent(t);
        link.send(1 - i, s[i].hs.flags());
      }
    size_t n = link.in_flight.size();
    for (size_t k = 0; k < n; k++) {
      auto [to, flags] = link.in_flight.front();
      link.in_flight.pop_front();
      Handshake::Actions a = s[to].hs.on_message(flags);
      s[to].connects += a.connect;
      if (a.reply) {
        s[to].hs.sent(t);
        link.send(1 - to, s[to].hs.flags());
      }
    }
    if (s[0].hs.settled() && s[1].hs.settled()) return now;
  }
  return limit;
}

TEST(VerbsHandshake, ConvergesUnderLossDuplicationAndReordering) {
  Handshake::Timing timing{milliseconds(20), milliseconds(500), milliseconds(60000)};
  for (uint32_t seed = 1; seed <= 300; seed++) {
    for (bool both_start : {false, true}) {
      Side s[2] = {{Handshake(Clock::time_point{}, timing)}, {Handshake(Clock::time_point{}, timing)}};
      LossyLink link{std::mt19937(seed), 0.4, 0.2, {}};
      run(s, link, both_start, milliseconds(60000));
      for (int i = 0; i < 2; i++) {
        EXPECT_TRUE(s[i].hs.ready()) << "seed " << seed << " side " << i;
        EXPECT_EQ(s[i].connects, 1) << "seed " << seed << " side " << i << ": connected once, exactly";
      }
    }
  }
}

TEST(VerbsHandshake, ThreeMessagesWithoutLoss) {
  Handshake::Timing timing;
  Side s[2] = {{Handshake(Clock::time_point{}, timing)}, {Handshake(Clock::time_point{}, timing)}};
  LossyLink link{std::mt19937(1), 0, 0, {}};
  run(s, link, false, milliseconds(1000));
  EXPECT_TRUE(s[0].hs.ready() && s[1].hs.ready());
  EXPECT_EQ(s[0].hs.messages_sent() + s[1].hs.messages_sent(), 3u);
}

TEST(VerbsHandshake, ADeadPeerFailsAtTheDeadlineAfterBackedOffRetries) {
  Handshake::Timing timing{milliseconds(20), milliseconds(500), milliseconds(3000)};
  Handshake hs(Clock::time_point{}, timing);
  uint32_t sends = 0;
  for (int ms = 0; ms <= 3100 && !hs.failed(); ms++) {
    auto t = Clock::time_point{} + milliseconds(ms);
    if (hs.due(t)) {
      hs.sent(t);
      sends++;
    }
  }
  EXPECT_TRUE(hs.failed());
  EXPECT_FALSE(hs.ready());
  // 0, 20, 60, 140, 300, 620, 1120, 1620, 2120, 2620: backoff doubles up to 500 ms.
  EXPECT_EQ(sends, 10u);
  EXPECT_FALSE(hs.on_message(HandshakeMsg::kConnected).connect) << "a failed handshake stays failed";
}

// ---- reconnection ----------------------------------------------------------------------------

TEST(VerbsEpoch, Steps) {
  constexpr uint8_t c = HandshakeMsg::kConnected, r = HandshakeMsg::kReady;
  EXPECT_EQ(epoch_step(3, true, 3, c, true), EpochStep::kCurrent);
  EXPECT_EQ(epoch_step(3, true, 3, c | r, false), EpochStep::kSupersede) << "same epoch, other queue pairs";
  EXPECT_EQ(epoch_step(3, true, 2, c | r, false), EpochStep::kStale);
  EXPECT_EQ(epoch_step(3, true, 4, 0, false), EpochStep::kAdopt) << "the peer reconnects";
  EXPECT_EQ(epoch_step(3, true, 4, c, false), EpochStep::kSupersede) << "connected to a self we forgot";
  EXPECT_EQ(epoch_step(0, false, 1, 0, false), EpochStep::kAdopt) << "first contact";
  EXPECT_EQ(epoch_step(5, false, 5, c, false), EpochStep::kSupersede) << "we lost our queue pairs";
  EXPECT_EQ(epoch_step(5, false, 2, 0, false), EpochStep::kSupersede);
  EXPECT_EQ(superseding_epoch(5, 9), 10u);
  EXPECT_EQ(superseding_epoch(9, 5), 10u);
}

// Two domains' views of one connection, driven as VerbsDomain::on_handshake and check_peer drive
// them: epoch_step, then the Handshake of the current epoch. A queue pair set is a number that is
// never reused. Events: a side loses its queue pairs (an RC error) or forgets the other entirely
// (remove_peer and insert again); then one side or both post (a post to a peer whose queue pairs
// are gone fails on RC, which is a loss too). After each event, over a link that loses 30% and
// duplicates and reorders, both sides must end ready at one epoch with each pointing at the
// other's current queue pairs.
class EpochSim {
 public:
  struct End {
    uint32_t epoch = 0;
    uint32_t qps = 0;         // current queue pair set, 0: none (not live)
    uint32_t remote_qps = 0;  // the peer's set ours are connected to
    std::optional<Handshake> hs;
    int connects = 0;
  };
  struct Msg {
    int to;
    uint8_t flags;
    uint32_t epoch, from_qps, to_qps;
  };

  explicit EpochSim(uint32_t seed) : rng_(seed) {}

  End end[2];
  Clock::time_point now{};

  void post(int i) {
    End& e = end[i];
    if (e.qps && e.hs->ready() && end[1 - i].qps != e.remote_qps) lose(i);  // RC finds the dead peer
    if (e.hs && e.hs->failed()) lose(i);
    if (!e.qps) begin(i, e.epoch + 1);
  }
  void lose(int i) {
    end[i].qps = 0;
    end[i].remote_qps = 0;
    end[i].hs.reset();
  }
  void forget(int i) { end[i] = End{}; }

  // Steps of 1 ms until both are ready and paired, or `limit` passes.
  bool run(milliseconds limit, double loss) {
    for (auto until = now + limit; now < until; now += milliseconds(1)) {
      for (int i = 0; i < 2; i++)
        if (end[i].hs && !end[i].hs->settled() && end[i].hs->due(now)) send(i);
      size_t n = link_.size();
      for (size_t k = 0; k < n; k++) {
        Msg m = link_.front();
        link_.pop_front();
        if (u_(rng_) < loss) continue;
        if (u_(rng_) < 0.1) link_.push_back(m);  // duplicated, delivered later
        receive(m);
      }
      if (u_(rng_) < 0.2 && link_.size() > 1) std::swap(link_.front(), link_.back());
      if (paired()) return true;
    }
    return false;
  }

  bool paired() const {
    const End &a = end[0], &b = end[1];
    return a.qps && b.qps && a.hs->ready() && b.hs->ready() && a.epoch == b.epoch && a.remote_qps == b.qps &&
           b.remote_qps == a.qps;
  }

 private:
  void begin(int i, uint32_t epoch) {
    End& e = end[i];
    e.epoch = epoch;
    e.qps = ++next_qps_;
    e.remote_qps = 0;
    e.hs.emplace(now, Handshake::Timing{milliseconds(20), milliseconds(500), milliseconds(60000)});
    e.connects = 0;
  }
  void send(int i) {
    End& e = end[i];
    e.hs->sent(now);
    link_.push_back(Msg{1 - i, e.hs->flags(), e.epoch, e.qps, e.hs->connected() ? e.remote_qps : 0});
  }
  void receive(const Msg& m) {
    int i = m.to;
    End& e = end[i];
    bool live = e.qps != 0;
    bool consistent = live && (!e.hs->connected() || m.from_qps == e.remote_qps) &&
                      (!(m.flags & HandshakeMsg::kConnected) || m.to_qps == e.qps);
    switch (epoch_step(e.epoch, live, m.epoch, m.flags, consistent)) {
      case EpochStep::kCurrent:
        break;
      case EpochStep::kStale:
        send(i);
        return;
      case EpochStep::kAdopt:
        begin(i, m.epoch);
        break;
      case EpochStep::kSupersede:
        begin(i, superseding_epoch(e.epoch, m.epoch));
        send(i);
        return;
    }
    Handshake::Actions a = e.hs->on_message(m.flags);
    if (a.connect) {
      e.remote_qps = m.from_qps;
      EXPECT_EQ(++e.connects, 1) << "connected twice at one epoch";
    }
    if (a.reply) send(i);
  }

  std::mt19937 rng_;
  std::uniform_real_distribution<double> u_{0, 1};
  std::deque<Msg> link_;
  uint32_t next_qps_ = 0;
};

TEST(VerbsEpoch, ReconnectsAfterEitherSideLosesOrForgetsTheOther) {
  const char* names[] = {"A loses", "B loses", "both lose", "A forgets B", "B forgets A", "both forget"};
  for (uint32_t seed = 1; seed <= 100; seed++) {
    EpochSim sim(seed);
    std::mt19937 rng(seed * 7919);
    sim.post(0);
    ASSERT_TRUE(sim.run(milliseconds(60000), 0.3)) << "seed " << seed << ": first connection";
    for (int round = 0; round < 8; round++) {
      int event = static_cast<int>(rng() % 6), posters = static_cast<int>(rng() % 3);
      switch (event) {
        case 0: sim.lose(0); break;
        case 1: sim.lose(1); break;
        case 2: sim.lose(0), sim.lose(1); break;
        case 3: sim.forget(0); break;
        case 4: sim.forget(1); break;
        case 5: sim.forget(0), sim.forget(1); break;
      }
      uint32_t before = std::max(sim.end[0].epoch, sim.end[1].epoch);
      if (posters != 1) sim.post(0);  // 0: A posts, 1: B posts, 2: both
      if (posters != 0) sim.post(1);
      EXPECT_TRUE(sim.run(milliseconds(60000), 0.3))
          << "seed " << seed << " round " << round << ": " << names[event] << ", posters " << posters << ": epochs "
          << sim.end[0].epoch << "/" << sim.end[1].epoch;
      if (event < 3) {
        EXPECT_GT(sim.end[0].epoch, before) << "a lost connection comes back at a new epoch";
      }
    }
  }
}

}  // namespace
}  // namespace fabric::verbs
