// The EFA-like provider (efa-sim: tcp;ofi_rxm underneath, EFA's attributes above, see
// src/providers/efa_sim/efa_sim.h): the libfabric domain's EFA branches, tested where they can be
// watched closely, on Domains in one process and on engines. The EnginePair and KilledPeer suites
// also run on efa-sim (engine_pair_test.cpp: the "efasim_" cases of the shared provider suite,
// and the "EfaSim/" instances of KilledPeer and KilledMidTransfer).
#include <gtest/gtest.h>

#include <cstring>
#include <thread>
#include <vector>

#include "domain/domain.h"
#include "fabric/fabric.h"
#include "providers/efa_sim/efa_sim.h"
#include "providers/open_domain.h"
#include "test_support.h"

namespace fabric::testing {
namespace {

constexpr uint64_t kBaseMask = (1ull << 48) - 1;

EngineConfig sim_config(size_t nics) {
  EngineConfig cfg;
  cfg.provider = "efa-sim";
  cfg.nics.clear();
  for (size_t k = 0; k < nics; k++) cfg.nics.push_back(NicConfig{"", "127.0.0." + std::to_string(2 + k)});
  cfg.worker_poll = PollMode::kAdaptive;
  cfg.callback_poll = PollMode::kAdaptive;
  cfg.transfer_timeout = std::chrono::seconds(60);
  return cfg;
}

// Two efa-sim Domains in this process (127.0.0.2 writes to 127.0.0.3), polled by the test itself
// (manual progress: both sides must be polled), every completion kept.
struct DomainPair {
  EngineConfig cfg = sim_config(2);
  std::unique_ptr<Domain> a = open_domain(cfg, 0), b = open_domain(cfg, 1);
  PeerId b_at_a = a->insert_peer(b->address());
  std::vector<Completion> at_a, at_b;

