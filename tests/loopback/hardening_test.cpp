// The ways an engine could wait forever, starve, leak or send the wrong bytes, each closed: expectation
// timeouts and cancellation, bounded early immediates, receive pools larger than the provider's
// queue, FIFO posting under back-pressure, back-pressure scoped to one peer, dereg_mr racing with
// posting, calls racing with shutdown, and removing peers.
#include <gtest/gtest.h>

#include <atomic>
#include <mutex>
#include <thread>

#include "fabric/fabric.h"
#include "providers/fault/fault_domain.h"
#include "test_support.h"

namespace fabric::testing {
namespace {

const ProviderCase kTcp{"tcp;ofi_rxm", 1, false};

bool ended(const std::atomic<int>& f) { return f.load() != kDonePending; }

// A write from `engine` to itself lands: imm counted, bytes checked.
void self_write_lands(TransferEngine& engine) {
  auto src = random_bytes(4096, 9);
  auto [h, d] = engine.reg_mr(src.data(), src.size());
  expect_write_to_self_works(engine, h, src, engine.nic_count());
  engine.dereg_mr(h);
}

// ---- expectations: timeout and cancel ------------------------------------------------------

TEST(Hardening, ExpectationsTimeOutAndCancelAndKeepWhatTheyCounted) {
  std::vector<uint8_t> buf(4096, 1);  // outlives the engine, as do the flags and statuses
  std::atomic<int> done{kDonePending};
  std::mutex mu;  // the last expectation ends with kShutdown inside the engine's destructor
  std::optional<Status> timed_out, cancelled, late;
  TransferEngine engine(config_for(kTcp));
  auto [h, d] = engine.reg_mr(buf.data(), buf.size());
  engine.submit(SingleWrite{.len = 8, .src = {h, 0}, .dst = {engine.add_remote(d), 64}, .imm = 0x31},
                OnDone::flag(&done));
  ASSERT_TRUE(wait_until([&] { return engine.imm_count(0x31) == 1; }));

  // Needs 3, sees 1: ends with kTimeout, and the one arrival stays counted.
  engine.expect_imm_count(0x31, 3, OnDone::callback([&](const Status& s) {
                            std::lock_guard l(mu);
                            timed_out = s;
                          }),
                          ExpectOptions{std::chrono::milliseconds(200)});
  ASSERT_TRUE(wait_until([&] { std::lock_guard l(mu); return timed_out.has_value(); }, std::chrono::seconds(20)));
  EXPECT_EQ(timed_out->code(), ErrorCode::kTimeout);
  EXPECT_NE(timed_out->message().find("arrived 1 of the 3"), std::string::npos) << timed_out->message();
  EXPECT_EQ(engine.imm_count(0x31), 1u);

  // Cancelled: kCancelled once; a second cancel finds nothing.
  ImmExpectation e = engine.expect_imm_count(0x32, 5, OnDone::callback([&](const Status& s) {
                                               std::lock_guard l(mu);
                                               cancelled = s;
                                             }));
  EXPECT_TRUE(engine.cancel_imm_expectation(e));
  EXPECT_FALSE(engine.cancel_imm_expectation(e));
  ASSERT_TRUE(wait_until([&] { std::lock_guard l(mu); return cancelled.has_value(); }));
  EXPECT_EQ(cancelled->code(), ErrorCode::kCancelled);

  // A met expectation cannot be cancelled, and its timeout never fires.
  std::atomic<int> met{kDonePending};
  ImmExpectation m = engine.expect_imm_count(0x31, 1, OnDone::flag(&met), ExpectOptions{std::chrono::milliseconds(100)});
  ASSERT_TRUE(wait_until([&] { return ended(met); }));
  EXPECT_EQ(met.load(), kDoneSucceeded);
  EXPECT_FALSE(engine.cancel_imm_expectation(m));
  engine.expect_imm_count(0x33, 1, OnDone::callback([&](const Status& s) {
                            std::lock_guard l(mu);
                            late = s;
                          }),
                          ExpectOptions{std::chrono::seconds(30)});
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  {
    std::lock_guard l(mu);
    EXPECT_FALSE(late.has_value()) << "an expectation with a long timeout ended early";
  }
  engine.dereg_mr(h);
}

// ---- early immediates are bounded ----------------------------------------------------------

TEST(Hardening, UnexpectedImmediatesAreBoundedAndDropsCounted) {
  EngineConfig cfg = config_for(kTcp);
  cfg.max_unexpected_imms = 100;
  std::vector<uint8_t> buf(4096, 1);  // outlives the engine
  TransferEngine engine(cfg);
  auto [h, d] = engine.reg_mr(buf.data(), buf.size());
  const RemoteMr self[] = {engine.add_remote(d)};
  constexpr uint32_t kValues = 1000;
  std::atomic<uint64_t> done{0}, failed{0};
  for (uint32_t i = 0; i < kValues; i++)
    engine.submit(Barrier{.dsts = self, .imm = 0x1000 + i}, OnDone::counter(&done, &failed));
  ASSERT_TRUE(wait_until([&] { return done.load() + failed.load() == kValues; }));
  ASSERT_TRUE(wait_until([&] { return engine.nic_stats()[0].imms_received == kValues; }));
  NicStats st = engine.nic_stats()[0];
  EXPECT_EQ(st.imms_dropped, kValues - 100);
  uint64_t kept = 0;
  for (uint32_t i = 0; i < kValues; i++) kept += engine.imm_count(0x1000 + i);
  EXPECT_EQ(kept, 100u);
  // Expected values are never dropped: an expectation waits for one more of a new value.
  std::atomic<int> met{kDonePending};
  engine.expect_imm_count(0x9999, 1, OnDone::flag(&met));
  engine.submit(Barrier{.dsts = self, .imm = 0x9999}, OnDone::none());
  ASSERT_TRUE(wait_until([&] { return ended(met); }));
  EXPECT_EQ(met.load(), kDoneSucceeded);
  engine.dereg_mr(h);
}

// ---- receive pools -------------------------------------------------------------------------

TEST(Hardening, ReceivePoolsLargerThanTheProviderQueueNeitherHangNorLoseMessages) {
  std::atomic<uint64_t> got{0}, sent{0};  // outlive the engines
  EngineConfig small = config_for(kTcp);
  small.max_message_size = 64;  // receive buffers are at least this long: 20,000 of them
  TransferEngine a(config_for(kTcp)), b(small);
  // Far more buffers than tcp;ofi_rxm's receive queue holds: the call returns, the worker keeps
  // serving, and the buffers it could not post yet are posted as room appears.
  b.submit_recvs(64, 20000, [&](std::span<const std::byte> m) {
    if (m.size() == 8) got++;
  });
  self_write_lands(b);
  uint64_t x = 42;
  for (int i = 0; i < 3000; i++)
    a.submit_send(b.main_address(), std::as_bytes(std::span(&x, 1)), OnDone::counter(&sent));
  EXPECT_TRUE(wait_until([&] { return got.load() == 3000; })) << got.load() << " of 3000 arrived";
}

TEST(Hardening, ReceivePoolsBeyondWhatMemoryCanHoldAreRejected) {
  TransferEngine a(config_for(kTcp));
  try {
    a.submit_recvs(size_t{1} << 30, 64, [](std::span<const std::byte>) {});
    ADD_FAILURE() << "a 64 GiB receive pool was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
  }
  try {
    a.submit_recvs(SIZE_MAX / 2, 4, [](std::span<const std::byte>) {});  // len * count overflows
    ADD_FAILURE() << "an overflowing receive pool was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
  }
  self_write_lands(a);
}

// ---- fairness ------------------------------------------------------------------------------

// A 10,000-page transfer is not overtaken by the small writes submitted after it: pending work is
// posted first-in first-out (freed room used to go to each new request first, so a stream of
// small writes could starve the large one until it timed out). The worker's post timings are
// recorded in the order transfers finished posting, so none of the small ones may come first.
TEST(Hardening, ALargePendingTransferIsNotOvertakenBySmallWritesSubmittedAfterIt) {
  EngineConfig cfg = config_for(kTcp);
  cfg.max_in_flight_per_nic = 8;  // little room: every freed slot is contested
  cfg.record_post_timings = true;
  // What this proves is the order, not a deadline: the small writes wait behind the large one by
  // design, which under TSan on a loaded 2-core machine took over the default 60 s.
  cfg.transfer_timeout = std::chrono::minutes(10);
  constexpr auto kPatience = std::chrono::minutes(10);
  constexpr uint32_t kPages = 10000, kSmall = 20000;
  constexpr uint64_t kPage = 256;
  auto src = random_bytes(kPage * kPages, 4);  // buffers and counters outlive the engines
  std::vector<uint8_t> dst(kPage * kPages, 0);
  std::atomic<uint64_t> small_done{0}, small_failed{0};
  std::atomic<int> big{kDonePending};
  TransferEngine a(cfg), b(cfg);
  auto [hs, ds] = a.reg_mr(src.data(), src.size());
  auto [hd, dd] = b.reg_mr(dst.data(), dst.size());
  std::vector<uint32_t> idx(kPages);
  for (uint32_t i = 0; i < kPages; i++) idx[i] = i;
  constexpr uint32_t kImm = 0x66;
  const RemoteMr rd = a.add_remote(dd);
  a.submit(PagedWrites{.page_len = kPage, .src = hs, .src_pages = {idx, kPage, 0}, .dst = rd,
                       .dst_pages = {idx, kPage, 0}, .imm = kImm},
           OnDone::flag(&big));
  // A steady stream, one small write every 10 us for as long as the large transfer runs (at most
  // kSmall), so that new requests keep arriving while the NIC's slots are contested.
  uint64_t sent = 0;
  auto next = std::chrono::steady_clock::now();
  while (!ended(big) && sent < kSmall) {
    while (std::chrono::steady_clock::now() < next) {
    }
    next += std::chrono::microseconds(10);
    a.submit(SingleWrite{.len = 64, .src = {hs, 0}, .dst = {rd, 0}, .imm = kImm},
             OnDone::counter(&small_done, &small_failed));
    sent++;
  }
  ASSERT_TRUE(wait_until([&] { return ended(big); }, kPatience));
  EXPECT_EQ(big.load(), kDoneSucceeded);
  EXPECT_TRUE(wait_until([&] { return small_done.load() + small_failed.load() == sent; }, kPatience));
  EXPECT_EQ(small_failed.load(), 0u);
  std::vector<PostTiming> order = a.take_post_timings();
  size_t overtaken = 0;
  bool big_posted = false;
  for (const PostTiming& p : order) {
    if (p.writes == kPages) big_posted = true;
    else if (!big_posted) overtaken++;
  }
  EXPECT_TRUE(big_posted);
  EXPECT_EQ(overtaken, 0u) << "small writes submitted later were posted before the large transfer";
  std::atomic<int> landed{kDonePending};  // the receiver's word that every write landed
  b.expect_imm_count(kImm, kPages + sent, OnDone::flag(&landed));
  ASSERT_TRUE(wait_until([&] { return ended(landed); }, kPatience));
  EXPECT_EQ(dst, src);  // the small writes carry page 0's first bytes too
}

// ---- back-pressure of one peer -------------------------------------------------------------

// A peer that cannot take work (its connection never comes up) holds back only its own
// transfers: a write to a healthy peer on the same NIC completes at once, not after the stuck
// one times out.
TEST(Hardening, OnePeerPushingBackDoesNotStallTheOthers) {
  auto src = random_bytes(1 << 16, 6);  // buffers outlive the engines
  std::vector<uint8_t> hbuf(1 << 16, 0), sbuf(1 << 16, 0);
  TransferEngine healthy(config_for(kTcp)), stuck(config_for(kTcp));
  EngineConfig cfg = config_for(kTcp);
  cfg.transfer_timeout = std::chrono::seconds(30);
  cfg.faults.enabled = true;
  cfg.faults.busy_peers = {stuck.main_address().nic(0)};
  TransferEngine a(cfg);
  auto [hs, ds] = a.reg_mr(src.data(), src.size());
  auto [hh, dh] = healthy.reg_mr(hbuf.data(), hbuf.size());
  auto [hst, dst] = stuck.reg_mr(sbuf.data(), sbuf.size());
  std::atomic<int> to_stuck{kDonePending}, to_healthy{kDonePending};
  a.submit(SingleWrite{.len = src.size(), .src = {hs, 0}, .dst = {a.add_remote(dst), 0}},
           OnDone::flag(&to_stuck));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  std::atomic<int> landed{kDonePending};
  healthy.expect_imm_count(0x67, 1, OnDone::flag(&landed));
  a.submit(SingleWrite{.len = src.size(), .src = {hs, 0}, .dst = {a.add_remote(dh), 0}, .imm = 0x67},
           OnDone::flag(&to_healthy));
  EXPECT_TRUE(wait_until([&] { return ended(to_healthy); }, std::chrono::seconds(10)))
      << "the healthy peer waited for the stuck one";
  EXPECT_EQ(to_healthy.load(), kDoneSucceeded);
  EXPECT_FALSE(ended(to_stuck));
  // Removing the stuck peer ends its transfer at once, with kCancelled.
  a.remove_peer(stuck.main_address());
  EXPECT_TRUE(wait_until([&] { return ended(to_stuck); }, std::chrono::seconds(10)));
  EXPECT_EQ(to_stuck.load(), kDoneFailed);
  ASSERT_TRUE(wait_until([&] { return ended(landed); }));
  EXPECT_EQ(hbuf, src);
}

// ---- dereg_mr racing with posting ----------------------------------------------------------

// One thread submits paged writes from region A in a loop while another deregisters A and
// registers region B (other bytes) in its slot: the receiver must only ever see A's bytes (or
// nothing), never B's.
TEST(Hardening, DeregisteringWhileWritesArePostedNeverSendsAnotherRegionsBytes) {
  EngineConfig cfg = config_for(kTcp);
  cfg.max_in_flight_per_nic = 4;  // transfers wait pending, where a stale slot used to be read
  constexpr uint64_t kPage = 4096;
  constexpr uint32_t kPages = 64;
  std::vector<uint8_t> region_a(kPage * kPages, 0xAA), region_b(kPage * kPages, 0xBB);  // outlive
  std::vector<uint8_t> dst(kPage * kPages, 0);
  TransferEngine a(cfg), b(config_for(kTcp));
  auto [hd, dd] = b.reg_mr(dst.data(), dst.size());
  std::vector<uint32_t> idx(kPages);
  for (uint32_t i = 0; i < kPages; i++) idx[i] = i;
  const RemoteMr rd = a.add_remote(dd);
  for (int round = 0; round < 20; round++) {
    auto [ha, da] = a.reg_mr(region_a.data(), region_a.size());
    std::atomic<bool> stop{false};
    std::atomic<uint64_t> done{0}, failed{0};
    std::atomic<uint64_t> submitted{0};
    std::thread writer([&] {
      while (!stop.load()) {
        try {
          a.submit(PagedWrites{.page_len = kPage, .src = ha, .src_pages = {idx, kPage, 0}, .dst = rd,
                               .dst_pages = {idx, kPage, 0}},
                   OnDone::counter(&done, &failed));
          submitted++;
        } catch (const Error& e) {
          EXPECT_EQ(e.code(), ErrorCode::kNotFound) << e.what();  // the handle went stale
          break;
        }
      }
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    a.dereg_mr(ha);
    auto [hb, db] = a.reg_mr(region_b.data(), region_b.size());  // likely the same slot
    stop = true;
    writer.join();
    EXPECT_TRUE(wait_until([&] { return done.load() + failed.load() == submitted.load(); }));
    // A barrier behind them on the same in-order connection: once the receiver counts it, every
    // WRITE before it has landed. Whatever landed came from A.
    std::atomic<int> fence{kDonePending};
    b.expect_imm_count(0x68, 1, OnDone::flag(&fence));
    const RemoteMr to_b[] = {rd};
    a.submit(Barrier{.dsts = to_b, .imm = 0x68}, OnDone::none());
    ASSERT_TRUE(wait_until([&] { return ended(fence); }));
    for (size_t i = 0; i < dst.size(); i++)
      if (dst[i] == 0xBB) {
        ADD_FAILURE() << "round " << round << ": byte " << i << " came from the region registered after dereg_mr";
        break;
      }
    a.dereg_mr(hb);
  }
}

// ---- calls racing with shutdown ------------------------------------------------------------

// Completion callbacks that call into the engine while it is destroyed: each call either works
// or throws kShutdown, and the destructor returns (it used to be able to lose a request pushed
// after the worker's last drain, and deadlock on a control call waiting for it).
TEST(Hardening, CallsRacingWithShutdownEndInShutdownNeverAHang) {
  for (int round = 0; round < 30; round++) {
    std::atomic<uint64_t> shutdown_errors{0}, other_errors{0};
    std::vector<uint8_t> buf(4096, 3);
    {
      TransferEngine engine(config_for(kTcp));
      auto [h, d] = engine.reg_mr(buf.data(), buf.size());
      const RemoteMr self = engine.add_remote(d);
      for (int i = 0; i < 200; i++)
        engine.submit(SingleWrite{.len = 64, .src = {h, 0}, .dst = {self, 128}},
                      OnDone::callback([&, h = h](const Status&) {
                                     try {
                                       engine.imm_count(1);  // a control round trip
                                       engine.submit(SingleWrite{.len = 64, .src = {h, 0}, .dst = {self, 256}},
                                                     OnDone::none());
                                     } catch (const Error& e) {
                                       // kNotFound: the region went with the worker's shutdown.
                                       bool expected = e.code() == ErrorCode::kShutdown ||
                                                       e.code() == ErrorCode::kNotFound;
                                       (expected ? shutdown_errors : other_errors)++;
                                     }
                                   }));
    }  // destroyed with callbacks still running
    EXPECT_EQ(other_errors.load(), 0u);
  }
}

// ---- removing peers ------------------------------------------------------------------------

TEST(Hardening, RemovedPeersAreForgottenAndReachableAgain) {
  auto src = random_bytes(1 << 16, 8);  // buffers outlive the engines
  std::vector<uint8_t> dst(1 << 16, 0);
  TransferEngine a(config_for(kTcp)), b(config_for(kTcp));
  auto [hs, ds] = a.reg_mr(src.data(), src.size());
  auto [hd, dd] = b.reg_mr(dst.data(), dst.size());
  EXPECT_EQ(a.peer_count(), 0u);
  for (int round = 0; round < 5; round++) {
    std::fill(dst.begin(), dst.end(), 0);
    std::atomic<int> done{kDonePending}, landed{kDonePending};
    b.expect_imm_count(0x44, 1, OnDone::flag(&landed));
    const RemoteMr rd = a.add_remote(dd);
    a.submit(SingleWrite{.len = src.size(), .src = {hs, 0}, .dst = {rd, 0}, .imm = 0x44},
             OnDone::flag(&done));
    ASSERT_TRUE(wait_until([&] { return ended(done) && ended(landed); }));
    EXPECT_EQ(done.load(), kDoneSucceeded) << "round " << round;
    EXPECT_EQ(dst, src) << "round " << round;
    EXPECT_EQ(a.peer_count(), 1u);
    a.remove_peer(b.main_address());
    EXPECT_EQ(a.peer_count(), 0u);
    a.remove_peer(b.main_address());  // unknown now: ignored
    try {  // the peer's interned regions went with it
      a.submit(SingleWrite{.len = 1, .src = {hs, 0}, .dst = {rd, 0}}, OnDone::none());
      ADD_FAILURE() << "a region of a removed peer is still interned";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kNotFound) << e.what();
    }
  }
  try {
    TransferEngine wide(config_for(ProviderCase{"tcp;ofi_rxm", 2, false}));
    a.remove_peer(wide.main_address());
    ADD_FAILURE() << "a peer with another NIC count was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  }
}

// ---- interned regions ----------------------------------------------------------------------

// The remote table grows in chunks of 256 slots as regions are interned: handles in later chunks
// work, removed ones turn stale, and freed slots are reused without reviving old handles.
TEST(Hardening, InternedRegionsBeyondOneChunkWorkAndRemoveCleanly) {
  std::vector<uint8_t> src = random_bytes(4096, 21), dst(4096, 0);  // outlive the engines
  TransferEngine a(config_for(kTcp)), b(config_for(kTcp));
  auto [hs, ds] = a.reg_mr(src.data(), src.size());
  auto [hd, dd] = b.reg_mr(dst.data(), dst.size());
  std::vector<RemoteMr> remotes;  // 600 distinct descriptors of b's region (different lengths)
  for (uint64_t i = 0; i < 600; i++)
    remotes.push_back(a.add_remote(MrDesc(dd.owner(), dd.addr(), dd.len() - i, dd.keys())));
  for (size_t i = 1; i < remotes.size(); i++) ASSERT_NE(remotes[i], remotes[i - 1]);
  std::atomic<int> landed{kDonePending}, done{kDonePending};
  b.expect_imm_count(0x45, 1, OnDone::flag(&landed));
  a.submit(SingleWrite{.len = 3000, .src = {hs, 0}, .dst = {remotes[599], 0}, .imm = 0x45}, OnDone::flag(&done));
  ASSERT_TRUE(wait_until([&] { return ended(done) && ended(landed); }));
  EXPECT_EQ(done.load(), kDoneSucceeded);
  EXPECT_TRUE(std::equal(src.begin(), src.begin() + 3000, dst.begin()));
  try {  // the last region is 599 bytes shorter: bounds come from the interned descriptor
    a.submit(SingleWrite{.len = 4096, .src = {hs, 0}, .dst = {remotes[599], 0}}, OnDone::none());
    ADD_FAILURE() << "a write beyond the interned length was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kOutOfBounds) << e.what();
  }
  for (size_t i = 0; i < remotes.size(); i += 2) a.remove_remote(remotes[i]);
  for (uint64_t i = 600; i < 900; i++)  // reuses the freed slots, then grows
    a.add_remote(MrDesc(dd.owner(), dd.addr(), dd.len() - i, dd.keys()));
  for (size_t i = 0; i < remotes.size(); i += 2) {
    try {
      a.submit(SingleWrite{.len = 1, .src = {hs, 0}, .dst = {remotes[i], 0}}, OnDone::none());
      ADD_FAILURE() << "removed handle " << i << " still accepted";
      break;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kNotFound);
    }
  }
  EXPECT_EQ(a.peer_count(), 1u);  // one peer, however many of its regions
}

// ---- a wedged provider ----------------------------------------------------------------

// The provider stops returning (as shm spinning on a lock a killed peer held): calls that wait for
// the worker throw kTimeout naming the cause, and closing the engine returns instead of hanging.
TEST(Hardening, AWedgedProviderNeverHangsTheCaller) {
  EngineConfig cfg = config_for(kTcp);
  cfg.worker_stall_timeout = std::chrono::milliseconds(500);
  cfg.faults.enabled = true;
  cfg.faults.wedge_after_posts = 1;
  // The abandoned worker may still hold it: never freed, not even at exit.
  static std::vector<uint8_t>& buf = *new std::vector<uint8_t>(4096, 1);
  auto start = std::chrono::steady_clock::now();
  {
    TransferEngine engine(cfg);
    auto [h, d] = engine.reg_mr(buf.data(), buf.size());
    engine.submit(SingleWrite{.len = 64, .src = {h, 0}, .dst = {engine.add_remote(d), 128}},
                  OnDone::none());  // the one post; then it wedges
    try {
      for (int i = 0; i < 1000; i++) engine.imm_count(1);  // a control round trip each
      ADD_FAILURE() << "the wedged worker kept answering";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kTimeout) << e.what();
      EXPECT_NE(std::string(e.what()).find("no progress"), std::string::npos) << e.what();
    }
  }  // closes: abandons the worker
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(secs, 20.0) << "closing waited for the wedged worker";
}

// The wedge lifts after the engine gave the worker up (as shm's lock once the dead peer's watcher
// frees it): the worker wakes and must leave the provider alone, since the process may be exiting
// and tearing the provider down beneath it (the use-after-free TSan caught with shm).
TEST(Hardening, AnAbandonedWorkerLeavesItsProviderAloneWhenItWakes) {
  EngineConfig cfg = config_for(kTcp);
  cfg.worker_stall_timeout = std::chrono::milliseconds(200);
  cfg.faults.enabled = true;
  cfg.faults.wedge_after_posts = 1;
  // Long beside the stall timeout, so that the close has given up before the wedge lifts even
  // on a loaded machine.
  cfg.faults.wedge_for = std::chrono::milliseconds(2500);
  static std::vector<uint8_t>& buf = *new std::vector<uint8_t>(4096, 1);  // see above
  uint64_t calls_before = fault_calls_after_wedge();
  auto start = std::chrono::steady_clock::now();
  {
    TransferEngine engine(cfg);
    auto [h, d] = engine.reg_mr(buf.data(), buf.size());
    engine.submit(SingleWrite{.len = 64, .src = {h, 0}, .dst = {engine.add_remote(d), 128}},
                  OnDone::none());
    // Wait for the wedge (a close that came first would close the NICs before any poll).
    EXPECT_THROW(for (int i = 0; i < 1000; i++) engine.imm_count(1), Error);
  }  // closes: abandons the wedged worker
  auto closed = std::chrono::steady_clock::now();
  ASSERT_LT(closed - start, cfg.faults.wedge_for) << "the close outlasted the wedge";
  // Past the lift, with time for the woken worker to have polled, posted or closed its NICs.
  std::this_thread::sleep_until(start + cfg.faults.wedge_for + std::chrono::milliseconds(700));
  EXPECT_EQ(fault_calls_after_wedge(), calls_before)
      << "the abandoned worker called into its provider after the wedge lifted";
}

}  // namespace
}  // namespace fabric::testing
