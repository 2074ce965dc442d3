// Two engine processes over a real provider (libfabric tcp;ofi_rxm and shm, 1/2/4 NICs per side;
// verbs on Soft-RoCE, 1/2 NICs, in the VM of tests/rxe),
// with and without the reordering wrapper: every API call, every byte checked, immediate counts
// exactly as documented.
#include <gtest/gtest.h>

#include <atomic>
#include <csignal>
#include <cstring>
#include <mutex>
#include <optional>
#include <set>

#include "fabric/fabric.h"
#include "process_pair.h"
#include "test_support.h"

namespace fabric::testing {
namespace {

using tools::Channel;

class EnginePair : public ::testing::TestWithParam<ProviderCase> {};

// ---- single and paged writes -------------------------------------------------------------

struct SingleCase {
  uint64_t len, src_off, dst_off;
  bool pinned;
};
// Zero bytes, shorter than the NIC count, just over the shard threshold, large and odd, pinned.
const std::vector<SingleCase> kSingles = {
    {0, 0, 0, false},         {1, 5, 7, false},           {3, 100, 200, false},
    {4096, 4096, 8192, false}, {32769, 1 << 16, 3 << 16, false}, {(1 << 20) + 13, 1 << 20, 1 << 21, false},
    {3 << 20, 4 << 20, 4 << 20, false}, {300000, 17, 900001, true},
};
constexpr uint32_t kSingleImmBase = 0x100;
constexpr uint32_t kPagedImm = 0x200;
constexpr uint64_t kBuf = 8 << 20;
constexpr uint64_t kPageLen = 4096 + 13;  // not a power of two: catches stride/len mix-ups
constexpr uint64_t kPageStride = 5000;
constexpr uint64_t kPageOffset = 123;
constexpr size_t kPages = 300;
constexpr uint32_t kPageRange = 1000;

TEST_P(EnginePair, SingleAndPagedWritesDeliverEveryByteAndExactImmCounts) {
  const ProviderCase pc = GetParam();
  FABRIC_SKIP_WITHOUT_DEVICE(pc);
  const size_t nics = pc.nics;
  const std::vector<uint32_t> src_idx = random_indices(kPages, kPageRange, 11);
  const std::vector<uint32_t> dst_idx = random_indices(kPages, kPageRange, 12);
  Pages src_pages{src_idx, kPageStride, kPageOffset};
  Pages dst_pages{dst_idx, kPageStride, kPageOffset + 1};
  const size_t pinned_nic = nics - 1;

  auto receiver = [&](Channel& ch) {
    TransferEngine engine(config_for(pc));
    std::vector<uint8_t> single_dst(kBuf, 0), paged_dst(kPageStride * (kPageRange + 1), 0);
    auto [h1, d1] = engine.reg_mr(single_dst.data(), single_dst.size());
    auto [h2, d2] = engine.reg_mr(paged_dst.data(), paged_dst.size());
    ch.send(d1.to_bytes());
    ch.send(d2.to_bytes());

    // Expectations registered from several threads while WRITEs arrive: early arrivals count.
    std::atomic<uint64_t> met{0}, failed{0};
    std::vector<std::thread> threads;
    for (size_t t = 0; t < 4; t++)
      threads.emplace_back([&, t] {
        for (size_t i = t; i < kSingles.size(); i += 4) {
          auto& c = kSingles[i];
          engine.expect_imm_count(kSingleImmBase + static_cast<uint32_t>(i),
                                  single_write_imm_count(c.len, nics, c.pinned),
                                  OnDone::counter(&met, &failed));
        }
      });
    for (auto& t : threads) t.join();
    engine.expect_imm_count(kPagedImm, kPages / 2, OnDone::counter(&met, &failed));
    engine.expect_imm_count(kPagedImm, kPages - kPages / 2, OnDone::counter(&met, &failed));
    const uint64_t expectations = kSingles.size() + 2;
    EXPECT_TRUE(wait_until([&] { return met.load() == expectations; }))
        << "met " << met.load() << " of " << expectations;
    EXPECT_EQ(failed.load(), 0u);
    EXPECT_EQ(ch.recv(), "all writes completed");

    auto src = random_bytes(kBuf, 7);
    for (auto& c : kSingles)
      EXPECT_EQ(std::memcmp(single_dst.data() + c.dst_off, src.data() + c.src_off, c.len), 0)
          << "single write of " << c.len << " bytes";
    size_t bad_pages = 0;
    for (size_t i = 0; i < kPages; i++) {
      uint64_t s = src_pages.offset + src_pages.stride * src_pages.indices[i];
      uint64_t d = dst_pages.offset + dst_pages.stride * dst_pages.indices[i];
      bad_pages += std::memcmp(paged_dst.data() + d, src.data() + s, kPageLen) != 0;
    }
    EXPECT_EQ(bad_pages, 0u);
    // Nothing written outside the pages.
    std::vector<bool> covered(paged_dst.size(), false);
    for (size_t i = 0; i < kPages; i++)
      for (uint64_t b = 0; b < kPageLen; b++)
        covered[dst_pages.offset + dst_pages.stride * dst_pages.indices[i] + b] = true;
    size_t stray = 0;
    for (size_t b = 0; b < paged_dst.size(); b++) stray += !covered[b] && paged_dst[b] != 0;
    EXPECT_EQ(stray, 0u) << "bytes written outside every page";

    // Exactly as documented: no immediate left over once every expectation was met.
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    for (size_t i = 0; i < kSingles.size(); i++)
      EXPECT_EQ(engine.imm_count(kSingleImmBase + static_cast<uint32_t>(i)), 0u) << "case " << i;
    EXPECT_EQ(engine.imm_count(kPagedImm), 0u);
    auto stats = engine.nic_stats();
    uint64_t imms = 0;
    for (auto& s : stats) imms += s.imms_received;
    uint64_t expected_imms = kPages;
    for (auto& c : kSingles) expected_imms += single_write_imm_count(c.len, nics, c.pinned);
    EXPECT_EQ(imms, expected_imms);
    ch.send("verified");
    return role_result();
  };

  auto sender = [&](Channel& ch) {
    TransferEngine engine(config_for(pc));
    auto src = random_bytes(kBuf, 7);
    auto [h, d] = engine.reg_mr(src.data(), src.size());
    RemoteMr single_dst = engine.add_remote(MrDesc::from_bytes(ch.recv_bytes()));
    RemoteMr paged_dst = engine.add_remote(MrDesc::from_bytes(ch.recv_bytes()));
    std::atomic<uint64_t> done{0}, failed{0};
    for (size_t i = 0; i < kSingles.size(); i++) {
      auto& c = kSingles[i];
      SingleWrite w{.len = c.len, .src = {h, c.src_off}, .dst = {single_dst, c.dst_off},
                    .imm = kSingleImmBase + static_cast<uint32_t>(i)};
      if (c.pinned) w.nic = static_cast<uint8_t>(pinned_nic);
      engine.submit(w, OnDone::counter(&done, &failed));
    }
    std::atomic<int> paged{kDonePending};
    engine.submit(PagedWrites{.page_len = kPageLen, .src = h, .src_pages = src_pages, .dst = paged_dst,
                              .dst_pages = dst_pages, .imm = kPagedImm},
                  OnDone::flag(&paged));
    EXPECT_TRUE(wait_until([&] { return done.load() + failed.load() == kSingles.size(); }));
    EXPECT_TRUE(wait_until([&] { return paged.load() != kDonePending; }));
    EXPECT_EQ(failed.load(), 0u);
    EXPECT_EQ(paged.load(), kDoneSucceeded);
    if (pinned_nic > 0) {
      EXPECT_GT(engine.nic_stats()[pinned_nic].writes_posted, 0u);
    }
    ch.send("all writes completed");
    EXPECT_EQ(ch.recv(), "verified");
    return role_result();
  };

  auto r = tools::run_process_pair(sender, receiver);
  EXPECT_TRUE(r.ok()) << "sender rc " << r.parent_rc << ", receiver status " << r.child_status;
}

// ---- two-sided messages ------------------------------------------------------------------

TEST_P(EnginePair, TenThousandMessagesArriveIntactAndOnce) {
  const ProviderCase pc = GetParam();
  FABRIC_SKIP_WITHOUT_DEVICE(pc);
  constexpr uint32_t kMessages = 10000;
  auto message = [](uint32_t i) {
    std::string m(1 + (i * 37) % 200, static_cast<char>('a' + i % 26));
    std::memcpy(m.data(), &i, std::min(sizeof i, m.size()));
    if (m.size() < sizeof i) m = std::string(reinterpret_cast<char*>(&i), sizeof i);
    return m;
  };

  auto receiver = [&](Channel& ch) {
    TransferEngine engine(config_for(pc));
    std::mutex mu;
    std::vector<uint8_t> seen(kMessages, 0);
    std::atomic<uint32_t> received{0}, corrupt{0};
    engine.submit_recvs(256, 64, [&](std::span<const std::byte> bytes) {
      uint32_t i = UINT32_MAX;
      if (bytes.size() >= sizeof i) std::memcpy(&i, bytes.data(), sizeof i);
      if (i >= kMessages || std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size()) != message(i)) {
        corrupt++;
      } else {
        std::lock_guard lock(mu);
        seen[i]++;
      }
      received++;
    });
    ch.send(engine.main_address().to_bytes());
    EXPECT_TRUE(wait_until([&] { return received.load() >= kMessages; })) << received.load();
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    EXPECT_EQ(received.load(), kMessages);
    EXPECT_EQ(corrupt.load(), 0u);
    std::lock_guard lock(mu);
    for (uint32_t i = 0; i < kMessages; i++) EXPECT_EQ(seen[i], 1) << "message " << i;
    ch.send("received");
    return role_result();
  };

