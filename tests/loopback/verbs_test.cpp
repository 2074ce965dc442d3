// What only the verbs provider has: its UD handshake (lost packets, a peer that never answers),
// the GID choice, reconnection after a transient network fault, and peer removal. Runs on a real
// verbs device (Soft-RoCE in the VM of tests/rxe); skips elsewhere.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>
#include <sys/mman.h>
#include <thread>
#include <unistd.h>

#include <fmt/format.h>

#include "../../src/providers/open_domain.h"  // the Domain tests drive the provider itself
#include "fabric/fabric.h"
#include "util/log.h"
#include "process_pair.h"
#include "test_support.h"

namespace fabric::testing {
namespace {

using tools::Channel;

const ProviderCase kVerbs{"verbs", 1, false};
constexpr uint64_t kLen = 256 * 1024 + 5;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// A short RC budget, set explicitly (the default is a production one, about 35 s): 4.096 us * 2^14
// = 67 ms per try, 4 tries. (rxe retries forever with retry_count 7.)
void short_rc_budget(EngineConfig& cfg) {
  cfg.verbs.ack_timeout = 14;
  cfg.verbs.retry_count = 3;
}

// One WRITE with an immediate from `sender_cfg` to `receiver_cfg`'s engine, every byte checked.
void expect_write_arrives(const EngineConfig& sender_cfg, const EngineConfig& receiver_cfg) {
  auto receiver = [&](Channel& ch) {
    TransferEngine engine(receiver_cfg);
    std::vector<uint8_t> dst(kLen, 0);
    auto [h, d] = engine.reg_mr(dst.data(), kLen);
    std::atomic<int> landed{kDonePending};
    engine.expect_imm_count(7, single_write_imm_count(kLen, receiver_cfg.nics.size(), false), OnDone::flag(&landed));
    ch.send(d.to_bytes());
    EXPECT_TRUE(wait_until([&] { return landed.load() != kDonePending; }));
    EXPECT_EQ(landed.load(), kDoneSucceeded);
    EXPECT_EQ(dst, random_bytes(kLen, 21));
    ch.send("verified");
    return role_result();
  };
  auto sender = [&](Channel& ch) {
    TransferEngine engine(sender_cfg);
    auto src = random_bytes(kLen, 21);
    auto [h, d] = engine.reg_mr(src.data(), kLen);
    MrDesc dst = MrDesc::from_bytes(ch.recv_bytes());
    std::atomic<int> done{kDonePending};
    engine.submit(SingleWrite{.len = kLen, .src = {h, 0}, .dst = {engine.add_remote(dst), 0}, .imm = 7},
                  OnDone::flag(&done));
    EXPECT_TRUE(wait_until([&] { return done.load() != kDonePending; }));
    EXPECT_EQ(done.load(), kDoneSucceeded);
    EXPECT_EQ(ch.recv(), "verified");
    return role_result();
  };
  auto r = tools::run_process_pair(sender, receiver);
  EXPECT_TRUE(r.ok()) << "sender rc " << r.parent_rc << ", receiver status " << r.child_status;
}

TEST(Verbs, HandshakeRecoversFromLostPackets) {
  FABRIC_SKIP_WITHOUT_DEVICE(kVerbs);
  // The initiator's first message and the responder's first answer are lost; retransmission
  // must connect them anyway. Two NICs: each domain has its own handshake.
  ProviderCase two{"verbs", 2, false};
  EngineConfig sender = config_for(two), receiver = config_for(two);
  sender.verbs.drop_handshake_packets = 1;
  receiver.verbs.drop_handshake_packets = 1;
  expect_write_arrives(sender, receiver);
}

TEST(Verbs, ExplicitGidIndexesConnect) {
  FABRIC_SKIP_WITHOUT_DEVICE(kVerbs);
  for (int gid : {0, 1}) {
    SCOPED_TRACE("gid index " + std::to_string(gid));
    EngineConfig cfg = config_for(kVerbs);
    cfg.verbs.gid_index = gid;
    expect_write_arrives(cfg, cfg);
  }
}

TEST(Verbs, BadDeviceOrGidIsRejectedWithAClearError) {
  FABRIC_SKIP_WITHOUT_DEVICE(kVerbs);
  EngineConfig cfg = config_for(kVerbs);
  cfg.verbs.gid_index = 200;
  try {
    TransferEngine engine(cfg);
    ADD_FAILURE() << "GID index 200 accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
    EXPECT_NE(std::string(e.what()).find("GID"), std::string::npos) << e.what();
  }
  cfg = config_for(kVerbs);
  cfg.nics = {NicConfig{"no_such_device", ""}};
  try {
    TransferEngine engine(cfg);
    ADD_FAILURE() << "unknown device accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kNotFound) << e.what();
    EXPECT_NE(std::string(e.what()).find("no_such_device"), std::string::npos) << e.what();
  }
}

TEST(Verbs, QueueAndTrafficSettingsOutOfRangeAreRefusedByName) {
  FABRIC_SKIP_WITHOUT_DEVICE(kVerbs);
  auto refused = [](void (*set)(EngineConfig&), const char* name) {
    EngineConfig cfg = config_for(kVerbs);
    set(cfg);
    try {
      TransferEngine engine(cfg);
      ADD_FAILURE() << name << " accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
      EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
    }
  };
  refused([](EngineConfig& c) { c.verbs.service_level = 16; }, "service_level");
  refused([](EngineConfig& c) { c.verbs.min_rnr_timer = 32; }, "min_rnr_timer");
  refused([](EngineConfig& c) { c.verbs.imm_receives = UINT32_MAX; }, "imm_receives");
  refused([](EngineConfig& c) { c.verbs.imm_receives = 3; }, "imm_receives");
}

// The traffic class and RNR timer asked for are what every connected queue pair holds, read back
// from the device (the debug line of each connection). The service level is set too, but rxe, a
// RoCE device without VLANs, keeps none (it reads back 0), so it is not checked here.
TEST(Verbs, TrafficClassAndRnrTimerReachEveryQueuePair) {
  FABRIC_SKIP_WITHOUT_DEVICE(kVerbs);
  EngineConfig cfg = config_for(kVerbs);
  cfg.verbs.traffic_class = 106;  // DSCP 26, ECN 2
  cfg.verbs.service_level = 3;
  cfg.verbs.min_rnr_timer = 2;
  const log::Level before = log::level();
  log::set_level(log::Level::kDebug);  // before the fork: both processes log their connections
  ::testing::internal::CaptureStderr();
  expect_write_arrives(cfg, cfg);
  const std::string err = ::testing::internal::GetCapturedStderr();
  log::set_level(before);
  int connected = 0;
  size_t at = 0;
  while ((at = err.find("connected to qp", at)) != std::string::npos) {
    const std::string line = err.substr(at, err.find('\n', at) - at);
    EXPECT_NE(line.find("traffic class 106,"), std::string::npos) << line;
    EXPECT_NE(line.find("min_rnr_timer 2,"), std::string::npos) << line;
    connected++;
    at++;
  }
  // Each side connects a SEND and a WRITE queue pair.
  EXPECT_GE(connected, 4) << err;
}

// An immediate receive queue far smaller than the WRITEs in flight: senders meet
// receiver-not-ready and retry after min_rnr_timer, every page and immediate still lands, and the
// receiver says which setting to raise.
TEST(Verbs, AnImmediateReceiveQueueThatRunsDryRecoversAndSaysWhatToRaise) {
  FABRIC_SKIP_WITHOUT_DEVICE(kVerbs);
  EngineConfig cfg = config_for(kVerbs);
  cfg.verbs.imm_receives = 16;
  cfg.verbs.min_rnr_timer = 1;  // 0.01 ms
  constexpr uint32_t kPages = 512;
  constexpr uint64_t kPage = 4096;
  std::vector<uint32_t> idx(kPages);
  for (uint32_t i = 0; i < kPages; i++) idx[i] = (i * 37) % kPages;  // a permutation
  auto receiver = [&](Channel& ch) {
    TransferEngine engine(cfg);
    std::vector<uint8_t> dst(kPages * kPage, 0);
    auto [h, d] = engine.reg_mr(dst.data(), dst.size());
    std::atomic<int> landed{kDonePending};
    engine.expect_imm_count(9, kPages, OnDone::flag(&landed));
    ch.send(d.to_bytes());
    EXPECT_TRUE(wait_until([&] { return landed.load() != kDonePending; }));
    EXPECT_EQ(landed.load(), kDoneSucceeded);
    EXPECT_EQ(dst, random_bytes(dst.size(), 33));
    EXPECT_EQ(engine.nic_stats().at(0).imms_received, kPages);
    ch.send("verified");
    return role_result();
  };
  auto sender = [&](Channel& ch) {
    TransferEngine engine(cfg);
    auto src = random_bytes(kPages * kPage, 33);
    auto [h, d] = engine.reg_mr(src.data(), src.size());
    RemoteMr dst = engine.add_remote(MrDesc::from_bytes(ch.recv_bytes()));
    std::atomic<int> done{kDonePending};
    engine.submit(PagedWrites{.page_len = kPage,
                              .src = h,
                              .src_pages = {.indices = idx, .stride = kPage},
                              .dst = dst,
                              .dst_pages = {.indices = idx, .stride = kPage},
                              .imm = 9},
                  OnDone::flag(&done));
    EXPECT_TRUE(wait_until([&] { return done.load() != kDonePending; }));
    EXPECT_EQ(done.load(), kDoneSucceeded);
    EXPECT_EQ(ch.recv(), "verified");
    return role_result();
  };
  ::testing::internal::CaptureStderr();
  auto r = tools::run_process_pair(sender, receiver);
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_TRUE(r.ok()) << "sender rc " << r.parent_rc << ", receiver status " << r.child_status << "\n" << err;
  EXPECT_NE(err.find("raise VerbsConfig::imm_receives"), std::string::npos) << err;
}

// Registering (and deregistering) a large region pins it on the caller's thread
// (DomainCaps::concurrent_registration): the worker keeps posting meanwhile. A second thread
// writes 4 KiB to the engine's own region in a loop; some of its WRITEs complete in the middle of
// the reg_mr and of the dereg_mr calls (with registration on the worker, none can: the worker is
// inside ibv_reg_mr for the whole call; deregistration is judged where it lasts ten WRITEs or
// more). The large region then carries a WRITE, every byte checked.
TEST(Verbs, ARegionIsPinnedOnTheCallersThreadWhileTheWorkerKeepsPosting) {
  FABRIC_SKIP_WITHOUT_DEVICE(kVerbs);
  TransferEngine engine(config_for(kVerbs));
  constexpr uint64_t kSmall = 4096;
  std::vector<uint8_t> src = random_bytes(kSmall, 5), dst(kSmall, 0);
  auto [src_h, src_d] = engine.reg_mr(src.data(), kSmall);
  RemoteMr dst_r = engine.add_remote(engine.reg_mr(dst.data(), kSmall).second);
  std::atomic<bool> stop{false};
  std::atomic<size_t> written{0};
  std::vector<Clock::time_point> completions;  // the writer thread's, read after it joined
  std::thread writer([&] {
    while (!stop.load()) {
      std::atomic<int> done{kDonePending};
      engine.submit(SingleWrite{.len = kSmall, .src = {src_h, 0}, .dst = {dst_r, 0}}, OnDone::flag(&done));
      done.wait(kDonePending);
      if (done.load() != kDoneSucceeded) break;
      completions.push_back(Clock::now());
      written.fetch_add(1);
    }
  });
  // Untouched pages: reg_mr faults them in as it pins (the larger window on a fast machine).
  constexpr uint64_t kLarge = 256ull << 20;
  void* big = mmap(nullptr, kLarge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(big, MAP_FAILED);
  ASSERT_TRUE(wait_until([&] { return written.load() > 0; }));
  const auto reg_start = Clock::now();
  auto [big_h, big_d] = engine.reg_mr(big, kLarge);
  const auto reg_end = Clock::now();
  RemoteMr big_r = engine.add_remote(big_d);
  std::atomic<int> landed{kDonePending};
  engine.submit(SingleWrite{.len = kSmall, .src = {src_h, 0}, .dst = {big_r, kLarge - kSmall}}, OnDone::flag(&landed));
  ASSERT_TRUE(wait_until([&] { return landed.load() != kDonePending; }));
  EXPECT_EQ(landed.load(), kDoneSucceeded);
  EXPECT_EQ(std::memcmp(static_cast<uint8_t*>(big) + kLarge - kSmall, src.data(), kSmall), 0);
  const auto dereg_start = Clock::now();
  engine.dereg_mr(big_h);
  const auto dereg_end = Clock::now();
  stop.store(true);
  writer.join();
  munmap(big, kLarge);
  // WRITEs that completed in the middle half of each call.
  auto inside = [&](Clock::time_point a, Clock::time_point b) {
    const auto quarter = (b - a) / 4;
    return std::count_if(completions.begin(), completions.end(),
                         [&](Clock::time_point t) { return t > a + quarter && t < b - quarter; });
  };
  const auto ms = [](Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); };
  const Clock::duration per_write = (completions.back() - completions.front()) / std::max<size_t>(completions.size(), 2);
  EXPECT_GT(inside(reg_start, reg_end), 0) << "reg_mr took " << ms(reg_end - reg_start) << " ms, "
                                           << completions.size() << " WRITEs in all, " << ms(per_write) << " ms each";
  if (dereg_end - dereg_start > 10 * per_write) {
    EXPECT_GT(inside(dereg_start, dereg_end), 0) << "dereg_mr took " << ms(dereg_end - dereg_start) << " ms, "
                                                 << completions.size() << " WRITEs in all";
  }
  EXPECT_EQ(dst, src);
}

TEST(Verbs, APeerThatNeverAnswersFailsAtTheHandshakeTimeout) {
  FABRIC_SKIP_WITHOUT_DEVICE(kVerbs);
  // The victim publishes its descriptor and dies before any handshake reaches it.
  auto victim = [&](Channel& ch) {
    TransferEngine engine(config_for(kVerbs));
    std::vector<uint8_t> dst(kLen, 0);
    auto [h, d] = engine.reg_mr(dst.data(), kLen);
    ch.send(d.to_bytes());
    ch.recv();
    std::raise(SIGKILL);
    return 0;
  };
  auto survivor = [&](Channel& ch) {
    EngineConfig cfg = config_for(kVerbs);
    cfg.verbs.handshake_timeout = std::chrono::milliseconds(1500);
    TransferEngine engine(cfg);
    auto src = random_bytes(kLen, 5);
    auto [h, d] = engine.reg_mr(src.data(), kLen);
    MrDesc dst = MrDesc::from_bytes(ch.recv_bytes());
    ch.send("die");
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    std::atomic<uint32_t> ended{0};
    std::vector<Status> statuses(3);
    auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < 3; i++)
      engine.submit(SingleWrite{.len = kLen, .src = {h, 0}, .dst = {engine.add_remote(dst), 0}},
                    OnDone::callback([&, i](const Status& s) {
                                   statuses[i] = s;
                                   ended++;
                                 }));
    EXPECT_TRUE(wait_until([&] { return ended.load() == 3; }, std::chrono::seconds(20)));
    double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_GE(secs, 1.0);
    EXPECT_LT(secs, 10.0);
    for (auto& s : statuses) {
      EXPECT_EQ(s.code(), ErrorCode::kProvider) << s.message();
      EXPECT_NE(s.message().find("handshake"), std::string::npos) << s.message();
    }
    expect_write_to_self_works(engine, h, src, kVerbs.nics);  // the engine still works
    return role_result();
  };
  auto r = tools::run_process_pair(survivor, victim);
  EXPECT_EQ(r.parent_rc, 0);
  EXPECT_TRUE(WIFSIGNALED(r.child_status));
}

// ---- a transient network fault -------------------------------------------------------------

// FABRIC_LINK_DEVICES="rxe1:fva,rxe2:fvb" (tests/rxe/guest-init.sh, rxe_link_pair): two devices
// whose traffic crosses a veth pair, so that `tc netem` on the two ends can cut the link.
struct LinkEnd {
  std::string device, netdev;
};
std::vector<LinkEnd> link_devices() {
  std::vector<LinkEnd> out;
  const char* v = std::getenv("FABRIC_LINK_DEVICES");
  std::string s = v ? v : "";
  for (size_t at = 0; at < s.size();) {
    size_t comma = s.find(',', at);
    std::string item = s.substr(at, comma == std::string::npos ? std::string::npos : comma - at);
    size_t colon = item.find(':');
    if (colon != std::string::npos) out.push_back({item.substr(0, colon), item.substr(colon + 1)});
    at = comma == std::string::npos ? s.size() : comma + 1;
  }
  return out;
}

// 100% loss on both ends of the link (both directions), or none; false if a tc command failed.
bool set_loss(const std::vector<LinkEnd>& link, bool on) {
  bool ok = true;
  for (const LinkEnd& e : link) {
    std::string cmd = on ? "tc qdisc add dev " + e.netdev + " root netem loss 100%"
                         : "tc qdisc del dev " + e.netdev + " root 2>/dev/null";
    ok = std::system(cmd.c_str()) == 0 && ok;
  }
  return ok;
}

// One side of the transient-fault test: an engine on one link device with a region of slots that
// the other side writes into, and its own source slots. Slot k of side s holds pattern(s, k).
class LinkSide {
 public:
  static constexpr uint64_t kSlot = 64 << 10;
  static constexpr uint32_t kSlots = 16;

