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

template <class F>
void expect_error(ErrorCode code, const std::string& fragment, F&& f) {
  try {
    f();
    ADD_FAILURE() << "no error; expected " << to_string(code);
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos)
        << "message '" << e.what() << "' lacks '" << fragment << "'";
  }
}

TEST(EngineErrors, BadSubmissionsAreRejectedSynchronouslyAndLoseNothing) {
  TransferEngine a(config_for(kTcp1)), b(config_for(kTcp1)), wide(config_for(kTcp2));
  std::vector<uint8_t> src = random_bytes(1 << 16, 1), dst(1 << 16, 0), other(4096, 0);
  auto [hs, ds] = a.reg_mr(src.data(), src.size());
  auto [hd, dd] = b.reg_mr(dst.data(), dst.size());
  auto [hw, dw] = wide.reg_mr(other.data(), other.size());
  std::atomic<int> calls{0};
  auto count = OnDone::callback([&](const Status&) { calls++; });

  expect_error(ErrorCode::kOutOfBounds, "source", [&] {
    a.submit_single_write(100, hs, src.size() - 99, dd, 0, count);
  });
  expect_error(ErrorCode::kOutOfBounds, "destination", [&] {
    a.submit_single_write(100, hs, 0, dd, dst.size() - 50, count);
  });
  expect_error(ErrorCode::kOutOfBounds, "source", [&] {
    a.submit_single_write(1, hs, UINT64_MAX, dd, 0, count);  // offset + len overflows
  });
  expect_error(ErrorCode::kNotFound, "MrHandle", [&] {
    a.submit_single_write(1, MrHandle{77, 1}, 0, dd, 0, count);
  });
  expect_error(ErrorCode::kNotFound, "MrHandle", [&] {
    a.submit_single_write(1, MrHandle{}, 0, dd, 0, count);
  });
  expect_error(ErrorCode::kInvalidArgument, "same number of NICs", [&] {
    a.submit_single_write(1, hs, 0, dw, 0, count);  // descriptor of a 2-NIC engine
  });
  expect_error(ErrorCode::kInvalidArgument, "WriteOptions::nic", [&] {
    a.submit_single_write(1, hs, 0, dd, 0, count, WriteOptions{std::nullopt, 1});
  });
  Pages three{{0, 1, 2}, 4096, 0}, two{{0, 1}, 4096, 0}, far{{0, 16}, 4096, 0};
  expect_error(ErrorCode::kInvalidArgument, "3 source pages but 2",
               [&] { a.submit_paged_writes(4096, hs, three, dd, two, count); });
  expect_error(ErrorCode::kInvalidArgument, "page_len",
               [&] { a.submit_paged_writes(0, hs, two, dd, two, count); });
  expect_error(ErrorCode::kOutOfBounds, "destination page",
               [&] { a.submit_paged_writes(4096, hs, two, dd, far, count); });
  expect_error(ErrorCode::kOutOfBounds, "source page",
               [&] { a.submit_paged_writes(4096, hs, far, dd, two, count); });
  Pages huge_stride{{0, 1}, UINT64_MAX, 0};
  expect_error(ErrorCode::kOutOfBounds, "destination page",
               [&] { a.submit_paged_writes(16, hs, two, dd, huge_stride, count); });
  expect_error(ErrorCode::kOutOfBounds, "destination 1", [&] {
    a.submit_scatter(std::nullopt, hs, {{10, 0, dd, 0}, {10, src.size(), dd, 0}}, count);
  });
  std::vector<uint8_t> big(32768);
  expect_error(ErrorCode::kInvalidArgument, "max_message_size",
               [&] { a.submit_send(b.main_address(), std::as_bytes(std::span(big)), count); });
  PeerGroupHandle only_a = a.add_peer_group({a.main_address()});
  expect_error(ErrorCode::kInvalidArgument, "peer group", [&] {
    a.submit_scatter(only_a, hs, {{10, 0, dd, 0}}, count);
  });
  expect_error(ErrorCode::kNotFound, "peer group",
               [&] { a.submit_barrier(PeerGroupHandle{999}, 1, {dd}, count); });
  expect_error(ErrorCode::kInvalidArgument, "reg_mr", [&] { a.reg_mr(nullptr, 10); });

  // A deregistered handle is stale, even when its slot is reused.
  std::vector<uint8_t> tmp(4096);
  auto [ht, dt] = a.reg_mr(tmp.data(), tmp.size());
  a.dereg_mr(ht);
  expect_error(ErrorCode::kNotFound, "deregistered",
               [&] { a.submit_single_write(1, ht, 0, dd, 0, count); });
  expect_error(ErrorCode::kNotFound, "MrHandle", [&] { a.dereg_mr(ht); });
  auto [ht2, dt2] = a.reg_mr(tmp.data(), tmp.size());
  EXPECT_EQ(ht2.slot, ht.slot);
  expect_error(ErrorCode::kNotFound, "MrHandle",
               [&] { a.submit_single_write(1, ht, 0, dd, 0, count); });

  // Nothing was submitted, nothing completes; a valid transfer still works.
  std::atomic<int> ok{kDonePending};
  a.submit_single_write(src.size(), hs, 0, dd, 0, OnDone::flag(&ok), WriteOptions{5, std::nullopt});
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
    for (int i = 0; i < 20; i++, submitted++) a.submit_single_write(src.size(), h, 0, dead, 0, record);
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
          e->submit_single_write(16, h, 0, d, 0, OnDone::none());
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
  a.submit_single_write(16, h, 0, d2, 0, OnDone::callback([](const Status&) {
                          throw std::runtime_error("user bug");
                        }));
  a.submit_single_write(16, h, 0, d2, 16, OnDone::flag(&after));
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
