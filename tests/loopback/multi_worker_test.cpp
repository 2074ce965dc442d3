// A multi-worker engine on CPU: two "GPU groups" of loopback tcp NICs, each a worker with its own
// thread and NICs, standing in for two GPUs with their rails (host memory placed on a worker with
// Device::host_for_worker). Every call is routed to its worker and checked by its data and by the
// worker that counts its immediates.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <mutex>

#include "fabric/fabric.h"
#include "test_support.h"

namespace fabric::testing {
namespace {

// Worker w's NIC k binds 127.0.0.(2 + 2w + k).
EngineConfig two_workers() {
  EngineConfig cfg = config_for({"tcp;ofi_rxm", 2, false});
  cfg.workers.resize(2);
  for (size_t w = 0; w < 2; w++) {
    cfg.workers[w].nics.clear();
    for (size_t k = 0; k < 2; k++)
      cfg.workers[w].nics.push_back(NicConfig{"", "127.0.0." + std::to_string(2 + 2 * w + k)});
  }
  return cfg;
}

ExpectOptions on_worker(int w) {
  return ExpectOptions{.timeout = std::chrono::seconds(60), .device = Device::host_for_worker(w)};
}

struct Flags {
  std::vector<std::unique_ptr<std::atomic<int>>> all;
  OnDone next() {
    all.push_back(std::make_unique<std::atomic<int>>(kDonePending));
    return OnDone::flag(all.back().get());
  }
  bool wait() {
    return wait_until([&] {
      for (auto& f : all)
        if (f->load() == kDonePending) return false;
      return true;
    });
  }
  size_t succeeded() const {
    size_t n = 0;
    for (auto& f : all) n += f->load() == kDoneSucceeded;
    return n;
  }
};

TEST(MultiWorker, EveryRequestGoesOutItsSourcesWorkerAndLandsOnItsDestinationsWorker) {
  TransferEngine a(two_workers()), b(two_workers());
  ASSERT_EQ(a.worker_count(), 2u);
  ASSERT_EQ(a.nic_count(), 2u);
  const NetAddr addr = b.main_address();
  ASSERT_EQ(addr.worker_count(), 2u);
  EXPECT_EQ(NetAddr::from_hex(addr.to_hex()), addr);
  EXPECT_NE(addr.nic(0, 0), addr.nic(1, 0)) << "each worker has its own endpoints";

  constexpr size_t kMiB = 1 << 20;
  std::vector<uint8_t> src0 = random_bytes(kMiB, 1), src1 = random_bytes(kMiB, 2);
  std::vector<uint8_t> dst0(2 * kMiB, 0), dst1(2 * kMiB, 0);
  auto [hs0, ds0] = a.reg_mr(src0.data(), src0.size(), Device::host_for_worker(0));
  auto [hs1, ds1] = a.reg_mr(src1.data(), src1.size(), Device::host_for_worker(1));
  auto [hd0, dd0] = b.reg_mr(dst0.data(), dst0.size());  // host memory: the first worker
  auto [hd1, dd1] = b.reg_mr(dst1.data(), dst1.size(), Device::host_for_worker(1));
  EXPECT_EQ(ds1.worker(), 1u);
  EXPECT_EQ(dd0.worker(), 0u);
  EXPECT_EQ(dd1.worker(), 1u);
  EXPECT_EQ(MrDesc::from_hex(dd1.to_hex()), dd1);
  const RemoteMr r0 = a.add_remote(dd0), r1 = a.add_remote(dd1);

  // What lands where (offsets into dst0 / dst1):
  //   single 1 MiB from src1 (worker 1) to dst0 [0, 1 MiB)                  imm 1, worker 0
  //   64 pages of 4 KiB from src0 (worker 0) to dst1 pages 0, 2, 4, ...      imm 2, worker 1
  //   scatter from src1: 4 KiB to dst0 @1 MiB and to dst1 @1 MiB             imm 3, both
  //   group scatter from src0: 8 KiB to dst0 and dst1 @1.5 MiB               imm 5, both
  //   barrier from worker 1 and group barrier from worker 0 to both          imm 4, 6, both
  Flags landed, sent;
  const size_t single_imms = single_write_imm_count(kMiB, 2, false);
  b.expect_imm_count(1, single_imms, landed.next(), on_worker(0));
  b.expect_imm_count(2, 64, landed.next(), on_worker(1));
  for (int w : {0, 1})
    for (uint32_t imm : {3u, 4u, 5u, 6u}) b.expect_imm_count(imm, 1, landed.next(), on_worker(w));

  a.submit(SingleWrite{.len = kMiB, .src = {hs1, 0}, .dst = {r0, 0}, .imm = 1}, sent.next());
  std::vector<uint32_t> src_pages(64), dst_pages(64);
  for (uint32_t i = 0; i < 64; i++) {
    src_pages[i] = 63 - i;
    dst_pages[i] = 2 * i;
  }
  a.submit(PagedWrites{.page_len = 4096,
                       .src = hs0,
                       .src_pages = {.indices = src_pages, .stride = 4096},
                       .dst = r1,
                       .dst_pages = {.indices = dst_pages, .stride = 4096},
                       .imm = 2},
           sent.next());
  const std::vector<ScatterSlice> slices{{4096, 8192, {r0, kMiB}}, {4096, 16384, {r1, kMiB}}};
  a.submit(Scatter{.src = hs1, .slices = slices, .imm = 3}, sent.next());
  const std::vector<RemoteMr> both{r0, r1};
  PeerGroupHandle group = a.add_peer_group(both);
  const std::vector<GroupSlice> gslices{{8192, 0, kMiB + kMiB / 2}, {8192, 8192, kMiB + kMiB / 2}};
  a.submit(GroupScatter{.group = group, .src = hs0, .slices = gslices, .imm = 5}, sent.next());
  a.submit(Barrier{.dsts = both, .imm = 4, .device = Device::host_for_worker(1)}, sent.next());
  a.submit(GroupBarrier{.group = group, .imm = 6}, sent.next());

  ASSERT_TRUE(sent.wait());
  EXPECT_EQ(sent.succeeded(), sent.all.size());
  ASSERT_TRUE(landed.wait());
  EXPECT_EQ(landed.succeeded(), landed.all.size()) << "an immediate was counted by the wrong worker";

  EXPECT_EQ(0, std::memcmp(dst0.data(), src1.data(), kMiB));
  for (uint32_t i = 0; i < 64; i++)
    EXPECT_EQ(0, std::memcmp(dst1.data() + dst_pages[i] * 4096, src0.data() + src_pages[i] * 4096, 4096)) << i;
  EXPECT_EQ(0, std::memcmp(dst0.data() + kMiB, src1.data() + 8192, 4096));
  EXPECT_EQ(0, std::memcmp(dst1.data() + kMiB, src1.data() + 16384, 4096));
  EXPECT_EQ(0, std::memcmp(dst0.data() + kMiB + kMiB / 2, src0.data(), 8192));
  EXPECT_EQ(0, std::memcmp(dst1.data() + kMiB + kMiB / 2, src0.data() + 8192, 8192));

  // Per worker in order, each worker's NICs: both posted, each from its own sources.
  std::vector<NicStats> stats = a.nic_stats();
  ASSERT_EQ(stats.size(), 4u);
  for (size_t i = 0; i < 4; i++) {
    EXPECT_EQ(stats[i].worker, i / 2) << i;
    EXPECT_FALSE(stats[i].nic.empty()) << "labelled by the NIC's name";
  }
  EXPECT_GT(stats[0].writes_posted + stats[1].writes_posted, 64u) << "paged and group writes: worker 0";
  EXPECT_GE(stats[2].writes_posted + stats[3].writes_posted, single_imms + 2 + 2) << "single, scatter, barrier: worker 1";
  std::vector<NicStats> landed_stats = b.nic_stats();
  EXPECT_GT(landed_stats[2].imms_received + landed_stats[3].imms_received, 64u);

  // Messages go between first workers.
  std::mutex mu;
  std::vector<std::byte> got;
  b.submit_recvs(256, 4, [&](std::span<const std::byte> m) {
    std::lock_guard l(mu);
    got.assign(m.begin(), m.end());
  });
  const std::string hello = "from a multi-worker engine";
  Flags msg;
  a.submit_send(addr, std::as_bytes(std::span(hello)), msg.next());
  ASSERT_TRUE(msg.wait());
  ASSERT_TRUE(wait_until([&] {
    std::lock_guard l(mu);
    return got.size() == hello.size();
  }));
  EXPECT_EQ(0, std::memcmp(got.data(), hello.data(), hello.size()));

  // An expectation lives on its worker: cancelled there.
  ImmExpectation e = b.expect_imm_count(99, 1, OnDone::callback([](const Status&) {}), on_worker(1));
  EXPECT_EQ(e.worker, 1u);
  EXPECT_TRUE(b.cancel_imm_expectation(e));

  // The peer leaves: every worker of ours lets go of every worker of it, and its regions with it.
  EXPECT_GE(a.peer_count(), 2u);
  a.remove_peer(addr);
  EXPECT_EQ(a.peer_count(), 0u);
  expect_error(ErrorCode::kNotFound, "RemoteMr",
               [&] { a.submit(SingleWrite{.len = 1, .src = {hs0, 0}, .dst = {r1, 0}}, OnDone::callback([](const Status&) {})); });
}

TEST(MultiWorker, AOneWorkerPeerWritesIntoEitherWorkerOfAMultiWorkerEngine) {
  TransferEngine wide(two_workers()), one(config_for({"tcp;ofi_rxm", 2, false}));
  std::vector<uint8_t> src = random_bytes(256 << 10, 3);
  auto [hs, ds] = one.reg_mr(src.data(), src.size());
  auto imms_on = [&](int w) {  // immediates the wide engine's NICs of worker w have received
    uint64_t n = 0;
    for (const NicStats& st : wide.nic_stats())
      if (st.worker == static_cast<uint32_t>(w)) n += st.imms_received;
    return n;
  };
  for (int w : {0, 1}) {
    SCOPED_TRACE(fmt::format("into worker {}", w));
    const uint64_t before = imms_on(w), other_before = imms_on(1 - w);
    std::vector<uint8_t> dst(256 << 10, 0);
    auto [hd, dd] = wide.reg_mr(dst.data(), dst.size(), Device::host_for_worker(w));
    Flags landed, sent;
    const uint32_t imm = 7 + static_cast<uint32_t>(w);
    wide.expect_imm_count(imm, single_write_imm_count(src.size(), 2, false), landed.next(), on_worker(w));
    one.submit(SingleWrite{.len = src.size(), .src = {hs, 0}, .dst = {one.add_remote(dd), 0}, .imm = imm}, sent.next());
    ASSERT_TRUE(sent.wait() && landed.wait());
    EXPECT_EQ(landed.succeeded(), 1u);
    EXPECT_EQ(dst, src);
    EXPECT_EQ(imms_on(w) - before, 2u) << "one immediate per NIC of the worker written to";
    EXPECT_EQ(imms_on(1 - w), other_before) << "the other worker received nothing";
    wide.dereg_mr(hd);
  }
}

TEST(MultiWorker, BadWorkerChoicesAreRejectedWithAClearError) {
  EngineConfig uneven = two_workers();
  uneven.workers[1].nics.pop_back();
  expect_error(ErrorCode::kInvalidArgument, "same number", [&] { TransferEngine e(uneven); });
  EngineConfig same_gpu = two_workers();
  same_gpu.workers[0].cuda_device = same_gpu.workers[1].cuda_device = 0;
  expect_error(ErrorCode::kInvalidArgument, "both serve GPU 0", [&] { TransferEngine e(same_gpu); });
  EngineConfig too_many = two_workers();
  too_many.workers.resize(kMaxWorkers + 1, too_many.workers[0]);
  expect_error(ErrorCode::kInvalidArgument, "1 to 8", [&] { TransferEngine e(too_many); });

  TransferEngine a(two_workers());
  std::vector<uint8_t> buf(4096);
  expect_error(ErrorCode::kInvalidArgument, "worker 2", [&] { a.reg_mr(buf.data(), buf.size(), Device::host_for_worker(2)); });
  expect_error(ErrorCode::kInvalidArgument, "no worker of this engine serves GPU 5",
               [&] { a.reg_mr(buf.data(), buf.size(), Device::cuda(5)); });
  expect_error(ErrorCode::kInvalidArgument, "worker 3", [&] {
    a.expect_imm_count(1, 1, OnDone::callback([](const Status&) {}), {.timeout = {}, .device = Device::host_for_worker(3)});
  });
  EXPECT_NO_THROW(a.reg_mr(buf.data(), buf.size(), Device::host_for_worker(1)));
}

}  // namespace
}  // namespace fabric::testing