  LinkSide(const std::string& device, int side) : side_(side) {
    EngineConfig cfg = config_for(kVerbs);
    cfg.nics = {NicConfig{device, ""}};
    cfg.transfer_timeout = std::chrono::seconds(40);
    cfg.verbs.handshake_timeout = std::chrono::seconds(30);  // outlasts the outage
    short_rc_budget(cfg);
    engine_ = std::make_unique<TransferEngine>(cfg);
    dst_.assign(kSlot * kSlots, 0);
    src_.resize(kSlot * kSlots);
    for (uint32_t k = 0; k < kSlots; k++) {
      auto p = pattern(side, k);
      std::copy(p.begin(), p.end(), src_.begin() + static_cast<long>(k * kSlot));
    }
    dst_desc_ = engine_->reg_mr(dst_.data(), dst_.size()).second;
    src_h_ = engine_->reg_mr(src_.data(), src_.size()).first;
  }
  // The engine goes first: its shutdown runs the callbacks of writes still pending, which use
  // the members below.
  ~LinkSide() { engine_.reset(); }
  static std::vector<uint8_t> pattern(int side, uint32_t k) { return random_bytes(kSlot, 1000 * side + k + 1); }
  std::vector<uint8_t> my_desc() const { return dst_desc_.to_bytes(); }
  void set_peer(const std::vector<uint8_t>& desc) { peer_ = MrDesc::from_bytes(desc); }