  void poll() {
    Completion c[16];
    size_t n = a->poll(c);
    at_a.insert(at_a.end(), c, c + n);
    n = b->poll(c);
    at_b.insert(at_b.end(), c, c + n);
  }
  bool poll_until(const std::function<bool()>& done, std::chrono::milliseconds timeout = std::chrono::seconds(20)) {
    auto deadline = std::chrono::steady_clock::now() + timeout;
    while (!done()) {
      if (std::chrono::steady_clock::now() > deadline) return false;
      poll();
    }
    return true;
  }
  void poll_for(std::chrono::milliseconds d) {
    auto end = std::chrono::steady_clock::now() + d;
    while (std::chrono::steady_clock::now() < end) poll();
  }
  // Posts until the provider takes it (the first operation to a new peer waits for the connection).
  PostResult write(const WriteOp& op, OpContext* ctx) {
    PostResult r;
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while ((r = a->post_write(op, ctx)) == PostResult::kRetry && std::chrono::steady_clock::now() < deadline)
      poll();
    return r;
  }
  size_t completions_of(const OpContext* ctx, Completion::Kind kind) const {
    size_t n = 0;
    for (auto& c : at_a) n += c.context == ctx && c.kind == kind;
    return n;
  }
  std::vector<uint32_t> imms() const {
    std::vector<uint32_t> v;
    for (auto& c : at_b)
      if (c.kind == Completion::Kind::kRemoteImm) v.push_back(c.imm);
    return v;
  }
  ~DomainPair() {
    a.reset();
    b.reset();
  }
};

struct Buffers {
  std::vector<uint8_t> src = random_bytes(4 << 20, 21), dst = std::vector<uint8_t>(4 << 20, 0);
  DomainRegion src_region, dst_region;
  DomainPair& p;
  explicit Buffers(DomainPair& pair) : p(pair) {
    src_region = p.a->register_memory(src.data(), src.size(), Device::host());
    dst_region = p.b->register_memory(dst.data(), dst.size(), Device::host());
  }
  ~Buffers() {
    p.a->deregister_memory(src_region);
    p.b->deregister_memory(dst_region);
  }
  WriteOp op(uint64_t len, uint64_t src_off, uint64_t dst_off, std::optional<uint32_t> imm) const {
    WriteOp w;
    w.src = src.data() + src_off;
    w.len = len;
    w.desc = src_region.desc;
    w.peer = p.b_at_a;
    w.remote_addr = dst_region.remote.base + dst_off;
    w.rkey = dst_region.remote.rkey;
    w.has_imm = imm.has_value();
    w.imm = imm.value_or(0);
    return w;
  }
};

TEST(EfaSim, TheDomainSeesEfaAttributesAndSetsBothEndpointOptionsBeforeEnabling) {
  const efa_sim::Stats before = efa_sim::stats();
  DomainPair p;
  const efa_sim::Stats after = efa_sim::stats();
  EXPECT_EQ(p.a->provider_name(), "efa-sim");
  EXPECT_EQ(after.domains - before.domains, 2u);
  // Reached only where prov_name is "efa": the shim accepted both, before fi_enable.
  EXPECT_EQ(after.shared_memory_permitted_false - before.shared_memory_permitted_false, 2u);
  EXPECT_EQ(after.cuda_api_permitted_false - before.cuda_api_permitted_false, 2u);
  EXPECT_EQ(after.violations, before.violations) << efa_sim::last_violation();

  // FI_MR_VIRT_ADDR: the remote base is the virtual address. FI_MR_PROV_KEY: the shim's key
  // (tcp's key above bit 48, the base below), and the domain asked for none.
  std::vector<uint8_t> buf(1 << 16);
  DomainRegion r = p.b->register_memory(buf.data(), buf.size(), Device::host());
  EXPECT_EQ(r.remote.base, reinterpret_cast<uint64_t>(buf.data()));
  EXPECT_EQ(r.remote.rkey & kBaseMask, reinterpret_cast<uint64_t>(buf.data()));
  EXPECT_NE(r.remote.rkey >> 48, 0u);
  EXPECT_NE(r.desc, nullptr);
  EXPECT_EQ(efa_sim::stats().requested_keys, before.requested_keys);
  p.b->deregister_memory(r);
}

TEST(EfaSim, AWriteLongerThanMaxMsgSizeIsSplitAndCompletesOnceWithOneImmediate) {
  DomainPair p;
  Buffers bufs(p);
  constexpr uint64_t kLen = (1 << 20) + 13;  // 17 pieces of at most 64 KiB
  constexpr uint64_t kPieces = (kLen + efa_sim::kMaxMsgSize - 1) / efa_sim::kMaxMsgSize;
  constexpr uint32_t kImm = 0x8765'4321;      // all 32 bits used; the shim fills the upper 32
  const efa_sim::Stats before = efa_sim::stats();
  OpContext ctx;
  ASSERT_EQ(p.write(bufs.op(kLen, 5, 77, kImm), &ctx), PostResult::kPosted) << p.a->last_error();
  ASSERT_TRUE(p.poll_until([&] { return p.completions_of(&ctx, Completion::Kind::kLocal) > 0 && !p.imms().empty(); }));
  p.poll_for(std::chrono::milliseconds(200));  // nothing more may come

  EXPECT_EQ(p.completions_of(&ctx, Completion::Kind::kLocal), 1u);
  EXPECT_EQ(p.completions_of(&ctx, Completion::Kind::kError), 0u);
  EXPECT_EQ(p.at_a.size(), 1u) << "one completion for the engine's one operation";
  EXPECT_EQ(p.imms(), std::vector<uint32_t>{kImm}) << "one immediate, masked to 32 bits";
  EXPECT_EQ(std::memcmp(bufs.dst.data() + 77, bufs.src.data() + 5, kLen), 0);
  EXPECT_EQ(bufs.dst[76], 0);
  EXPECT_EQ(bufs.dst[77 + kLen], 0);
  const efa_sim::Stats after = efa_sim::stats();
  EXPECT_EQ(after.writes - before.writes, kPieces);
  EXPECT_EQ(after.writes_with_data - before.writes_with_data, 1u) << "the immediate on one piece";
  EXPECT_LE(after.largest_write, efa_sim::kMaxMsgSize);
  EXPECT_EQ(after.violations, before.violations) << efa_sim::last_violation();

  // Without an immediate: 4 pieces, one completion, no immediate. Exactly max_msg_size: 1 piece.
  OpContext plain, exact;
  ASSERT_EQ(p.write(bufs.op(200000, 1 << 21, 1 << 21, std::nullopt), &plain), PostResult::kPosted);
  ASSERT_EQ(p.write(bufs.op(efa_sim::kMaxMsgSize, 3 << 20, 3 << 20, 9), &exact), PostResult::kPosted);
  ASSERT_TRUE(p.poll_until([&] {
    return p.completions_of(&plain, Completion::Kind::kLocal) + p.completions_of(&exact, Completion::Kind::kLocal) == 2 &&
           p.imms().size() == 2;
  }));
  p.poll_for(std::chrono::milliseconds(100));
  EXPECT_EQ(p.at_a.size(), 3u);
  EXPECT_EQ(p.imms(), (std::vector<uint32_t>{kImm, 9}));
  EXPECT_EQ(std::memcmp(bufs.dst.data() + (1 << 21), bufs.src.data() + (1 << 21), 200000), 0);
  EXPECT_EQ(std::memcmp(bufs.dst.data() + (3 << 20), bufs.src.data() + (3 << 20), efa_sim::kMaxMsgSize), 0);
  EXPECT_EQ(efa_sim::stats().writes - after.writes, 4u + 1u);
}

TEST(EfaSim, AFailedPieceFailsItsWriteOnceWithTheFirstErrorAndNoImmediate) {
  DomainPair p;
  Buffers bufs(p);
  constexpr uint64_t kLen = 1 << 20;  // 16 pieces
  // Warm the connection up, so that the counted posts below are the pieces.
  OpContext warm;
  ASSERT_EQ(p.write(bufs.op(8, 0, 0, std::nullopt), &warm), PostResult::kPosted);
  ASSERT_TRUE(p.poll_until([&] { return p.completions_of(&warm, Completion::Kind::kLocal) == 1; }));

  // The third piece completes with an error: the WRITE fails once, its immediate is never sent.
  efa_sim::fail_write_completion(3);
  OpContext c1;
  ASSERT_EQ(p.write(bufs.op(kLen, 0, 0, 0x51), &c1), PostResult::kPosted);
  ASSERT_TRUE(p.poll_until([&] { return p.completions_of(&c1, Completion::Kind::kError) > 0; }));
  p.poll_for(std::chrono::milliseconds(200));
  EXPECT_EQ(p.completions_of(&c1, Completion::Kind::kError), 1u);
  EXPECT_EQ(p.completions_of(&c1, Completion::Kind::kLocal), 0u);
  for (auto& c : p.at_a) {
    if (c.context == &c1) {
      EXPECT_NE(c.error.find("completion error"), std::string::npos) << c.error;
    }
  }
  EXPECT_TRUE(p.imms().empty());

  // The fifth piece is refused at post time: four are with the provider, so the WRITE is taken
  // (kPosted) and fails once those four completed, with the refusal's message.
  efa_sim::fail_write_post(5);
  OpContext c2;
  ASSERT_EQ(p.write(bufs.op(kLen, 0, 0, 0x52), &c2), PostResult::kPosted);
  ASSERT_TRUE(p.poll_until([&] { return p.completions_of(&c2, Completion::Kind::kError) > 0; }));
  p.poll_for(std::chrono::milliseconds(200));
  EXPECT_EQ(p.completions_of(&c2, Completion::Kind::kError), 1u);
  EXPECT_EQ(p.completions_of(&c2, Completion::Kind::kLocal), 0u);
  for (auto& c : p.at_a) {
    if (c.context == &c2) {
      EXPECT_NE(c.error.find("fi_write failed"), std::string::npos) << c.error;
    }
  }

  // The first piece refused: nothing was posted, the post itself fails (the engine's usual path).
  efa_sim::fail_write_post(1);
  OpContext c3;
  EXPECT_EQ(p.write(bufs.op(kLen, 0, 0, 0x53), &c3), PostResult::kFailed);
  EXPECT_NE(p.a->last_error().find("fi_write failed"), std::string::npos) << p.a->last_error();
  p.poll_for(std::chrono::milliseconds(100));
  EXPECT_EQ(p.completions_of(&c3, Completion::Kind::kError) + p.completions_of(&c3, Completion::Kind::kLocal), 0u);
  EXPECT_TRUE(p.imms().empty());

  // The domain still works.
  OpContext c4;
  ASSERT_EQ(p.write(bufs.op(kLen, 0, 0, 0x54), &c4), PostResult::kPosted);
  ASSERT_TRUE(p.poll_until([&] { return p.completions_of(&c4, Completion::Kind::kLocal) == 1 && !p.imms().empty(); }));
  EXPECT_EQ(p.imms(), std::vector<uint32_t>{0x54});
  EXPECT_EQ(std::memcmp(bufs.dst.data(), bufs.src.data(), kLen), 0);
}

TEST(EfaSim, DeregisteringTheSourceOfASplitWriteStopsItsPiecesAndFailsItOnce) {
  DomainPair p;
  Buffers bufs(p);
  OpContext warm;
  ASSERT_EQ(p.write(bufs.op(8, 0, 0, std::nullopt), &warm), PostResult::kPosted);
  ASSERT_TRUE(p.poll_until([&] { return p.completions_of(&warm, Completion::Kind::kLocal) == 1; }));
  // 15 pieces go at once; the 16th, with the immediate, waits for their completions. The source is
  // deregistered before: the last piece must never be posted with its stale descriptor.
  const efa_sim::Stats before = efa_sim::stats();
  OpContext ctx;
  ASSERT_EQ(p.write(bufs.op(1 << 20, 0, 0, 0x99), &ctx), PostResult::kPosted);
  p.a->deregister_memory(bufs.src_region);
  ASSERT_TRUE(p.poll_until([&] { return p.completions_of(&ctx, Completion::Kind::kError) > 0; }));
  p.poll_for(std::chrono::milliseconds(200));
  EXPECT_EQ(p.completions_of(&ctx, Completion::Kind::kError), 1u);
  EXPECT_EQ(p.completions_of(&ctx, Completion::Kind::kLocal), 0u);
  for (auto& c : p.at_a) {
    if (c.context == &ctx) {
      EXPECT_NE(c.error.find("deregistered"), std::string::npos) << c.error;
    }
  }
  EXPECT_TRUE(p.imms().empty());
  const efa_sim::Stats after = efa_sim::stats();
  EXPECT_EQ(after.writes - before.writes, 15u);
  EXPECT_EQ(after.violations, before.violations) << efa_sim::last_violation();
}

TEST(EfaSim, ThePostsThatBreakEfasMemoryRulesAreRefusedByTheShim) {
  DomainPair p;
  Buffers bufs(p);
  OpContext warm;
  ASSERT_EQ(p.write(bufs.op(8, 0, 0, std::nullopt), &warm), PostResult::kPosted);
  ASSERT_TRUE(p.poll_until([&] { return p.completions_of(&warm, Completion::Kind::kLocal) == 1; }));

  auto refused = [&](WriteOp op, const char* why) {
    const uint64_t v = efa_sim::stats().violations;
    OpContext ctx;
    EXPECT_EQ(p.a->post_write(op, &ctx), PostResult::kFailed) << why;
    EXPECT_EQ(efa_sim::stats().violations, v + 1) << why;
    EXPECT_NE(p.a->last_error().find("fi_write"), std::string::npos) << p.a->last_error();
    return efa_sim::last_violation();
  };
  // FI_MR_LOCAL: no descriptor, on a WRITE with data and on a zero-byte one.
  WriteOp op = bufs.op(100, 0, 0, 7);
  op.desc = nullptr;
  EXPECT_NE(refused(op, "no descriptor").find("without a descriptor"), std::string::npos);
  op.len = 0;
  EXPECT_NE(refused(op, "zero bytes, no descriptor").find("without a descriptor"), std::string::npos);
  // A descriptor of another region than the buffer's.
  op = bufs.op(100, 0, 0, 7);
  op.desc = p.a->scratch_desc();
  EXPECT_NE(refused(op, "another region's descriptor").find("outside"), std::string::npos);
  // FI_MR_VIRT_ADDR: an offset where a virtual address is due.
  op = bufs.op(100, 0, 0, 7);
  op.remote_addr = 0;
  EXPECT_NE(refused(op, "offset addressing").find("virtual address"), std::string::npos);
  // Sends and receives need descriptors too.
  const uint64_t v = efa_sim::stats().violations;
  OpContext s, r;
  EXPECT_EQ(p.a->post_send(p.b_at_a, bufs.src.data(), 64, nullptr, &s), PostResult::kFailed);
  EXPECT_EQ(p.b->post_recv(bufs.dst.data(), 64, nullptr, &r), PostResult::kFailed);
  EXPECT_EQ(efa_sim::stats().violations, v + 2);

  // What the engine does for a barrier (zero bytes, the scratch buffer's descriptor) is fine, and
  // its immediate arrives.
  WriteOp barrier = bufs.op(0, 0, 0, 0x77);
  barrier.src = p.a->scratch_buffer();
  barrier.desc = p.a->scratch_desc();
  OpContext b;
  ASSERT_EQ(p.write(barrier, &b), PostResult::kPosted) << p.a->last_error();
  ASSERT_TRUE(p.poll_until([&] { return p.completions_of(&b, Completion::Kind::kLocal) == 1 && !p.imms().empty(); }));
  EXPECT_EQ(p.imms(), std::vector<uint32_t>{0x77});
}

TEST(EfaSim, EnginesSplitLongWritesAndCountOneImmediatePerWriteOnEveryNic) {
  for (size_t nics : {1, 2}) {
    SCOPED_TRACE(nics);
    const efa_sim::Stats before = efa_sim::stats();
    TransferEngine receiver(sim_config(nics)), sender(sim_config(nics));
    const efa_sim::Stats opened = efa_sim::stats();
    EXPECT_EQ(opened.shared_memory_permitted_false - before.shared_memory_permitted_false, 2 * nics);
    EXPECT_EQ(opened.cuda_api_permitted_false - before.cuda_api_permitted_false, 2 * nics);

    constexpr uint64_t kLen = (3 << 20) + 5;
    auto src = random_bytes(kLen, 31);
    std::vector<uint8_t> dst(kLen + 64, 0);
    auto [sh, sd] = sender.reg_mr(src.data(), src.size());
    auto [rh, rd] = receiver.reg_mr(dst.data(), dst.size());
    constexpr uint32_t kImm = 0xfeed'beef;
    const size_t expected = single_write_imm_count(kLen, nics, false);
    std::atomic<int> landed{kDonePending}, sent{kDonePending};
    receiver.expect_imm_count(kImm, expected, OnDone::flag(&landed));
    sender.submit(SingleWrite{.len = kLen, .src = {sh, 0}, .dst = {sender.add_remote(rd), 32}, .imm = kImm},
                  OnDone::flag(&sent));
    ASSERT_TRUE(wait_until([&] { return sent.load() != kDonePending && landed.load() != kDonePending; }));
    EXPECT_EQ(sent.load(), kDoneSucceeded);
    EXPECT_EQ(landed.load(), kDoneSucceeded);
    EXPECT_EQ(std::memcmp(dst.data() + 32, src.data(), kLen), 0);
    EXPECT_EQ(dst[31], 0);
    EXPECT_EQ(dst[32 + kLen], 0);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    EXPECT_EQ(receiver.imm_count(kImm), 0u) << "no immediate beyond one per WRITE";
    uint64_t imms = 0, posted = 0;
    for (auto& s : receiver.nic_stats()) imms += s.imms_received;
    for (auto& s : sender.nic_stats()) posted += s.writes_posted;
    EXPECT_EQ(imms, expected);
    EXPECT_EQ(posted, expected) << "the engine saw one operation per shard";
    const efa_sim::Stats after = efa_sim::stats();
    EXPECT_GE(after.writes - opened.writes, (kLen + efa_sim::kMaxMsgSize - 1) / efa_sim::kMaxMsgSize);
    EXPECT_EQ(after.writes_with_data - opened.writes_with_data, expected);
    EXPECT_EQ(after.violations, before.violations) << efa_sim::last_violation();
    sender.dereg_mr(sh);
    receiver.dereg_mr(rh);
  }
}

}  // namespace
}  // namespace fabric::testing
