// An engine on shm outlives a peer SIGKILLed with WRITEs in flight: the transfers to the dead peer
// end in bounded time, and the same engine then writes to a live peer that was written to during
// the kill, to a peer that starts after it, and to itself, every byte checked.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "fabric/fabric.h"
#include "process_pair.h"
#include "test_support.h"

namespace fabric::testing {
namespace {

using tools::Channel;
using tools::spawn_child;
using Clock = std::chrono::steady_clock;

constexpr uint64_t kPage = 16 << 10;  // above shm's 4 KiB inject size: each WRITE waits for an answer
constexpr uint32_t kLivePages = 33;

EngineConfig shm_config(size_t nics) {
  EngineConfig cfg = config_for(ProviderCase{"shm", nics, false});
  cfg.transfer_timeout = std::chrono::seconds(2);
  cfg.worker_stall_timeout = std::chrono::seconds(20);
  // Everything is posted at once: the dead peer's WRITEs are all with shm when it dies, and the
  // live peer's are queued behind them in the sending endpoint.
  cfg.max_in_flight_per_nic = 4096;
  return cfg;
}

// How the victim dies.
enum class Death {
  kWorking,      // killed while it works through our WRITEs (it may answer some with errors)
  kUnprocessed,  // killed with our WRITEs queued that it never looked at: no answer ever comes
};

struct Case {
  size_t nics;
  Death death;
};

// The victim: a region for the survivor to write to, then nothing until it is killed. kUnprocessed:
// its worker stops polling after its first post (the fault wrapper's wedge), so shm never
// processes what arrives, as in a process that is descheduled or busy elsewhere when it dies.
int victim_role(Channel& ch, const Case& c) {
  EngineConfig cfg = shm_config(c.nics);
  if (c.death == Death::kUnprocessed) {
    cfg.faults.enabled = true;
    cfg.faults.wedge_after_posts = 1;
  }
  TransferEngine engine(cfg);
  std::vector<uint8_t> dst(kPage * 16, 0), mine(64, 0);
  auto [h, d] = engine.reg_mr(dst.data(), dst.size());
  auto [mh, md] = engine.reg_mr(mine.data(), mine.size());
  const RemoteMr self = engine.add_remote(md);
  ch.send(d.to_bytes());
  ch.send(std::to_string(getpid()));
  if (ch.recv() != "stop") return 1;  // after the survivor's warm-up
  if (c.death == Death::kUnprocessed)
    engine.submit(SingleWrite{.len = 8, .src = {mh, 0}, .dst = {self, 8}}, OnDone::none());
  ch.send("stopped");
  ch.recv();  // never answered: killed here
  return 0;
}

// A live peer: each round ("<seed> <ms>"), a region of kLivePages pages is written with an
// immediate per page; within <ms> it reports whether the bytes are the survivor's (seeded) pattern.
int live_role(Channel& ch, size_t nics) {
  if (ch.recv() != "start") return 1;
  TransferEngine engine(shm_config(nics));
  auto imms = engine.reserve_imms({.holder = "dead-peer-test", .bits = 8});
  std::vector<uint8_t> dst(kPage * kLivePages, 0);
  auto [h, d] = engine.reg_mr(dst.data(), dst.size(), Device::host(), imms);
  ch.send(d.to_bytes());
  for (;;) {
    std::string cmd = ch.recv();
    if (cmd == "done") return role_result();
    const uint32_t seed = static_cast<uint32_t>(std::stoul(cmd));
    const auto wait = std::chrono::milliseconds(std::stoul(cmd.substr(cmd.find(' ') + 1)));
    std::fill(dst.begin(), dst.end(), 0);
    ch.send("cleared");
    std::atomic<int> landed{kDonePending};
    imms.expect(1, kLivePages, OnDone::flag(&landed));
    const bool arrived = wait_until([&] { return landed.load() != kDonePending; }, wait);
    const bool same = dst == random_bytes(dst.size(), seed);
    imms.discard(1);
    ch.send(arrived && landed.load() == kDoneSucceeded && same ? "ok" : arrived ? "wrong bytes" : "nothing arrived");
  }
}

struct Outcome {
  std::atomic<uint32_t> ok{0}, failed{0};
  std::mutex mu;
  std::vector<std::string> errors;
  OnDone on_done() {
    return OnDone::callback([this](const Status& s) {
      if (s.ok()) {
        ok++;
        return;
      }
      std::lock_guard l(mu);
      errors.push_back(s.message());
      failed++;
    });
  }
  uint32_t ended() const { return ok.load() + failed.load(); }
};

// The survivor writes kLivePages pages of `seed`'s pattern to a live peer and asks it to check.
std::string write_live(TransferEngine& engine, Channel& ch, const MrHandle& src, RemoteMr dst,
                       uint32_t seed, Outcome& out) {
  ch.send(std::to_string(seed) + " 30000");
  EXPECT_EQ(ch.recv(), "cleared");
  std::vector<uint32_t> idx(kLivePages);
  for (uint32_t i = 0; i < kLivePages; i++) idx[i] = i;
  engine.submit(PagedWrites{.page_len = kPage, .src = src, .src_pages = Pages{idx, kPage, 0}, .dst = dst, .dst_pages = Pages{idx, kPage, 0}, .imm = 1},
                out.on_done());
  return ch.recv();
}

class ShmDeadPeer : public ::testing::TestWithParam<Case> {};

TEST_P(ShmDeadPeer, WritesToLivePeersSucceedAfterAPeerIsKilledWithWritesInFlight) {
  const Case c = GetParam();
  const size_t nics = c.nics;
  tools::ChildProcess victim = spawn_child([&](Channel& ch) { return victim_role(ch, c); });
  tools::ChildProcess early = spawn_child([&](Channel& ch) { return live_role(ch, nics); });
  tools::ChildProcess late = spawn_child([&](Channel& ch) { return live_role(ch, nics); });  // starts after the kill
  early.ch.send("start");

  {
    TransferEngine engine(shm_config(nics));
    // Source: kLivePages pages; the pattern of each round is written into it before the round.
    std::vector<uint8_t> src(kPage * kLivePages);
    auto [h, hd] = engine.reg_mr(src.data(), src.size());
    auto fill = [&](uint32_t seed) {  // in place: the registered buffer stays where it is
      const auto bytes = random_bytes(src.size(), seed);
      std::copy(bytes.begin(), bytes.end(), src.begin());
    };

    const RemoteMr victim_dst = engine.add_remote(MrDesc::from_bytes(victim.ch.recv_bytes()));
    EXPECT_EQ(std::stoi(victim.ch.recv()), victim.pid);
    const RemoteMr early_dst = engine.add_remote(MrDesc::from_bytes(early.ch.recv_bytes()));

    // Every peer reached once before the kill.
    fill(11);
    Outcome warm;
    EXPECT_EQ(write_live(engine, early.ch, h, early_dst, 11, warm), "ok");
    std::vector<uint32_t> vidx(32), vdst(32);
    for (uint32_t i = 0; i < 32; i++) vidx[i] = i, vdst[i] = i % 16;
    engine.submit(PagedWrites{.page_len = kPage, .src = h, .src_pages = Pages{vidx, kPage, 0}, .dst = victim_dst, .dst_pages = Pages{vdst, kPage, 0}},
                  warm.on_done());
    EXPECT_TRUE(wait_until([&] { return warm.ended() == 2; }));
    EXPECT_EQ(warm.ok.load(), 2u);
    victim.ch.send("stop");
    EXPECT_EQ(victim.ch.recv(), "stopped");
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // kUnprocessed: its worker stops

    // The kill: 64 x 32 pages to the victim (32 MiB: more than it can copy before the kill, even
    // on a loaded machine, and more than its command queue holds, so some wait with us) and 33
    // pages to the live peer among them; the victim dies while it works through them.
    fill(12);
    Outcome to_victim, during;
    early.ch.send("12 2000");  // a lost transfer's pages may never all arrive
    EXPECT_EQ(early.ch.recv(), "cleared");
    constexpr uint32_t kVictimTransfers = 64;
    for (uint32_t t = 0; t < kVictimTransfers; t++) {
      // With an immediate: shm then hands each WRITE to the victim and waits for its answer (a
      // WRITE without one is copied by us, and fails at once when the victim is gone).
      engine.submit(PagedWrites{.page_len = kPage, .src = h, .src_pages = Pages{vidx, kPage, 0}, .dst = victim_dst, .dst_pages = Pages{vdst, kPage, 0}, .imm = 5},
                    to_victim.on_done());
      if (t == kVictimTransfers / 2) {
        std::vector<uint32_t> idx(kLivePages);
        for (uint32_t i = 0; i < kLivePages; i++) idx[i] = i;
        engine.submit(PagedWrites{.page_len = kPage, .src = h, .src_pages = Pages{idx, kPage, 0}, .dst = early_dst, .dst_pages = Pages{idx, kPage, 0}, .imm = 1},
                      during.on_done());
      }
    }
    ASSERT_EQ(kill(victim.pid, SIGKILL), 0);
    const Clock::time_point killed = Clock::now();  // left a zombie until the end: still "a process"

    // Every transfer of the round ends, in bounded time (the 2 s transfer timeout, with room for
    // a loaded machine).
    EXPECT_TRUE(wait_until([&] { return to_victim.ended() == kVictimTransfers && during.ended() == 1; },
                           std::chrono::seconds(20)))
        << to_victim.ended() << " of " << kVictimTransfers << " to the victim ended, "
        << during.ended() << " of 1 to the live peer";
    const double ended_s = std::chrono::duration<double>(Clock::now() - killed).count();
    EXPECT_GT(to_victim.failed.load(), 0u) << "the victim died: some of its transfers must fail";
    // The live peer's transfer of that round either landed, or failed saying why; never garbage.
    const std::string during_check = early.ch.recv();
    if (during.ok.load() == 1) {
      EXPECT_EQ(during_check, "ok");
    } else {
      std::lock_guard l(during.mu);
      ASSERT_FALSE(during.errors.empty());
      EXPECT_NE(during.errors[0].find("shm"), std::string::npos) << during.errors[0];
    }
    std::printf("transfers of the kill round ended %.2f s after the kill: victim %u ok / %u failed, "
                "live peer %s\n",
                ended_s, to_victim.ok.load(), to_victim.failed.load(),
                during.ok.load() ? "ok" : "failed");

    // The same engine: the live peer written to during the kill, three rounds.
    for (uint32_t seed = 20; seed < 23; seed++) {
      fill(seed);
      Outcome after;
      EXPECT_EQ(write_live(engine, early.ch, h, early_dst, seed, after), "ok") << "round " << seed;
      EXPECT_TRUE(wait_until([&] { return after.ended() == 1; }, std::chrono::seconds(20)));
      EXPECT_EQ(after.ok.load(), 1u) << (after.errors.empty() ? "" : after.errors[0]);
    }
    // A peer that starts after the kill.
    late.ch.send("start");
    const RemoteMr late_dst = engine.add_remote(MrDesc::from_bytes(late.ch.recv_bytes()));
    fill(30);
    Outcome fresh;
    EXPECT_EQ(write_live(engine, late.ch, h, late_dst, 30, fresh), "ok");
    EXPECT_TRUE(wait_until([&] { return fresh.ended() == 1; }, std::chrono::seconds(20)));
    EXPECT_EQ(fresh.ok.load(), 1u) << (fresh.errors.empty() ? "" : fresh.errors[0]);
    // Ourselves.
    expect_write_to_self_works(engine, h, src, nics);

    // The dead peer again: refused or failed in bounded time, never a hang.
    Outcome again;
    try {
      engine.submit(PagedWrites{.page_len = kPage, .src = h, .src_pages = Pages{vidx, kPage, 0}, .dst = victim_dst, .dst_pages = Pages{vdst, kPage, 0}},
                    again.on_done());
      EXPECT_TRUE(wait_until([&] { return again.ended() == 1; }, std::chrono::seconds(20)));
      EXPECT_EQ(again.failed.load(), 1u);
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("shm"), std::string::npos) << e.what();
    }
    EXPECT_NO_THROW(engine.peer_count()) << "the worker is not stuck inside shm";
    early.ch.send("done");
    late.ch.send("done");
  }
  int status = tools::reap(victim.pid);
  EXPECT_TRUE(WIFSIGNALED(status));
  EXPECT_EQ(tools::reap(early.pid), 0) << "the early live peer's checks";
  EXPECT_EQ(tools::reap(late.pid), 0) << "the late live peer's checks";
}

INSTANTIATE_TEST_SUITE_P(
    Shm, ShmDeadPeer,
    ::testing::Values(Case{1, Death::kWorking}, Case{2, Death::kWorking}, Case{1, Death::kUnprocessed},
                      Case{2, Death::kUnprocessed}),
    [](const auto& info) {
      return "shm_" + std::to_string(info.param.nics) + "nic_" +
             (info.param.death == Death::kWorking ? "working" : "unprocessed");
    });

}  // namespace
}  // namespace fabric::testing