  // WRITE of slot k into the peer's slot k with immediate `imm`.
  void submit(uint32_t k, uint32_t imm) {
    auto& st = writes_[k];
    st.ended = false;
    st.submitted = Clock::now();
    engine_->submit(SingleWrite{.len = kSlot, .src = {src_h_, k * kSlot}, .dst = {engine_->add_remote(peer_), k * kSlot}, .imm = imm},
                    OnDone::callback([this, k](const Status& s) {
                                   std::lock_guard lock(mu_);
                                   writes_[k].status = s;
                                   writes_[k].took = seconds_since(writes_[k].submitted);
                                   writes_[k].ended = true;
                                 }));
  }
  // "ok <secs>" or "error <secs> <message>" once write k ended; "hung" after 60 s.
  std::string wait(uint32_t k) {
    if (!wait_until([&] {
          std::lock_guard lock(mu_);
          return writes_[k].ended;
        }))
      return "hung";
    std::lock_guard lock(mu_);
    const Write& w = writes_[k];
    return (w.status.ok() ? "ok " : "error ") + std::to_string(w.took) + (w.status.ok() ? "" : " " + w.status.message());
  }
  // The peer's WRITE into slot k arrived (its immediate was counted) and every byte is right.
  std::string check(uint32_t k, uint32_t imm) {
    std::atomic<int> landed{kDonePending};
    engine_->expect_imm_count(imm, 1, OnDone::flag(&landed));
    if (!wait_until([&] { return landed.load() != kDonePending; }, std::chrono::seconds(30))) return "no immediate";
    if (landed.load() != kDoneSucceeded) return "expectation failed";
    auto want = pattern(1 - side_, k);
    if (!std::equal(want.begin(), want.end(), dst_.begin() + static_cast<long>(k * kSlot))) return "bytes differ";
    return "ok";
  }