  auto sender = [&](Channel& ch) {
    TransferEngine engine(config_for(pc));
    NetAddr peer = NetAddr::from_bytes(ch.recv_bytes());
    std::atomic<uint64_t> done{0}, failed{0};
    for (uint32_t i = 0; i < kMessages; i++) {
      std::string m = message(i);
      engine.submit_send(peer, std::as_bytes(std::span(m)), OnDone::counter(&done, &failed));
      m.assign(m.size(), 'X');  // the engine copied it: reusing the buffer must not matter
    }
    EXPECT_TRUE(wait_until([&] { return done.load() + failed.load() == kMessages; }));
    EXPECT_EQ(failed.load(), 0u);
    EXPECT_EQ(ch.recv(), "received");
    return role_result();
  };

  auto r = tools::run_process_pair(sender, receiver);
  EXPECT_TRUE(r.ok()) << "sender rc " << r.parent_rc << ", receiver status " << r.child_status;
}

// ---- scatter and barrier to eight peers --------------------------------------------------

TEST_P(EnginePair, ScatterAndBarrierReachEightPeers) {
  const ProviderCase pc = GetParam();
  FABRIC_SKIP_WITHOUT_DEVICE(pc);
  constexpr size_t kPeers = 8;
  constexpr uint64_t kDst = 1 << 20;
  constexpr uint32_t kScatterImm = 0x300, kBarrierImm = 0x301, kPlainScatterImm = 0x302;
  // Peer p gets len(p) bytes from src offset p*kDst/2 at dst offset 1000*p; peer 3 gets 0 bytes.
  auto len = [](size_t p) -> uint64_t { return p == 3 ? 0 : 1000 + p * 70001; };

  auto receivers = [&](Channel& ch) {
    std::vector<std::unique_ptr<TransferEngine>> engines;
    std::vector<std::vector<uint8_t>> bufs(kPeers, std::vector<uint8_t>(kDst, 0));
    std::atomic<uint64_t> met{0}, failed{0};
    for (size_t p = 0; p < kPeers; p++) {
      engines.push_back(std::make_unique<TransferEngine>(config_for(pc)));
      auto [h, d] = engines[p]->reg_mr(bufs[p].data(), kDst);
      ch.send(d.to_bytes());
      for (uint32_t imm : {kScatterImm, kBarrierImm, kPlainScatterImm})  // two barriers
        engines[p]->expect_imm_count(imm, imm == kBarrierImm ? 2 : 1, OnDone::counter(&met, &failed));
    }
    EXPECT_TRUE(wait_until([&] { return met.load() == 3 * kPeers; })) << met.load();
    EXPECT_EQ(failed.load(), 0u);
    auto src = random_bytes(kDst * 4, 9);
    for (size_t p = 0; p < kPeers; p++) {
      EXPECT_EQ(std::memcmp(bufs[p].data() + 1000 * p, src.data() + p * kDst / 2, len(p)), 0) << p;
      EXPECT_EQ(std::memcmp(bufs[p].data() + kDst / 2, src.data() + 7, 4096), 0) << p;
      EXPECT_EQ(bufs[p][kDst - 1], 0) << p;
    }
    ch.send("verified");
    return role_result();
  };

  auto sender = [&](Channel& ch) {
    TransferEngine engine(config_for(pc));
    auto src = random_bytes(kDst * 4, 9);
    auto [h, d] = engine.reg_mr(src.data(), src.size());
    std::vector<RemoteMr> dsts;
    for (size_t p = 0; p < kPeers; p++) dsts.push_back(engine.add_remote(MrDesc::from_bytes(ch.recv_bytes())));
    PeerGroupHandle group = engine.add_peer_group(dsts);
    std::vector<GroupSlice> slices;
    std::vector<ScatterSlice> plain;
    for (size_t p = 0; p < kPeers; p++) {
      slices.push_back({len(p), p * kDst / 2, 1000 * p});
      plain.push_back({4096, 7, {dsts[p], kDst / 2}});
    }
    std::atomic<int> s1{kDonePending}, s2{kDonePending}, b{kDonePending}, b2{kDonePending};
    engine.submit(GroupScatter{.group = group, .src = h, .slices = slices, .imm = kScatterImm}, OnDone::flag(&s1));
    engine.submit(Scatter{.src = h, .slices = plain, .imm = kPlainScatterImm}, OnDone::flag(&s2));
    EXPECT_TRUE(wait_until([&] { return s1.load() != kDonePending && s2.load() != kDonePending; }));
    // The barriers follow the data they vouch for: one to the group, one to a list of regions.
    engine.submit(GroupBarrier{.group = group, .imm = kBarrierImm}, OnDone::flag(&b));
    engine.submit(Barrier{.dsts = dsts, .imm = kBarrierImm}, OnDone::flag(&b2));
    EXPECT_TRUE(wait_until([&] { return b.load() != kDonePending && b2.load() != kDonePending; }));
    EXPECT_EQ(s1.load(), kDoneSucceeded);
    EXPECT_EQ(s2.load(), kDoneSucceeded);
    EXPECT_EQ(b.load(), kDoneSucceeded);
    EXPECT_EQ(b2.load(), kDoneSucceeded);
    EXPECT_EQ(ch.recv(), "verified");
    return role_result();
  };

  auto r = tools::run_process_pair(sender, receivers);
  EXPECT_TRUE(r.ok()) << "sender rc " << r.parent_rc << ", receiver status " << r.child_status;
}

// The shared provider suite: every provider of suite_providers() (test_support.h), at each of
// its NIC counts, plain and reordered.
INSTANTIATE_TEST_SUITE_P(Providers, EnginePair, ::testing::ValuesIn(suite_cases()), case_name);

// ---- a peer killed mid-transfer ----------------------------------------------------------

class KilledPeer : public ::testing::TestWithParam<ProviderCase> {};

TEST_P(KilledPeer, EveryTransferEndsWithinTheTimeoutAndTheEngineStaysUsable) {
  const ProviderCase pc = GetParam();
  FABRIC_SKIP_WITHOUT_DEVICE(pc);
  constexpr uint64_t kLen = 1 << 20;
  constexpr uint32_t kBefore = 20, kAfter = 30;

  auto victim = [&](Channel& ch) {
    TransferEngine engine(config_for(pc));
    std::vector<uint8_t> dst(kLen, 0);
    auto [h, d] = engine.reg_mr(dst.data(), kLen);
    ch.send(d.to_bytes());
    ch.recv();  // "die"
    std::raise(SIGKILL);
    return 0;
  };

  auto survivor = [&](Channel& ch) {
    EngineConfig cfg = config_for(pc);
    cfg.transfer_timeout = std::chrono::seconds(2);
    TransferEngine engine(cfg);
    auto src = random_bytes(kLen, 3);
    auto [h, d] = engine.reg_mr(src.data(), kLen);
    MrDesc dst = MrDesc::from_bytes(ch.recv_bytes());
    std::atomic<uint64_t> done{0}, failed{0};
    // One WRITE at a time, so that each has the 2 s timeout to itself: submitted together, the
    // last ones waited behind 19 MiB, which Soft-RoCE under TCG moves in more than 2 s when the
    // host is loaded, and timed out before the victim was told to die.
    for (uint32_t i = 0; i < kBefore; i++) {
      engine.submit(SingleWrite{.len = kLen, .src = {h, 0}, .dst = {engine.add_remote(dst), 0}},
                    OnDone::counter(&done, &failed));
      EXPECT_TRUE(wait_until([&] { return done.load() + failed.load() == i + 1; }));
    }
    EXPECT_EQ(done.load(), kBefore);
    ch.send("die");
    // The victim's end of the channel closes as it dies: wait for that instead of guessing (a victim
    // slow to die could take every later write), then give its queue pairs a moment to go.
    try {
      ch.recv();
    } catch (const std::runtime_error&) {
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    std::vector<Status> errors;
    std::mutex mu;
    std::atomic<uint32_t> ended{0};
    auto start = std::chrono::steady_clock::now();
    for (uint32_t i = 0; i < kAfter; i++)
      engine.submit(SingleWrite{.len = kLen, .src = {h, 0}, .dst = {engine.add_remote(dst), 0}},
                    OnDone::callback([&](const Status& s) {
                                   std::lock_guard lock(mu);
                                   errors.push_back(s);
                                   ended++;
                                 }));
    EXPECT_TRUE(wait_until([&] { return ended.load() == kAfter; }, std::chrono::seconds(30)))
        << ended.load() << " of " << kAfter << " transfers ended";
    double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_LT(secs, 20.0);
    std::lock_guard lock(mu);
    size_t n_failed = 0;
    for (auto& s : errors) {
      if (s.ok()) continue;
      n_failed++;
      EXPECT_TRUE(s.code() == ErrorCode::kTimeout || s.code() == ErrorCode::kProvider) << s.message();
      EXPECT_FALSE(s.message().empty());
    }
    EXPECT_GT(n_failed, 0u) << "writes to a dead peer cannot all succeed";

    expect_write_to_self_works(engine, h, src, pc.nics);  // the survivor still works
    return role_result();
  };

  auto r = tools::run_process_pair(survivor, victim);
  EXPECT_EQ(r.parent_rc, 0);
  EXPECT_TRUE(WIFSIGNALED(r.child_status));
}

INSTANTIATE_TEST_SUITE_P(Providers, KilledPeer,
                         ::testing::Values(ProviderCase{"tcp;ofi_rxm", 1, false},
                                           ProviderCase{"tcp;ofi_rxm", 2, false},
                                           ProviderCase{"shm", 1, false},
                                           ProviderCase{"verbs", 1, false}),
                         case_name);
INSTANTIATE_TEST_SUITE_P(EfaSim, KilledPeer,
                         ::testing::Values(ProviderCase{"efa-sim", 1, false},
                                           ProviderCase{"efa-sim", 2, true}),
                         case_name);

// ---- a peer killed with WRITEs in flight ---------------------------------------------------

// The victim dies while hundreds of paged WRITEs to it are posted and uncompleted. Every
// transfer to it ends in time, and afterwards the survivor posts again on every NIC (a
// per-NIC in-flight count corrupted by the dead peer's completions once stopped it for good).
class KilledMidTransfer : public ::testing::TestWithParam<ProviderCase> {};

TEST_P(KilledMidTransfer, InFlightWritesEndAndEveryNicStillPosts) {
  const ProviderCase pc = GetParam();
  FABRIC_SKIP_WITHOUT_DEVICE(pc);
  constexpr uint64_t kPage = 256 << 10;
  constexpr uint32_t kDstPages = 16, kTransfers = 16, kPagesEach = 32;

  auto victim = [&](Channel& ch) {
    TransferEngine engine(config_for(pc));
    std::vector<uint8_t> dst(kPage * kDstPages, 0);
    auto [h, d] = engine.reg_mr(dst.data(), dst.size());
    ch.send(d.to_bytes());
    ch.send(std::to_string(getpid()));
    ch.recv();  // never answered: the survivor stops, then kills this process
    return 0;
  };

  auto survivor = [&](Channel& ch) {
    EngineConfig cfg = config_for(pc);
    cfg.transfer_timeout = std::chrono::seconds(2);
    cfg.worker_stall_timeout = std::chrono::seconds(5);
    auto src = random_bytes(kPage, 5);
    std::atomic<uint64_t> done{0}, failed{0};
    TransferEngine engine(cfg);
    auto [h, d] = engine.reg_mr(src.data(), src.size());
    MrDesc dst = MrDesc::from_bytes(ch.recv_bytes());
    const pid_t victim_pid = std::stoi(ch.recv());
    std::vector<uint32_t> src_idx(kPagesEach, 0), dst_idx(kPagesEach);
    for (uint32_t i = 0; i < kPagesEach; i++) dst_idx[i] = i % kDstPages;
    // One transfer first, so every NIC is connected and the next ones are really in flight.
    engine.submit(PagedWrites{.page_len = kPage, .src = h, .src_pages = Pages{src_idx, kPage, 0}, .dst = engine.add_remote(dst), .dst_pages = Pages{dst_idx, kPage, 0}},
                  OnDone::counter(&done, &failed));
    EXPECT_TRUE(wait_until([&] { return done.load() == 1; })) << "the warm-up transfer failed";
    for (uint32_t t = 0; t < kTransfers; t++)
      engine.submit(PagedWrites{.page_len = kPage, .src = h, .src_pages = Pages{src_idx, kPage, 0}, .dst = engine.add_remote(dst), .dst_pages = Pages{dst_idx, kPage, 0}, .imm = 0x77},
                    OnDone::counter(&done, &failed));
    // Stopped, the victim stops reading its sockets: WRITEs stay with the NICs until the
    // transfers time out. Killed then, its connections fail and those WRITEs complete late, with
    // errors, after their transfers were reported.
    kill(victim_pid, SIGSTOP);
    if (pc.provider == "shm") {
      // shm may also wedge: a sender spins on the lock of the peer's region, and a peer stopped
      // or killed while holding it never lets go. Every outcome is bounded: the transfers end,
      // or control calls throw kTimeout after worker_stall_timeout, saying to restart.
      std::string wedged;
      auto ended_or_wedged = [&](auto&& ended) {
        return wait_until(
            [&] {
              if (ended()) return true;
              try {
                engine.peer_count();
              } catch (const Error& e) {
                wedged = e.what();
              }
              return !wedged.empty();
            },
            std::chrono::seconds(30));
      };
      EXPECT_TRUE(ended_or_wedged([&] { return done.load() + failed.load() == 1 + kTransfers; }))
          << done.load() << " done, " << failed.load() << " failed of " << kTransfers;
      kill(victim_pid, SIGKILL);
      if (!wedged.empty()) {
        // Stopped holding its region lock, the victim kept our worker spinning in a post to it
        // until the stall timeout closed the engine.
        EXPECT_NE(wedged.find("restart this process"), std::string::npos) << wedged;
        return role_result();  // closing the engine is bounded by worker_stall_timeout
      }
      EXPECT_GT(failed.load(), 0u) << "the victim stopped: some transfers must time out";
      // Killed, it is found dead: the lock it held is released and the sending endpoint its
      // unanswered WRITEs block is replaced (src/providers/libfabric/shm_senders.h); the engine
      // goes on, below, as on the other providers.
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
    } else {
      EXPECT_TRUE(wait_until([&] { return done.load() + failed.load() == 1 + kTransfers; },
                             std::chrono::seconds(30)))
          << done.load() << " done, " << failed.load() << " failed of " << kTransfers;
      EXPECT_GT(failed.load(), 0u) << "the victim stopped: some transfers must time out";
      kill(victim_pid, SIGKILL);
      std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the late completions arrive
    }
    // Each NIC must still post: a write pinned to each, then a sharded one over all.
    for (size_t nic = 0; nic < pc.nics; nic++) {
      std::vector<uint8_t> mine(kPage, 0);
      auto [mh, md] = engine.reg_mr(mine.data(), mine.size());
      std::atomic<int> flag{kDonePending}, landed{kDonePending};
      engine.expect_imm_count(0x88, 1, OnDone::flag(&landed));
      engine.submit(SingleWrite{.len = kPage, .src = {h, 0}, .dst = {engine.add_remote(md), 0}, .imm = 0x88, .nic = static_cast<uint8_t>(nic)},
                    OnDone::flag(&flag));
      EXPECT_TRUE(wait_until([&] { return flag.load() != kDonePending && landed.load() != kDonePending; },
                             std::chrono::seconds(10)))
          << "NIC " << nic << " posts nothing after the peer died";
      EXPECT_EQ(flag.load(), kDoneSucceeded) << "NIC " << nic;
      EXPECT_EQ(mine, src) << "NIC " << nic;
      engine.dereg_mr(mh);
    }
    expect_write_to_self_works(engine, h, src, pc.nics);
    return role_result();
  };

  auto r = tools::run_process_pair(survivor, victim);
  EXPECT_EQ(r.parent_rc, 0);
  EXPECT_TRUE(WIFSIGNALED(r.child_status));
}

INSTANTIATE_TEST_SUITE_P(Providers, KilledMidTransfer,
                         ::testing::Values(ProviderCase{"shm", 1, false}, ProviderCase{"tcp;ofi_rxm", 1, false},
                                           ProviderCase{"tcp;ofi_rxm", 2, false},
                                           ProviderCase{"tcp;ofi_rxm", 4, false}),
                         case_name);
// No verbs case: a stopped process's RDMA device still acknowledges WRITEs (the kernel's rxe
// does, as a NIC would), so SIGSTOP does not keep them in flight there.
INSTANTIATE_TEST_SUITE_P(EfaSim, KilledMidTransfer,  // 256 KiB pages: split WRITEs in flight
                         ::testing::Values(ProviderCase{"efa-sim", 1, false},
                                           ProviderCase{"efa-sim", 2, true}),
                         case_name);

}  // namespace
}  // namespace fabric::testing
