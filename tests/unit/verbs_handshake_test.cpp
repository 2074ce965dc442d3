// The verbs provider's wire formats and its connection handshake, without a device: round trips,
// strict rejection of malformed bytes, and the handshake converging under loss, duplication and
// reordering, or failing cleanly at its deadline.
#include <gtest/gtest.h>

#include <deque>
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

}  // namespace
}  // namespace fabric::verbs