 private:
  struct Write {
    bool ended = false;
    Status status;
    Clock::time_point submitted;
    double took = 0;
  };
  int side_;
  std::unique_ptr<TransferEngine> engine_;
  std::vector<uint8_t> dst_, src_;
  MrDesc dst_desc_, peer_;
  MrHandle src_h_;
  std::mutex mu_;
  std::map<uint32_t, Write> writes_;
};

TEST(Verbs, TransientLossRecoversWritesInBothDirections) {
  FABRIC_SKIP_WITHOUT_DEVICE(kVerbs);
  std::vector<LinkEnd> link = link_devices();
  if (link.size() != 2) GTEST_SKIP() << "no FABRIC_LINK_DEVICES (the rxe VM sets up a veth pair: tests/rxe)";
  // B serves commands from A over the channel: "submit k imm", "wait k", "check k imm", "quit".
  auto b = [&](Channel& ch) {
    LinkSide me(link[1].device, 1);
    ch.send(me.my_desc());
    me.set_peer(ch.recv_bytes());
    for (;;) {
      std::string cmd = ch.recv();
      unsigned k = 0, imm = 0;
      if (std::sscanf(cmd.c_str(), "submit %u %u", &k, &imm) == 2) {
        me.submit(k, imm);
        ch.send("ok");
      } else if (std::sscanf(cmd.c_str(), "wait %u", &k) == 1) {
        ch.send(me.wait(k));
      } else if (std::sscanf(cmd.c_str(), "check %u %u", &k, &imm) == 2) {
        ch.send(me.check(k, imm));
      } else {
        break;
      }
    }
    return role_result();
  };
  auto a = [&](Channel& ch) {
    LinkSide me(link[0].device, 0);
    me.set_peer(ch.recv_bytes());
    ch.send(me.my_desc());
    auto b_do = [&](const std::string& cmd) {
      ch.send(cmd);
      return ch.recv();
    };
    uint32_t slot = 0;
    // Both directions work, every byte checked: A's slot k lands in B's slot k and the other way.
    auto both_directions = [&](const char* when) {
      SCOPED_TRACE(when);
      uint32_t k = slot++;
      me.submit(k, 100 + k);
      EXPECT_EQ(me.wait(k).substr(0, 2), "ok");
      EXPECT_EQ(b_do(fmt::format("check {} {}", k, 100 + k)), "ok");
      EXPECT_EQ(b_do(fmt::format("submit {} {}", k, 200 + k)), "ok");
      EXPECT_EQ(b_do(fmt::format("wait {}", k)).substr(0, 2), "ok");
      EXPECT_EQ(me.check(k, 200 + k), "ok");
    };
    both_directions("before the fault");
    // Round 1: only A writes into the outage, so only A's queue pairs fail; B must accept A's new
    // connection. Round 2: both write, both fail, both reconnect at once.
    for (int round = 1; round <= 2; round++) {
      SCOPED_TRACE("round " + std::to_string(round));
      bool b_writes = round == 2;
      if (!set_loss(link, true)) {
        ADD_FAILURE() << "tc netem failed";
        ch.send("quit");
        return 1;
      }
      auto loss_start = Clock::now();
      uint32_t k = slot++;
      me.submit(k, 100 + k);
      if (b_writes) {
        EXPECT_EQ(b_do(fmt::format("submit {} {}", k, 200 + k)), "ok");
      }
      std::string ra = me.wait(k);  // the RC retries run out
      EXPECT_EQ(ra.substr(0, 5), "error") << ra;
      EXPECT_NE(ra.find("retry"), std::string::npos) << ra;
      double failed_after = seconds_since(loss_start);
      if (b_writes) {
        std::string rb = b_do(fmt::format("wait {}", k));
        EXPECT_EQ(rb.substr(0, 5), "error") << rb;
      }
      // Writes submitted during the outage wait for the new connection, then go.
      uint32_t w = slot++;
      me.submit(w, 100 + w);
      if (b_writes) {
        EXPECT_EQ(b_do(fmt::format("submit {} {}", w, 200 + w)), "ok");
      }
      std::this_thread::sleep_for(milliseconds(1500));
      if (!set_loss(link, false)) {
        ADD_FAILURE() << "tc netem failed";
        ch.send("quit");
        return 1;
      }
      double outage = seconds_since(loss_start);
      auto healed = Clock::now();
      std::string rw = me.wait(w);
      double recovered_after = seconds_since(healed);
      EXPECT_EQ(rw.substr(0, 2), "ok") << rw;
      EXPECT_EQ(b_do(fmt::format("check {} {}", w, 100 + w)), "ok");
      if (b_writes) {
        std::string rb = b_do(fmt::format("wait {}", w));
        EXPECT_EQ(rb.substr(0, 2), "ok") << rb;
        EXPECT_EQ(me.check(w, 200 + w), "ok");
      }
      both_directions("after the fault");
      std::printf("transient loss, round %d (%s): 100%% loss for %.2f s; the write in flight failed after "
                  "%.2f s; the write submitted during the outage completed %.2f s after the link came back\n",
                  round, b_writes ? "both sides writing" : "one side writing", outage, failed_after,
                  recovered_after);
      EXPECT_LT(recovered_after, 5.0);
    }
    ch.send("quit");
    return role_result();
  };
  auto r = tools::run_process_pair(a, b);
  set_loss(link, false);  // in case a failed check left it on
  EXPECT_TRUE(r.ok()) << "A rc " << r.parent_rc << ", B status " << r.child_status;
}

// ---- peer removal and a late peer, on the Domain itself ----------------------------------------

// Two verbs domains of this process (two NICs on one device) driven by hand: posts, polls, and
// every completion accounted for.
class DomainPair {
 public:
  static constexpr uint64_t kLen = 64 << 10;
  explicit DomainPair(const EngineConfig& cfg) : a(open_domain(cfg, 0)), b(open_domain(cfg, 1)) {
    src.resize(kLen * 64);
    for (size_t i = 0; i < src.size(); i++) src[i] = static_cast<uint8_t>(i * 13 + 7);
    dst.assign(kLen * 64, 0);
    src_a = a->register_memory(src.data(), src.size(), Device::host());
    dst_a = a->register_memory(dst.data(), dst.size(), Device::host());  // for b -> a
    src_b = b->register_memory(src.data(), src.size(), Device::host());
    dst_b = b->register_memory(dst.data(), dst.size(), Device::host());
  }
  ~DomainPair() {
    for (DomainRegion* r : {&src_a, &dst_a}) a->deregister_memory(*r);
    for (DomainRegion* r : {&src_b, &dst_b}) b->deregister_memory(*r);
  }

