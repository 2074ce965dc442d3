// Errors: bad input is rejected at submit time with a clear message and loses nothing; pending
// work ends with an error at shutdown; transfers to a dead peer end within the timeout.
#include <gtest/gtest.h>

#include <atomic>
#include <mutex>

#include "fabric/fabric.h"
#include "test_support.h"

namespace fabric::testing {
namespace {

const ProviderCase kTcp1{"tcp;ofi_rxm", 1, false};
const ProviderCase kTcp2{"tcp;ofi_rxm", 2, false};

TEST(EngineErrors, BadSubmissionsAreRejectedSynchronouslyAndLoseNothing) {
  TransferEngine a(config_for(kTcp1)), b(config_for(kTcp1)), wide(config_for(kTcp2));
  std::vector<uint8_t> src = random_bytes(1 << 16, 1), dst(1 << 16, 0), other(4096, 0);
  auto [hs, ds] = a.reg_mr(src.data(), src.size());
  auto [hd, dd] = b.reg_mr(dst.data(), dst.size());
  auto [hw, dw] = wide.reg_mr(other.data(), other.size());
  std::atomic<int> calls{0};
  auto count = OnDone::callback([&](const Status&) { calls++; });

  const RemoteMr rd = a.add_remote(dd);
  EXPECT_EQ(a.add_remote(dd), rd) << "add_remote is idempotent";
  auto single = [&](uint64_t len, LocalSlice from, RemoteSlice to) {
    a.submit(SingleWrite{.len = len, .src = from, .dst = to}, count);
  };
  expect_error(ErrorCode::kOutOfBounds, "source", [&] { single(100, {hs, src.size() - 99}, {rd, 0}); });
  expect_error(ErrorCode::kOutOfBounds, "destination", [&] { single(100, {hs, 0}, {rd, dst.size() - 50}); });
  expect_error(ErrorCode::kOutOfBounds, "source",
               [&] { single(1, {hs, UINT64_MAX}, {rd, 0}); });  // offset + len overflows
  expect_error(ErrorCode::kNotFound, "MrHandle", [&] { single(1, {MrHandle{77, 1}, 0}, {rd, 0}); });
  expect_error(ErrorCode::kNotFound, "MrHandle", [&] { single(1, {MrHandle{}, 0}, {rd, 0}); });
  expect_error(ErrorCode::kNotFound, "RemoteMr", [&] { single(1, {hs, 0}, {RemoteMr{}, 0}); });
  expect_error(ErrorCode::kNotFound, "RemoteMr", [&] { single(1, {hs, 0}, {RemoteMr{rd.slot, rd.generation + 2, rd.engine}, 0}); });
  expect_error(ErrorCode::kInvalidArgument, "same number of NICs",
               [&] { a.add_remote(dw); });  // descriptor of a 2-NIC engine
  expect_error(ErrorCode::kInvalidArgument, "nic 1", [&] {
    a.submit(SingleWrite{.len = 1, .src = {hs, 0}, .dst = {rd, 0}, .nic = 1}, count);
  });
  for (uint32_t bad : {0u, 257u})
    expect_error(ErrorCode::kInvalidArgument, "num_shards", [&] {
      a.submit(SingleWrite{.len = 1, .src = {hs, 0}, .dst = {rd, 0}, .num_shards = bad}, count);
    });
  const std::vector<uint32_t> i3{0, 1, 2}, i2{0, 1}, i_far{0, 16};
  Pages three{i3, 4096, 0}, two{i2, 4096, 0}, far{i_far, 4096, 0}, huge_stride{i2, UINT64_MAX, 0};
  auto paged = [&](uint64_t page_len, Pages from, Pages to) {
    a.submit(PagedWrites{.page_len = page_len, .src = hs, .src_pages = from, .dst = rd, .dst_pages = to}, count);
  };
  expect_error(ErrorCode::kInvalidArgument, "3 source pages but 2", [&] { paged(4096, three, two); });
  expect_error(ErrorCode::kInvalidArgument, "page_len", [&] { paged(0, two, two); });
  expect_error(ErrorCode::kOutOfBounds, "destination page", [&] { paged(4096, two, far); });
  expect_error(ErrorCode::kOutOfBounds, "source page", [&] { paged(4096, far, two); });
  expect_error(ErrorCode::kOutOfBounds, "destination page", [&] { paged(16, two, huge_stride); });
  expect_error(ErrorCode::kOutOfBounds, "slice 1", [&] {
    const ScatterSlice slices[] = {{10, 0, {rd, 0}}, {10, src.size(), {rd, 0}}};
    a.submit(Scatter{.src = hs, .slices = slices}, count);
  });
  expect_error(ErrorCode::kNotFound, "RemoteMr", [&] {
    const RemoteMr dsts[] = {rd, RemoteMr{}};
    a.submit(Barrier{.dsts = dsts, .imm = 1}, count);
  });
  std::vector<uint8_t> big(32768);
  expect_error(ErrorCode::kInvalidArgument, "max_message_size",
               [&] { a.submit_send(b.main_address(), std::as_bytes(std::span(big)), count); });
  const RemoteMr members[] = {rd, rd};
  PeerGroupHandle group = a.add_peer_group(members);
  EXPECT_EQ(group.size, 2u);
  expect_error(ErrorCode::kInvalidArgument, "one slice per member", [&] {
    const GroupSlice slices[] = {{10, 0, 0}};
    a.submit(GroupScatter{.group = group, .src = hs, .slices = slices}, count);
  });
  expect_error(ErrorCode::kOutOfBounds, "member 1", [&] {
    const GroupSlice slices[] = {{10, 0, 0}, {10, 0, dst.size()}};
    a.submit(GroupScatter{.group = group, .src = hs, .slices = slices}, count);
  });
  expect_error(ErrorCode::kNotFound, "peer group",
               [&] { a.submit(GroupBarrier{.group = PeerGroupHandle{999, 1}, .imm = 1}, count); });
  expect_error(ErrorCode::kNotFound, "RemoteMr", [&] {
    const RemoteMr unknown[] = {RemoteMr{}};
    a.add_peer_group(unknown);
  });
  // A removed remote region is stale, and its slot's next occupant does not revive the handle.
  const RemoteMr gone = a.add_remote(ds);
  a.remove_remote(gone);
  expect_error(ErrorCode::kNotFound, "RemoteMr", [&] { single(1, {hs, 0}, {gone, 0}); });
  expect_error(ErrorCode::kNotFound, "remove_remote", [&] { a.remove_remote(gone); });
  const RemoteMr again = a.add_remote(ds);
  EXPECT_NE(again, gone);
  expect_error(ErrorCode::kNotFound, "RemoteMr", [&] { single(1, {hs, 0}, {gone, 0}); });
  expect_error(ErrorCode::kInvalidArgument, "reg_mr", [&] { a.reg_mr(nullptr, 10); });

  // A deregistered handle is stale, even when its slot is reused.
  std::vector<uint8_t> tmp(4096);
  auto [ht, dt] = a.reg_mr(tmp.data(), tmp.size());
  a.dereg_mr(ht);
  expect_error(ErrorCode::kNotFound, "deregistered", [&] { single(1, {ht, 0}, {rd, 0}); });
  expect_error(ErrorCode::kNotFound, "MrHandle", [&] { a.dereg_mr(ht); });
  auto [ht2, dt2] = a.reg_mr(tmp.data(), tmp.size());
  EXPECT_EQ(ht2.slot, ht.slot);
  expect_error(ErrorCode::kNotFound, "MrHandle", [&] { single(1, {ht, 0}, {rd, 0}); });

  // Nothing was submitted, nothing completes; a valid transfer still works.
  std::atomic<int> ok{kDonePending};
  a.submit(SingleWrite{.len = src.size(), .src = {hs, 0}, .dst = {rd, 0}, .imm = 5}, OnDone::flag(&ok));
  std::atomic<int> arrived{kDonePending};
  b.expect_imm_count(5, 1, OnDone::flag(&arrived));
  EXPECT_TRUE(wait_until([&] { return ok.load() != kDonePending && arrived.load() != kDonePending; }));
  EXPECT_EQ(ok.load(), kDoneSucceeded);
  EXPECT_EQ(arrived.load(), kDoneSucceeded);
  EXPECT_EQ(dst, src);
  EXPECT_EQ(calls.load(), 0);
}

TEST(EngineErrors, MalformedDescriptorsFromPeersAreRejected) {
  TransferEngine a(config_for(kTcp1));
  std::vector<uint8_t> buf(4096);
  auto [h, d] = a.reg_mr(buf.data(), buf.size());
  auto bytes = d.to_bytes();
  bytes.pop_back();
  EXPECT_THROW(MrDesc::from_bytes(bytes), Error);
  EXPECT_THROW(NetAddr::from_hex("zz"), Error);
  EXPECT_EQ(MrDesc::from_hex(d.to_hex()), d);
  EXPECT_EQ(NetAddr::from_hex(a.main_address().to_hex()), a.main_address());
}

TEST(EngineErrors, ShutdownEndsEveryPendingTransferAndExpectationOnce) {
  std::mutex mu;
  std::vector<Status> statuses;
  size_t submitted = 0;
  {
    EngineConfig cfg = config_for(kTcp1);
    cfg.transfer_timeout = std::chrono::seconds(60);
    auto gone = std::make_unique<TransferEngine>(config_for(kTcp1));
    std::vector<uint8_t> dst(1 << 20);
    MrDesc dead = gone->reg_mr(dst.data(), dst.size()).second;
    gone.reset();  // its address no longer answers

    TransferEngine a(cfg);
    std::vector<uint8_t> src(1 << 20);
    auto [h, d] = a.reg_mr(src.data(), src.size());
    auto record = OnDone::callback([&](const Status& s) {
      std::lock_guard lock(mu);
      statuses.push_back(s);
    });
    const RemoteMr to_dead = a.add_remote(dead);
    for (int i = 0; i < 20; i++, submitted++)
      a.submit(SingleWrite{.len = src.size(), .src = {h, 0}, .dst = {to_dead, 0}}, record);
    a.expect_imm_count(99, 1, record);
    submitted++;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }  // the destructor must end everything, exactly once, and return
  std::lock_guard lock(mu);
  ASSERT_EQ(statuses.size(), submitted);
  size_t shutdown = 0;
  for (auto& s : statuses) {
    EXPECT_FALSE(s.ok());
    if (s.code() == ErrorCode::kShutdown) shutdown++;
    else EXPECT_EQ(s.code(), ErrorCode::kProvider) << s.message();
  }
  EXPECT_GE(shutdown, 1u);  // at least the expectation
}

TEST(EngineErrors, CallsFromCallbacksDuringDestructionAreRefusedNotCrashed) {
  std::atomic<int> refused{0}, other{0};
  {
    auto engine = std::make_unique<TransferEngine>(config_for(kTcp1));
    std::vector<uint8_t> buf(4096);
    auto [h, d] = engine->reg_mr(buf.data(), buf.size());
    TransferEngine* e = engine.get();
    for (uint32_t imm = 0; imm < 8; imm++)
      engine->expect_imm_count(imm, 1, OnDone::callback([&, e, h, d](const Status&) {
        // Runs during ~TransferEngine (the expectation ends with kShutdown).
        try {
          e->submit(SingleWrite{.len = 16, .src = {h, 0}, .dst = {e->add_remote(d), 0}},
                    OnDone::none());
          e->expect_imm_count(100, 1, OnDone::none());
          other++;
        } catch (const Error& err) {
          (err.code() == ErrorCode::kShutdown ? refused : other)++;
        }
      }));
    engine.reset();
  }
  EXPECT_EQ(refused.load(), 8);
  EXPECT_EQ(other.load(), 0);
}

TEST(EngineErrors, CallbackExceptionsDoNotKillTheEngine) {
  TransferEngine a(config_for(kTcp1));
  std::vector<uint8_t> buf(4096, 1), dst(4096, 0);
  auto [h, d] = a.reg_mr(buf.data(), buf.size());
  auto [h2, d2] = a.reg_mr(dst.data(), dst.size());
  std::atomic<int> after{kDonePending};
  a.submit(SingleWrite{.len = 16, .src = {h, 0}, .dst = {a.add_remote(d2), 0}},
           OnDone::callback([](const Status&) {
                          throw std::runtime_error("user bug");
                        }));
  a.submit(SingleWrite{.len = 16, .src = {h, 0}, .dst = {a.add_remote(d2), 16}},
           OnDone::flag(&after));
  EXPECT_TRUE(wait_until([&] { return after.load() != kDonePending; }));
  EXPECT_EQ(after.load(), kDoneSucceeded);
}

TEST(EngineErrors, BadConfigurationsAreRejected) {
  EngineConfig none = config_for(kTcp1);
  none.nics.clear();
  EXPECT_THROW(TransferEngine{none}, Error);
  EngineConfig five = config_for(kTcp1);
  five.nics.resize(5);
  EXPECT_THROW(TransferEngine{five}, Error);
  EngineConfig bogus = config_for(kTcp1);
  bogus.provider = "no-such-provider";
  try {
    TransferEngine e(bogus);
    ADD_FAILURE() << "opened a provider that does not exist";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kProvider);
    EXPECT_NE(std::string(e.what()).find("no-such-provider"), std::string::npos);
  }
}

}  // namespace
}  // namespace fabric::testing
