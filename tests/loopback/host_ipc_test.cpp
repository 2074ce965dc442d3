// EngineConfig::host_ipc: same-host peers in host memory written by the initiator with
// process_vm_writev (another process) or memcpy (an engine of the same process), with every byte
// and immediate checked, the local domain's counters showing that it carried the bytes, and the
// refusals (a bad range, a deregistered region, both local domains) losing nothing. A peer that
// is killed fails its transfers in bounded time and leaves the engine able to write to the next.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "fabric/fabric.h"
#include "process_pair.h"
#include "test_support.h"

namespace fabric::testing {
namespace {

using tools::Channel;
using Clock = std::chrono::steady_clock;

constexpr uint32_t kImm = 0x4C0C0001;
constexpr uint64_t kPage = 64 << 10;
constexpr uint32_t kPages = 300;  // more than one iovec batch of merged pages would be at 4 KiB

EngineConfig host_ipc_config(const std::string& provider) {
  EngineConfig c = config_for(ProviderCase{provider, 1, false});
  c.host_ipc = true;
  c.transfer_timeout = std::chrono::milliseconds(5000);
  return c;
}

uint8_t byte_at(uint64_t i, uint32_t salt) {
  return static_cast<uint8_t>((i * 131 + salt * 7 + (i >> 12)) & 0xFF);
}

int wait_flag(std::atomic<int>& f) {
  const auto deadline = Clock::now() + std::chrono::seconds(30);
  while (f.load(std::memory_order_acquire) == kDonePending && Clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  return f.load(std::memory_order_acquire);
}

// The local domain's entry of nic_stats() (the last one), and the NICs' writes together.
struct Carried {
  uint64_t local_writes = 0, nic_writes = 0;
};
Carried carried(TransferEngine& e) {
  std::vector<NicStats> s = e.nic_stats();
  Carried c;
  c.local_writes = s.back().writes_posted;
  for (size_t i = 0; i + 1 < s.size(); i++) c.nic_writes += s[i].writes_posted;
  return c;
}

// The receiving side: a region of 2 * kPages pages, its address and descriptor sent to the
// writer; then counts the immediates the writer says to expect, checks the bytes it says to
// check, and answers "ok" or what was wrong.
int receiver(Channel& ch, const std::string& provider) {
  TransferEngine engine(host_ipc_config(provider));
  std::vector<uint8_t> dst(2 * kPages * kPage, 0);
  auto [mr, desc] = engine.reg_mr(dst.data(), dst.size());
  ch.send(engine.main_address().to_bytes());
  ch.send(desc.to_bytes());
  (void)ch.recv();  // the writer's address: nothing goes back to it but answers on the channel
  for (;;) {
    const std::string cmd = ch.recv();
    if (cmd == "bye") break;
    // "expect <count> <salt> <first page> <pages>": the immediates, then pages [first, +pages)
    // hold byte_at(offset in the range, salt).
    unsigned count = 0, salt = 0, first = 0, pages = 0;
    if (std::sscanf(cmd.c_str(), "expect %u %u %u %u", &count, &salt, &first, &pages) != 4)
      return 2;
    std::atomic<int> arrived{kDonePending};
    engine.expect_imm_count(kImm, count, OnDone::flag(&arrived));
    std::string verdict = "ok";
    if (wait_flag(arrived) != kDoneSucceeded)
      verdict = fmt::format("{} immediates did not arrive", count);
    for (uint64_t b = 0; b < uint64_t{pages} * kPage && verdict == "ok"; b++)
      if (dst[first * kPage + b] != byte_at(b, salt))
        verdict = fmt::format("byte {} of page {} differs", b % kPage, first + b / kPage);
    ch.send(verdict);
  }
  engine.dereg_mr(mr);
  return 0;
}

class HostIpc : public ::testing::TestWithParam<std::string> {};

TEST_P(HostIpc, AnotherProcessReceivesSinglePagedAndScatteredWritesThroughTheLocalDomain) {
  const std::string provider = GetParam();
  auto r = tools::run_process_pair(
      [&](Channel& ch) {
        TransferEngine engine(host_ipc_config(provider));
        NetAddr peer = NetAddr::from_bytes(ch.recv_bytes());
        MrDesc desc = MrDesc::from_bytes(ch.recv_bytes());
        ch.send(engine.main_address().to_bytes());
        std::vector<uint8_t> src(kPages * kPage);
        auto [mr, mine] = engine.reg_mr(src.data(), src.size());
        const RemoteMr dst = engine.add_remote(desc);
        auto ask = [&](unsigned count, unsigned salt, unsigned first, unsigned pages) {
          ch.send(fmt::format("expect {} {} {} {}", count, salt, first, pages));
          return ch.recv();
        };
        // One 16 MiB WRITE into pages [0, 256).
        for (uint64_t b = 0; b < 256 * kPage; b++) src[b] = byte_at(b, 1);
        std::atomic<int> done{kDonePending};
        engine.submit(SingleWrite{.len = 256 * kPage, .src = {mr, 0}, .dst = {dst, 0}, .imm = kImm},
                      OnDone::flag(&done));
        EXPECT_EQ(wait_flag(done), kDoneSucceeded);
        EXPECT_EQ(ask(1, 1, 0, 256), "ok");
        // kPages pages into [kPages, 2 kPages), in reverse order (no two neighbours merge).
        for (uint64_t b = 0; b < src.size(); b++) src[b] = byte_at(b, 2);
        std::vector<uint32_t> src_idx(kPages), dst_idx(kPages);
        for (uint32_t i = 0; i < kPages; i++)
          src_idx[i] = kPages - 1 - i, dst_idx[i] = 2 * kPages - 1 - i;
        auto paged = [&] {  // src_idx[i] -> dst_idx[i], one immediate per page; its outcome
          std::atomic<int> f{kDonePending};
          engine.submit(PagedWrites{.page_len = kPage,
                                    .src = mr,
                                    .src_pages = {src_idx, kPage, 0},
                                    .dst = dst,
                                    .dst_pages = {dst_idx, kPage, 0},
                                    .imm = kImm},
                        OnDone::flag(&f));
          return wait_flag(f);
        };
        EXPECT_EQ(paged(), kDoneSucceeded);
        EXPECT_EQ(ask(kPages, 2, kPages, kPages), "ok");
        // In order (neighbours merge into one iovec), over the first half.
        for (uint32_t i = 0; i < kPages; i++) src_idx[i] = dst_idx[i] = i;
        for (uint64_t b = 0; b < src.size(); b++) src[b] = byte_at(b, 3);
        EXPECT_EQ(paged(), kDoneSucceeded);
        EXPECT_EQ(ask(kPages, 3, 0, kPages), "ok");
        // A scatter of 3 slices of odd lengths into pages 10, 11, 12 (byte_at over the 3 pages).
        for (uint64_t b = 0; b < 3 * kPage; b++) src[b] = byte_at(b, 4);
        std::vector<ScatterSlice> slices = {
            {.len = 1000, .src_offset = 0, .dst = {dst, 10 * kPage}},
            {.len = 3 * kPage - 5000, .src_offset = 1000, .dst = {dst, 10 * kPage + 1000}},
            {.len = 4000, .src_offset = 3 * kPage - 4000, .dst = {dst, 13 * kPage - 4000}}};
        std::atomic<int> scattered{kDonePending};
        engine.submit(Scatter{.src = mr, .slices = slices, .imm = kImm}, OnDone::flag(&scattered));
        EXPECT_EQ(wait_flag(scattered), kDoneSucceeded);
        EXPECT_EQ(ask(3, 4, 10, 3), "ok");
        const Carried c = carried(engine);
        EXPECT_EQ(engine.nic_stats().back().nic, "host_ipc");
        EXPECT_GE(c.local_writes, 1u + 2 * kPages + 3) << "the local domain carried every WRITE";
        EXPECT_EQ(c.nic_writes, 0u) << "nothing went over the NICs";
        ch.send("bye");
        engine.dereg_mr(mr);
        return ::testing::Test::HasFailure() ? 1 : 0;
      },
      [&](Channel& ch) { return receiver(ch, provider); });
  EXPECT_TRUE(r.ok()) << "parent rc " << r.parent_rc << ", child status " << r.child_status;
}

INSTANTIATE_TEST_SUITE_P(Providers, HostIpc, ::testing::Values("tcp;ofi_rxm", "shm"),
                         [](const auto& info) {
                           return info.param == "shm" ? std::string("shm") : std::string("tcp");
                         });

// Two engines of one process reach each other through host_ipc too (plain copies).
TEST(HostIpcOneProcess, TwoEnginesOfOneProcessCopyDirectly) {
  TransferEngine a(host_ipc_config("tcp;ofi_rxm")), b(host_ipc_config("tcp;ofi_rxm"));
  std::vector<uint8_t> src(8 * kPage), dst(8 * kPage, 0);
  for (uint64_t i = 0; i < src.size(); i++) src[i] = byte_at(i, 9);
  auto [smr, sdesc] = a.reg_mr(src.data(), src.size());
  auto [dmr, ddesc] = b.reg_mr(dst.data(), dst.size());
  const RemoteMr remote = a.add_remote(ddesc);
  std::atomic<int> arrived{kDonePending}, done{kDonePending};
  b.expect_imm_count(kImm, 1, OnDone::flag(&arrived));
  a.submit(SingleWrite{.len = src.size(), .src = {smr, 0}, .dst = {remote, 0}, .imm = kImm},
           OnDone::flag(&done));
  EXPECT_EQ(wait_flag(done), kDoneSucceeded);
  EXPECT_EQ(wait_flag(arrived), kDoneSucceeded);
  EXPECT_EQ(dst, src);
  EXPECT_EQ(carried(a).nic_writes, 0u);
  a.dereg_mr(smr);
  b.dereg_mr(dmr);
}

TEST(HostIpcErrors, BadRangesAndDeregisteredRegionsFailClearlyAndTheEngineGoesOn) {
  TransferEngine a(host_ipc_config("tcp;ofi_rxm")), b(host_ipc_config("tcp;ofi_rxm"));
  std::vector<uint8_t> src(2 * kPage, 7), dst(kPage, 0), other(kPage, 0);
  auto [smr, sdesc] = a.reg_mr(src.data(), src.size());
  auto [dmr, ddesc] = b.reg_mr(dst.data(), dst.size());
  const RemoteMr remote = a.add_remote(ddesc);
  // Past the end of the destination: refused by name (the engine's own bounds check, or ours).
  std::atomic<int> past{kDonePending};
  try {
    a.submit(SingleWrite{.len = 2 * kPage, .src = {smr, 0}, .dst = {remote, 0}},
             OnDone::flag(&past));
    EXPECT_EQ(wait_flag(past), kDoneFailed);
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("outside"), std::string::npos) << e.what();
  }
  EXPECT_EQ(dst, std::vector<uint8_t>(kPage, 0)) << "a refused WRITE writes nothing";
  // A deregistered destination: the WRITE fails, nothing lands in the memory now reused.
  b.dereg_mr(dmr);
  std::atomic<int> stale{kDonePending};
  a.submit(SingleWrite{.len = 64, .src = {smr, 0}, .dst = {remote, 0}}, OnDone::flag(&stale));
  EXPECT_EQ(wait_flag(stale), kDoneFailed);
  EXPECT_EQ(dst, std::vector<uint8_t>(kPage, 0));
  // The engine goes on: a fresh region takes the next WRITE.
  auto [omr, odesc] = b.reg_mr(other.data(), other.size());
  std::atomic<int> fine{kDonePending};
  a.submit(SingleWrite{.len = 64, .src = {smr, 0}, .dst = {a.add_remote(odesc), 0}},
           OnDone::flag(&fine));
  EXPECT_EQ(wait_flag(fine), kDoneSucceeded);
  EXPECT_EQ(other[63], 7);
  a.dereg_mr(smr);
  b.dereg_mr(omr);
}

TEST(HostIpcErrors, CudaIpcAndHostIpcTogetherAreRefusedByName) {
  EngineConfig c = host_ipc_config("tcp;ofi_rxm");
  c.cuda_ipc = true;
  c.cuda_device = 0;
  try {
    TransferEngine e(c);
    FAIL() << "an engine with both local domains was built";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("cuda_ipc and host_ipc"), std::string::npos) << e.what();
  }
}

// A peer without host_ipc is reached through the NICs, byte for byte.
TEST(HostIpcMixed, APeerWithoutHostIpcGoesOverTheNics) {
  EngineConfig plain = host_ipc_config("tcp;ofi_rxm");
  plain.host_ipc = false;
  TransferEngine a(host_ipc_config("tcp;ofi_rxm")), b(plain);
  std::vector<uint8_t> src(kPage), dst(kPage, 0);
  for (uint64_t i = 0; i < src.size(); i++) src[i] = byte_at(i, 5);
  auto [smr, sdesc] = a.reg_mr(src.data(), src.size());
  auto [dmr, ddesc] = b.reg_mr(dst.data(), dst.size());
  std::atomic<int> done{kDonePending}, arrived{kDonePending};
  b.expect_imm_count(kImm, 1, OnDone::flag(&arrived));
  a.submit(SingleWrite{.len = kPage, .src = {smr, 0}, .dst = {a.add_remote(ddesc), 0}, .imm = kImm},
           OnDone::flag(&done));
  EXPECT_EQ(wait_flag(done), kDoneSucceeded);
  EXPECT_EQ(wait_flag(arrived), kDoneSucceeded);
  EXPECT_EQ(dst, src);
  EXPECT_EQ(carried(a).local_writes, 0u);
  EXPECT_GE(carried(a).nic_writes, 1u);
  a.dereg_mr(smr);
  b.dereg_mr(dmr);
}

// A receiver killed between two transfers: the next WRITE to it fails within the transfer
// timeout, and the same engine then writes to a live receiver.
TEST(HostIpcDeadPeer, AKilledPeerFailsInBoundedTimeAndTheNextPeerWorks) {
  tools::ChildProcess doomed =
      tools::spawn_child([](Channel& ch) { return receiver(ch, "tcp;ofi_rxm"); });
  tools::ChildProcess live =
      tools::spawn_child([](Channel& ch) { return receiver(ch, "tcp;ofi_rxm"); });
  TransferEngine engine(host_ipc_config("tcp;ofi_rxm"));
  std::vector<uint8_t> src(kPages * kPage);
  for (uint64_t b = 0; b < src.size(); b++) src[b] = byte_at(b, 6);
  auto [mr, mine] = engine.reg_mr(src.data(), src.size());
  std::vector<RemoteMr> dsts;
  for (tools::ChildProcess* c : {&doomed, &live}) {
    (void)NetAddr::from_bytes(c->ch.recv_bytes());
    dsts.push_back(engine.add_remote(MrDesc::from_bytes(c->ch.recv_bytes())));
    c->ch.send(engine.main_address().to_bytes());
  }
  std::atomic<int> first{kDonePending};
  engine.submit(SingleWrite{.len = kPage, .src = {mr, 0}, .dst = {dsts[0], 0}, .imm = kImm},
                OnDone::flag(&first));
  EXPECT_EQ(wait_flag(first), kDoneSucceeded);
  kill(doomed.pid, SIGKILL);
  tools::reap(doomed.pid);
  const auto t0 = Clock::now();
  std::atomic<int> after{kDonePending};
  engine.submit(SingleWrite{.len = kPage, .src = {mr, 0}, .dst = {dsts[0], 0}, .imm = kImm},
                OnDone::flag(&after));
  EXPECT_EQ(wait_flag(after), kDoneFailed);
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(6)) << "within the 5 s transfer timeout";
  std::vector<uint32_t> idx(kPages);
  for (uint32_t i = 0; i < kPages; i++) idx[i] = i;
  std::atomic<int> paged{kDonePending};
  engine.submit(PagedWrites{.page_len = kPage,
                            .src = mr,
                            .src_pages = {idx, kPage, 0},
                            .dst = dsts[1],
                            .dst_pages = {idx, kPage, 0},
                            .imm = kImm},
                OnDone::flag(&paged));
  EXPECT_EQ(wait_flag(paged), kDoneSucceeded);
  live.ch.send(fmt::format("expect {} 6 0 {}", kPages, kPages));
  EXPECT_EQ(live.ch.recv(), "ok");
  live.ch.send("bye");
  engine.dereg_mr(mr);
  close(live.ch.fd());
  const int status = tools::reap(live.pid);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  close(doomed.ch.fd());
}

}  // namespace
}  // namespace fabric::testing