  // Polls both; completions of `from` go to done (kLocal/kError), immediates of `to` are counted.
  void poll() {
    Completion cs[64];
    for (Domain* d : {a.get(), b.get()}) {
      size_t n = d->poll(cs);
      for (size_t i = 0; i < n; i++) {
        const Completion& c = cs[i];
        if (c.kind == Completion::Kind::kRemoteImm) {
          imms[c.imm]++;
        } else {
          EXPECT_TRUE(done.emplace(c.context, c).second) << "a context completed twice";
        }
      }
    }
  }

  // Posts slot k of src from `from` to `to`'s dst slot k, with immediate `imm`; polls through
  // kRetry/kRetryPeer for up to `patience`. Returns the last PostResult.
  PostResult post(Domain& from, PeerId peer, const DomainRegion& src_r, const DomainRegion& dst_r, uint32_t k,
                  uint32_t imm, OpContext* ctx, milliseconds patience = milliseconds(20000)) {
    WriteOp op;
    op.src = src.data() + k * kLen;
    op.len = kLen;
    op.desc = src_r.desc;
    op.peer = peer;
    op.remote_addr = dst_r.remote.base + k * kLen;
    op.rkey = dst_r.remote.rkey;
    op.has_imm = true;
    op.imm = imm;
    auto deadline = Clock::now() + patience;
    PostResult r;
    while ((r = from.post_write(op, ctx)) == PostResult::kRetry || r == PostResult::kRetryPeer) {
      if (Clock::now() > deadline) break;
      poll();
      usleep(100);
    }
    return r;
  }
  // A write that must land: posted, completed without error, immediate counted, bytes equal.
  void write_ok(Domain& from, PeerId peer, bool a_to_b, uint32_t k) {
    OpContext ctx;
    uint32_t imm = 0x1000 + k;
    ASSERT_EQ(post(from, peer, a_to_b ? src_a : src_b, a_to_b ? dst_b : dst_a, k, imm, &ctx), PostResult::kPosted)
        << from.last_error();
    EXPECT_TRUE(wait_for([&] { return done.count(&ctx) && imms[imm] == 1; }));
    ASSERT_TRUE(done.count(&ctx));
    EXPECT_EQ(done[&ctx].kind, Completion::Kind::kLocal) << done[&ctx].error;
    EXPECT_EQ(std::memcmp(dst.data() + k * kLen, src.data() + k * kLen, kLen), 0) << "slot " << k;
    done.erase(&ctx);
  }
  bool wait_for(const std::function<bool()>& cond, milliseconds limit = milliseconds(20000)) {
    auto deadline = Clock::now() + limit;
    while (!cond()) {
      if (Clock::now() > deadline) return false;
      poll();
      usleep(100);
    }
    return true;
  }

