// What only the verbs provider has: its UD handshake (lost packets, a peer that never answers) and
// the GID choice. Runs on a real verbs device (Soft-RoCE in the VM of tests/rxe); skips elsewhere.
#include <gtest/gtest.h>

#include <atomic>
#include <csignal>
#include <cstring>

#include "fabric/fabric.h"
#include "process_pair.h"
#include "test_support.h"

namespace fabric::testing {
namespace {

using tools::Channel;

const ProviderCase kVerbs{"verbs", 1, false};
constexpr uint64_t kLen = 256 * 1024 + 5;

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
    engine.submit_single_write(kLen, h, 0, dst, 0, OnDone::flag(&done), WriteOptions{7, std::nullopt});
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
      engine.submit_single_write(kLen, h, 0, dst, 0, OnDone::callback([&, i](const Status& s) {
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

}  // namespace
}  // namespace fabric::testing
