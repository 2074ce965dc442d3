// Reliability through the public API: injected faults (refused posts, error completions, stuck
// operations, duplicated and delayed immediates), deregistration with transfers in flight, and a
// peer that dies and comes back at a new address. Every transfer must end exactly once, with the
// right kind of error; every immediate that arrives must be counted once; nothing else may suffer.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstring>
#include <map>
#include <mutex>

#include "fabric/fabric.h"
#include "process_pair.h"
#include "test_support.h"

namespace fabric::testing {
namespace {

using tools::Channel;

class Faults : public ::testing::TestWithParam<ProviderCase> {};

// Two rounds: the second is submitted after every transfer of the first has ended, so it only
// runs if the stuck operations of the first (more than a NIC's in-flight limit) did not keep
// that NIC's budget.
constexpr uint32_t kFirstRound = 500, kSecondRound = 100;
constexpr uint32_t kTransfers = kFirstRound + kSecondRound;
constexpr uint64_t kLen = 4096 + 7;  // one WRITE per transfer on any NIC count (<= 32 KiB)
constexpr uint64_t kSlot = 8192;
constexpr uint32_t kImmBase = 0x10000;

// What happened to transfer i, as the sender saw it; sent to the receiver as one letter each:
// o ok, p refused at post, e error completion, t timed out (stuck), q timed out before its WRITE
// was posted (queued behind stuck operations: like p, nothing was sent).
char classify(const Status& s) {
  if (s.ok()) return 'o';
  if (s.code() == ErrorCode::kTimeout) return s.message().find("(0 of 1 WRITEs posted") != std::string::npos ? 'q' : 't';
  if (s.message().find("refused at post time") != std::string::npos) return 'p';
  if (s.message().find("injected fault: completion error") != std::string::npos) return 'e';
  return '?';
}

TEST_P(Faults, EveryTransferEndsOnceAndEveryArrivingImmediateIsCountedOnce) {
  const ProviderCase pc = GetParam();
  FABRIC_SKIP_WITHOUT_DEVICE(pc);

  auto receiver = [&](Channel& ch) {
    EngineConfig cfg = config_for(pc);
    cfg.faults = FaultConfig{true, 9, 0, 0, 0, /*duplicate_imm=*/0.05, /*delay_imm=*/0.2, 200, {}};
    std::vector<uint8_t> dst(kSlot * kTransfers, 0);
    TransferEngine engine(cfg);
    auto [h, d] = engine.reg_mr(dst.data(), dst.size());
    ch.send(d.to_bytes());
    std::string fates = ch.recv();
    EXPECT_EQ(fates.size(), kTransfers);
    uint64_t posted = 0;
    auto sent = [](char fate) { return fate != 'p' && fate != 'q'; };
    for (char f : fates) posted += sent(f);

    auto totals = [&] {
      NicStats sum;
      for (auto& s : engine.nic_stats()) {
        sum.imms_received += s.imms_received;
        sum.imms_duplicated += s.imms_duplicated;
        sum.faults_injected += s.faults_injected;
      }
      return sum;
    };
    // Every WRITE that was handed to the provider lands (error completions and stuck operations
    // are injected at the sender after the WRITE went out), however late its immediate is.
    EXPECT_TRUE(wait_until([&] {
      NicStats t = totals();
      return t.imms_received - t.imms_duplicated >= posted;
    })) << "arrived " << totals().imms_received << ", expected " << posted << " + duplicates";
    std::this_thread::sleep_for(std::chrono::milliseconds(300));  // nothing more may come
    NicStats t = totals();
    std::fprintf(stderr, "receiver: %lu WRITEs posted to it, %lu immediates counted, %lu duplicated, %lu faults injected\n",
                 static_cast<unsigned long>(posted), static_cast<unsigned long>(t.imms_received),
                 static_cast<unsigned long>(t.imms_duplicated), static_cast<unsigned long>(t.faults_injected));
    EXPECT_EQ(t.imms_received - t.imms_duplicated, posted);
    EXPECT_GT(t.imms_duplicated, 0u);
    EXPECT_GT(t.faults_injected, t.imms_duplicated) << "delays were injected too";

    auto src = random_bytes(kSlot * kTransfers, 17);
    uint64_t counted = 0;
    size_t bad_data = 0, lost = 0, phantom = 0;
    for (uint32_t i = 0; i < kTransfers; i++) {
      uint64_t n = engine.imm_count(kImmBase + i);
      counted += n;
      bool wrote = std::memcmp(dst.data() + i * kSlot, src.data() + i * kSlot, kLen) == 0;
      if (!sent(fates[i])) {
        phantom += n != 0;
        bad_data += std::any_of(dst.begin() + i * kSlot, dst.begin() + i * kSlot + kLen, [](uint8_t b) { return b != 0; });
      } else {
        lost += n == 0;
        bad_data += !wrote;
      }
    }
    EXPECT_EQ(counted, t.imms_received) << "every arrival is counted exactly once, in its own counter";
    EXPECT_EQ(lost, 0u) << "a posted WRITE's immediate never arrived";
    EXPECT_EQ(phantom, 0u) << "an immediate arrived for a WRITE that was never posted";
    EXPECT_EQ(bad_data, 0u);
    ch.send("verified");
    return role_result();
  };

  auto sender = [&](Channel& ch) {
    EngineConfig cfg = config_for(pc);
    cfg.faults = FaultConfig{true, 7, /*post_failure=*/0.03, /*completion_error=*/0.03, /*stuck=*/0.03, 0, 0, 0, {}};
    cfg.transfer_timeout = std::chrono::milliseconds(1500);
    // Fewer stuck operations than this would block a NIC for good if the engine did not release
    // the in-flight budget of timed-out transfers.
    cfg.max_in_flight_per_nic = 4;
    TransferEngine engine(cfg);
    auto src = random_bytes(kSlot * kTransfers, 17);
    auto [h, d] = engine.reg_mr(src.data(), src.size());
    MrDesc dst = MrDesc::from_bytes(ch.recv_bytes());
    std::vector<Status> statuses(kTransfers);
    std::vector<std::atomic<int>> calls(kTransfers);
    std::atomic<uint32_t> ended{0};
    auto submit = [&](uint32_t i) {
      engine.submit(SingleWrite{.len = kLen, .src = {h, i * kSlot}, .dst = {engine.add_remote(dst), i * kSlot}, .imm = kImmBase + i},
                    OnDone::callback([&, i](const Status& s) {
                                   if (calls[i]++ == 0) statuses[i] = s;
                                   ended++;
                                 }));
    };
    for (uint32_t i = 0; i < kFirstRound; i++) submit(i);
    EXPECT_TRUE(wait_until([&] { return ended.load() >= kFirstRound; })) << ended.load();
    for (uint32_t i = kFirstRound; i < kTransfers; i++) submit(i);
    EXPECT_TRUE(wait_until([&] { return ended.load() >= kTransfers; })) << ended.load();
    size_t second_ok = 0;
    for (uint32_t i = kFirstRound; i < kTransfers; i++) second_ok += statuses[i].ok();
    EXPECT_GT(second_ok, kSecondRound / 2) << "the NIC stopped serving after stuck operations";
    std::this_thread::sleep_for(std::chrono::milliseconds(200));  // a second report would show now
    std::string fates;
    std::map<char, size_t> by_fate;
    for (uint32_t i = 0; i < kTransfers; i++) {
      EXPECT_EQ(calls[i].load(), 1) << "transfer " << i << " reported " << calls[i].load() << " times";
      fates += classify(statuses[i]);
      by_fate[fates.back()]++;
      if (fates.back() == '?') ADD_FAILURE() << "transfer " << i << ": unexpected " << statuses[i].message();
    }
    std::fprintf(stderr, "fates: ok %zu, refused %zu, error %zu, stuck %zu, queued past the timeout %zu\n",
                 by_fate['o'], by_fate['p'], by_fate['e'], by_fate['t'], by_fate['q']);
    for (char f : {'o', 'p', 'e', 't'}) EXPECT_GT(by_fate[f], 0u) << "no transfer with fate " << f;
    uint64_t injected = 0;
    for (auto& s : engine.nic_stats()) injected += s.faults_injected;
    // One fault, one failed transfer. Refusals and error completions are told apart by their
    // messages; the rest of the faults were stuck operations, each of which must have ended in a
    // timeout. A timeout may also hit a WRITE posted just before its deadline (budget freed by an
    // older stuck one) whose completion had not come yet: that one is no fault, hence <=.
    EXPECT_GE(injected, by_fate['p'] + by_fate['e']) << "a refusal or error completion not injected";
    uint64_t stuck = injected - std::min<uint64_t>(injected, by_fate['p'] + by_fate['e']);
    EXPECT_GT(stuck, 0u);
    EXPECT_LE(stuck, by_fate['t']) << "a stuck operation that did not end in a timeout";
    ch.send(fates);
    EXPECT_EQ(ch.recv(), "verified");
    return role_result();
  };

  auto r = tools::run_process_pair(sender, receiver);
  EXPECT_TRUE(r.ok()) << "sender rc " << r.parent_rc << ", receiver status " << r.child_status;
}

INSTANTIATE_TEST_SUITE_P(Providers, Faults,
                         ::testing::Values(ProviderCase{"tcp;ofi_rxm", 1, false},
                                           ProviderCase{"tcp;ofi_rxm", 2, true},
                                           ProviderCase{"shm", 1, false},
                                           ProviderCase{"verbs", 1, false}),
                         case_name);

// ---- deregistration with transfers in flight ---------------------------------------------

TEST(Reliability, DeregisteringASourceFailsItsTransfersInFlightCleanly) {
  constexpr uint32_t kWrites = 200;
  constexpr uint64_t kBig = 1 << 20;
  const ProviderCase pc{"tcp;ofi_rxm", 1, false};
  auto receiver = [&](Channel& ch) {
    std::vector<uint8_t> dst(kBig, 0);  // outlives the engine: WRITEs may land until it closes
    TransferEngine engine(config_for(pc));
    auto [h, d] = engine.reg_mr(dst.data(), kBig);
    ch.send(d.to_bytes());
    EXPECT_EQ(ch.recv(), "done");
    return role_result();
  };
  auto sender = [&](Channel& ch) {
    auto src = random_bytes(kBig, 4);
    TransferEngine engine(config_for(pc));
    auto [h, d] = engine.reg_mr(src.data(), kBig);
    MrDesc dst = MrDesc::from_bytes(ch.recv_bytes());
    std::mutex mu;
    std::vector<Status> statuses;
    for (uint32_t i = 0; i < kWrites; i++)
      engine.submit(SingleWrite{.len = kBig, .src = {h, 0}, .dst = {engine.add_remote(dst), 0}},
                    OnDone::callback([&](const Status& s) {
                                   std::lock_guard lock(mu);
                                   statuses.push_back(s);
                                 }));
    engine.dereg_mr(h);
    // dereg_mr returns once no WRITE from the region is left with the NIC: the memory is free.
    std::fill(src.begin(), src.end(), 0xEE);
    EXPECT_TRUE(wait_until([&] {
      std::lock_guard lock(mu);
      return statuses.size() >= kWrites;
    }));
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    std::lock_guard lock(mu);
    EXPECT_EQ(statuses.size(), kWrites) << "each transfer reported exactly once";
    size_t failed = 0;
    for (auto& s : statuses) {
      if (s.ok()) continue;
      failed++;
      EXPECT_EQ(s.code(), ErrorCode::kNotFound) << s.message();
      EXPECT_NE(s.message().find("deregistered"), std::string::npos) << s.message();
    }
    EXPECT_GT(failed, 0u) << "deregistered at once, yet every transfer ran";
    // The handle is stale; a new region works.
    EXPECT_THROW(engine.submit(SingleWrite{.len = 1, .src = {h, 0}, .dst = {engine.add_remote(dst), 0}},
                               OnDone::none()), Error);
    auto [h2, d2] = engine.reg_mr(src.data(), kBig);
    std::atomic<int> flag{kDonePending};
    engine.submit(SingleWrite{.len = kBig, .src = {h2, 0}, .dst = {engine.add_remote(dst), 0}},
                  OnDone::flag(&flag));
    EXPECT_TRUE(wait_until([&] { return flag.load() != kDonePending; }));
    EXPECT_EQ(flag.load(), kDoneSucceeded);
    ch.send("done");
    return role_result();
  };
  auto r = tools::run_process_pair(sender, receiver);
  EXPECT_TRUE(r.ok()) << "sender rc " << r.parent_rc << ", receiver status " << r.child_status;
}

// ---- a peer that dies and comes back -----------------------------------------------------

// The child runs two incarnations of the peer, one after the other, each in its own process: the
// first is SIGKILLed mid-stream, the second starts at a new address. The survivor must see the
// first one's transfers fail within its timeout and reach the second without re-initialising.
TEST_P(Faults, APeerKilledAndRestartedAtANewAddressIsReachedAgain) {
  const ProviderCase pc = GetParam();
  FABRIC_SKIP_WITHOUT_DEVICE(pc);
  constexpr uint64_t kBuf = 1 << 20;
  constexpr uint32_t kImm = 0x77;

  auto incarnations = [&](Channel& ch) {
    for (int gen = 1; gen <= 2; gen++) {
      std::fflush(nullptr);
      pid_t pid = fork();
      if (pid == 0) {
        int rc = 1;
        try {
          TransferEngine engine(config_for(pc));
          std::vector<uint8_t> dst(kBuf, 0);
          auto [h, d] = engine.reg_mr(dst.data(), kBuf);
          std::atomic<int> landed{kDonePending};
          engine.expect_imm_count(kImm, single_write_imm_count(kBuf, pc.nics, false), OnDone::flag(&landed));
          ch.send(d.to_bytes());
          bool ok = wait_until([&] { return landed.load() != kDonePending; }) &&
                    dst == random_bytes(kBuf, 100 + static_cast<uint32_t>(gen));
          ch.send(ok ? "landed" : "bad data");
          if (ch.recv() == "die") std::raise(SIGKILL);
          rc = 0;
        } catch (const std::exception& e) {
          std::fprintf(stderr, "incarnation %d: %s\n", gen, e.what());
        }
        std::fflush(nullptr);
        _exit(rc);
      }
      int status = tools::reap(pid);
      if (gen == 1 && !WIFSIGNALED(status)) return 1;
      if (gen == 2 && !(WIFEXITED(status) && WEXITSTATUS(status) == 0)) return 1;
    }
    return 0;
  };

  auto survivor = [&](Channel& ch) {
    EngineConfig cfg = config_for(pc);
    cfg.transfer_timeout = std::chrono::seconds(2);
    TransferEngine engine(cfg);
    std::vector<uint8_t> src1 = random_bytes(kBuf, 101), src2 = random_bytes(kBuf, 102);
    auto [h1, d1] = engine.reg_mr(src1.data(), kBuf);
    auto [h2, d2] = engine.reg_mr(src2.data(), kBuf);

    MrDesc first = MrDesc::from_bytes(ch.recv_bytes());
    std::atomic<int> flag{kDonePending};
    engine.submit(SingleWrite{.len = kBuf, .src = {h1, 0}, .dst = {engine.add_remote(first), 0}, .imm = kImm},
                  OnDone::flag(&flag));
    EXPECT_TRUE(wait_until([&] { return flag.load() != kDonePending; }));
    EXPECT_EQ(ch.recv(), "landed");
    ch.send("die");
    std::this_thread::sleep_for(std::chrono::milliseconds(100));

    std::atomic<uint64_t> done{0}, failed{0};
    auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < 10; i++) engine.submit(SingleWrite{.len = kBuf, .src = {h1, 0}, .dst = {engine.add_remote(first), 0}},
                                               OnDone::counter(&done, &failed));
    EXPECT_TRUE(wait_until([&] { return done.load() + failed.load() == 10; }, std::chrono::seconds(20)));
    double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_GT(failed.load(), 0u) << "writes to a dead peer cannot all succeed";
    EXPECT_LT(secs, 2.0 + 5.0) << "errors within the transfer timeout (2 s) and some slack";

    MrDesc second = MrDesc::from_bytes(ch.recv_bytes());
    EXPECT_NE(second.owner(), first.owner()) << "a restarted peer has a new address";
    std::atomic<int> flag2{kDonePending};
    engine.submit(SingleWrite{.len = kBuf, .src = {h2, 0}, .dst = {engine.add_remote(second), 0}, .imm = kImm},
                  OnDone::flag(&flag2));
    EXPECT_TRUE(wait_until([&] { return flag2.load() != kDonePending; }));
    EXPECT_EQ(flag2.load(), kDoneSucceeded);
    EXPECT_EQ(ch.recv(), "landed");
    ch.send("exit");
    return role_result();
  };

  auto r = tools::run_process_pair(survivor, incarnations);
  EXPECT_TRUE(r.ok()) << "survivor rc " << r.parent_rc << ", incarnations status " << r.child_status;
}

}  // namespace
}  // namespace fabric::testing