  std::unique_ptr<Domain> a, b;
  std::vector<uint8_t> src, dst;
  DomainRegion src_a, dst_a, src_b, dst_b;
  std::map<OpContext*, Completion> done;
  std::map<uint32_t, int> imms;
};

// This process's RC queue pairs on the device, as `rdma resource show qp` lists them; -1 if the
// tool is missing.
int rc_qps_of_this_process() {
  std::string cmd = "rdma resource show qp 2>/dev/null";
  FILE* f = popen(cmd.c_str(), "r");
  if (!f) return -1;
  std::string pid = "pid " + std::to_string(getpid()) + " ";
  int n = 0, lines = 0;
  char line[512];
  while (std::fgets(line, sizeof line, f)) {
    lines++;
    std::string l = line;
    if (l.find("type RC") != std::string::npos && l.find(pid) != std::string::npos) n++;
  }
  int rc = pclose(f);
  return rc == 0 && lines > 0 ? n : -1;
}

TEST(Verbs, RemovePeerReleasesItsQueuePairsAndTheAddressConnectsAgain) {
  FABRIC_SKIP_WITHOUT_DEVICE(kVerbs);
  EngineConfig cfg = config_for(ProviderCase{"verbs", 2, false});
  short_rc_budget(cfg);
  DomainPair d(cfg);
  int qps0 = rc_qps_of_this_process();
  PeerId pa = d.a->insert_peer(d.b->address());
  d.write_ok(*d.a, pa, true, 0);
  PeerId pb = d.b->insert_peer(d.a->address());  // b knows a from its handshake
  d.write_ok(*d.b, pb, false, 1);
  if (qps0 >= 0) {
    EXPECT_EQ(rc_qps_of_this_process(), qps0 + 4) << "two RC queue pairs per side";
  }

  // Writes in flight when the peer is removed come back once each, success or error.
  constexpr uint32_t kInFlight = 48;
  std::vector<OpContext> ctxs(kInFlight);
  for (uint32_t i = 0; i < kInFlight; i++)
    ASSERT_EQ(d.post(*d.a, pa, d.src_a, d.dst_b, 2 + i % 8, 0x2000 + i, &ctxs[i]), PostResult::kPosted);
  d.a->remove_peer(pa);
  d.a->remove_peer(pa);  // unknown now: ignored
  EXPECT_TRUE(d.wait_for([&] {
    for (auto& c : ctxs)
      if (!d.done.count(&c)) return false;
    return true;
  })) << "every write posted before remove_peer completes";
  size_t errors = 0;
  for (auto& c : ctxs) errors += d.done[&c].kind == Completion::Kind::kError;
  std::printf("remove_peer with %u WRITEs posted: %zu completed, %zu failed\n", kInFlight, kInFlight - errors, errors);
  if (qps0 >= 0) {
    EXPECT_TRUE(d.wait_for([&] { return rc_qps_of_this_process() == qps0 + 2; }, milliseconds(5000)))
        << "a's two queue pairs are destroyed once their requests are back; " << rc_qps_of_this_process() - qps0
        << " left";
  }
  OpContext stale;
  EXPECT_EQ(d.post(*d.a, pa, d.src_a, d.dst_b, 0, 1, &stale), PostResult::kFailed);
  EXPECT_NE(d.a->last_error().find("not known"), std::string::npos) << d.a->last_error();

  // The same address again: a new id, a working peer; b, still connected to a's old queue pairs,
  // replaces them (a's new connection supersedes its epoch), and b -> a works too.
  auto t = Clock::now();
  PeerId pa2 = d.a->insert_peer(d.b->address());
  EXPECT_NE(pa2, pa);
  d.write_ok(*d.a, pa2, true, 10);
  d.write_ok(*d.b, pb, false, 11);
  std::printf("re-inserted peer: writes both ways %.3f s after insert_peer\n", seconds_since(t));
  EXPECT_EQ(d.b->insert_peer(d.a->address()), pb) << "b's id for a stays stable";
  if (qps0 >= 0) {
    EXPECT_TRUE(d.wait_for([&] { return rc_qps_of_this_process() == qps0 + 4; }, milliseconds(5000)))
        << "b's old queue pairs destroyed after its reconnection; " << rc_qps_of_this_process() - qps0 << " now";
  }

  // The freed slot goes to the next new peer; the old id must not reach it.
  d.a->remove_peer(pa2);
  std::unique_ptr<Domain> c = open_domain(cfg, 0);
  PeerId pc = d.a->insert_peer(c->address());
  EXPECT_NE(pc, pa);
  EXPECT_NE(pc, pa2);
  EXPECT_EQ(d.post(*d.a, pa2, d.src_a, d.dst_b, 0, 1, &stale), PostResult::kFailed);
  d.wait_for([&] { return false; }, milliseconds(200));  // drain what remove_peer left
}

TEST(Verbs, BackPressureIsPerPeer) {
  FABRIC_SKIP_WITHOUT_DEVICE(kVerbs);
  EngineConfig cfg = config_for(ProviderCase{"verbs", 2, false});
  short_rc_budget(cfg);
  DomainPair d(cfg);
  std::unique_ptr<Domain> c = open_domain(cfg, 0);
  DomainRegion dst_c = c->register_memory(d.dst.data(), d.dst.size(), Device::host());
  auto poll_c = [&] {
    Completion cs[16];
    c->poll(cs);
  };
  PeerId pc = d.a->insert_peer(c->address());
  WriteOp small;
  small.src = d.src.data();
  small.len = 64;
  small.desc = d.src_a.desc;
  small.remote_addr = dst_c.remote.base;
  small.rkey = dst_c.remote.rkey;
  small.peer = pc;
  // Connect a -> c.
  OpContext first;
  PostResult r;
  auto t = Clock::now();
  while ((r = d.a->post_write(small, &first)) != PostResult::kPosted && seconds_since(t) < 20) {
    EXPECT_EQ(r, PostResult::kRetryPeer) << "a handshake under way holds back only its peer";
    d.poll();
    poll_c();
  }
  ASSERT_EQ(r, PostResult::kPosted);
  ASSERT_TRUE(d.wait_for([&] {
    poll_c();
    return d.done.count(&first) > 0;
  }));

  // b is new: its handshake runs (kRetryPeer for b), and c still takes work meanwhile.
  PeerId pb = d.a->insert_peer(d.b->address());
  WriteOp to_b = small;
  to_b.peer = pb;
  to_b.remote_addr = d.dst_b.remote.base;
  to_b.rkey = d.dst_b.remote.rkey;
  OpContext ob, oc;
  EXPECT_EQ(d.a->post_write(to_b, &ob), PostResult::kRetryPeer);
  EXPECT_EQ(d.a->post_write(small, &oc), PostResult::kPosted) << d.a->last_error();
  d.write_ok(*d.a, pb, true, 5);

  // b's queue pair full (nothing polled): kRetryPeer for b, and c still takes work.
  std::vector<OpContext> ctxs(2048);
  size_t posted = 0;
  while (posted < ctxs.size() && (r = d.a->post_write(to_b, &ctxs[posted])) == PostResult::kPosted) posted++;
  EXPECT_EQ(r, PostResult::kRetryPeer) << "after " << posted << " posts: " << d.a->last_error();
  EXPECT_GE(posted, 64u);
  OpContext oc2;
  EXPECT_EQ(d.a->post_write(small, &oc2), PostResult::kPosted) << "c must not wait for b's queue pair";
  std::printf("per-peer back-pressure: b's queue pair took %zu WRITEs, then %s; c still took work\n", posted,
              r == PostResult::kRetryPeer ? "kRetryPeer" : "another result");
  EXPECT_TRUE(d.wait_for([&] {
    poll_c();
    for (size_t i = 0; i < posted; i++)
      if (!d.done.count(&ctxs[i])) return false;
    return d.done.count(&oc) && d.done.count(&oc2);
  }));
  for (size_t i = 0; i < posted; i++) EXPECT_EQ(d.done[&ctxs[i]].kind, Completion::Kind::kLocal);
  c->deregister_memory(dst_c);
}

TEST(Verbs, APeerThatAnswersAfterTheHandshakeTimeoutIsReachedLater) {
  FABRIC_SKIP_WITHOUT_DEVICE(kVerbs);
  EngineConfig cfg = config_for(ProviderCase{"verbs", 2, false});
  short_rc_budget(cfg);
  cfg.verbs.handshake_timeout = milliseconds(400);
  cfg.verbs.reconnect_backoff = milliseconds(600);
  DomainPair d(cfg);
  PeerId pa = d.a->insert_peer(d.b->address());
  // b is not polled: it reads no handshake message, a's handshake times out.
  OpContext ctx;
  auto t = Clock::now();
  PostResult r;
  while ((r = d.post(*d.a, pa, d.src_a, d.dst_b, 0, 7, &ctx, milliseconds(0))) != PostResult::kFailed &&
         seconds_since(t) < 10) {
    Completion cs[8];
    d.a->poll(cs);
    usleep(100);
  }
  ASSERT_EQ(r, PostResult::kFailed);
  double failed_after = seconds_since(t);
  EXPECT_NE(d.a->last_error().find("handshake"), std::string::npos) << d.a->last_error();
  EXPECT_EQ(d.post(*d.a, pa, d.src_a, d.dst_b, 0, 7, &ctx, milliseconds(0)), PostResult::kFailed)
      << "within reconnect_backoff, posts fail at once";
  // Now b answers (it reads a's queued messages); a connects, by b's message or by its next post
  // after the backoff, and the same PeerId works.
  t = Clock::now();
  while (d.post(*d.a, pa, d.src_a, d.dst_b, 0, 7, &ctx, milliseconds(0)) == PostResult::kFailed &&
         seconds_since(t) < 5)
    d.wait_for([] { return false; }, milliseconds(1));  // polls both
  d.write_ok(*d.a, pa, true, 3);
  std::printf("late peer: a's handshake failed after %.2f s; once the peer answered, a write landed %.2f s later\n",
              failed_after, seconds_since(t));
}

}  // namespace
}  // namespace fabric::testing
