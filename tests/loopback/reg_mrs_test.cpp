// TransferEngine::reg_mrs through the public API: many regions registered in one call are each
// usable for WRITEs; a bad entry, or a failure part-way (slots run out), leaves nothing registered.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <regex>

#include "fabric/transfer_engine.h"
#include "loopback/test_support.h"

namespace fabric::testing {
namespace {

const ProviderCase kTcp{"tcp;ofi_rxm", 1, false};
const ProviderCase kShm{"shm", 1, false};

// A counter of metrics_text() (0 when absent).
double metric(TransferEngine& e, const std::string& name) {
  std::smatch m;
  const std::string text = e.metrics_text();
  if (!std::regex_search(text, m, std::regex("\n" + name + " ([0-9.e+]+)\n"))) return 0;
  return std::stod(m[1]);
}

// WRITE `bytes` from `src` into `dst` (registered by `rx`) and check they landed, byte for byte.
void write_and_check(TransferEngine& tx, const MrHandle& src, TransferEngine& rx, const MrDesc& dst,
                     const std::vector<uint8_t>& bytes, const std::vector<uint8_t>& landed_in,
                     uint32_t imm) {
  std::atomic<int> sent{kDonePending}, landed{kDonePending};
  rx.expect_imm_count(imm, single_write_imm_count(bytes.size(), 1, false), OnDone::flag(&landed));
  tx.submit(SingleWrite{.len = bytes.size(), .src = {src, 0}, .dst = {tx.add_remote(dst), 0}, .imm = imm},
            OnDone::flag(&sent));
  ASSERT_TRUE(wait_until([&] { return sent.load() != kDonePending && landed.load() != kDonePending; }));
  EXPECT_EQ(sent.load(), kDoneSucceeded);
  EXPECT_EQ(landed.load(), kDoneSucceeded);
  EXPECT_EQ(landed_in, bytes);
}

class RegMrs : public ::testing::TestWithParam<ProviderCase> {};

TEST_P(RegMrs, RegistersEveryRegionUsableForWrites) {
  TransferEngine tx(config_for(GetParam())), rx(config_for(GetParam()));
  constexpr size_t kRegions = 6;
  std::vector<std::vector<uint8_t>> srcs, dsts;
  std::vector<MrRequest> src_req, dst_req;
  for (size_t i = 0; i < kRegions; i++) {
    const size_t len = (size_t{4096} << i) + 8 * i;  // distinct sizes, not all whole pages
    srcs.push_back(random_bytes(len, static_cast<uint32_t>(i)));
    dsts.emplace_back(len, 0);
  }
  for (size_t i = 0; i < kRegions; i++) {
    src_req.push_back({.ptr = srcs[i].data(), .len = srcs[i].size()});
    dst_req.push_back({.ptr = dsts[i].data(), .len = dsts[i].size(), .prefault = i % 2 == 0});
  }
  auto s = tx.reg_mrs(src_req);
  auto d = rx.reg_mrs(dst_req);
  ASSERT_EQ(s.size(), kRegions);
  ASSERT_EQ(d.size(), kRegions);
  EXPECT_EQ(metric(rx, "fabric_registrations_total"), kRegions);
  size_t bytes = 0;
  for (auto& dst : dsts) bytes += dst.size();
  EXPECT_EQ(metric(rx, "fabric_registered_bytes_total"), bytes);
  EXPECT_EQ(metric(rx, "fabric_registration_seconds_count"), 1);  // one call
  EXPECT_EQ(metric(rx, "fabric_registration_failures_total"), 0);
  for (size_t i = 0; i < kRegions; i++) {
    // In the order given: each descriptor names its own memory.
    EXPECT_EQ(d[i].second.addr(), reinterpret_cast<uint64_t>(dsts[i].data()));
    EXPECT_EQ(d[i].second.len(), dsts[i].size());
    write_and_check(tx, s[i].first, rx, d[i].second, srcs[i], dsts[i], static_cast<uint32_t>(0x100 + i));
  }
  for (auto& [h, desc] : s) tx.dereg_mr(h);
  for (auto& [h, desc] : d) rx.dereg_mr(h);
  EXPECT_TRUE(tx.reg_mrs({}).empty());
}

INSTANTIATE_TEST_SUITE_P(Providers, RegMrs, ::testing::Values(kTcp, kShm), case_name);

// Registering exactly max_regions regions works only if every slot is free: proof that a failed
// call left nothing registered.
void expect_all_slots_free(TransferEngine& e, std::vector<std::vector<uint8_t>>& bufs) {
  std::vector<MrRequest> all;
  for (auto& b : bufs) all.push_back({.ptr = b.data(), .len = b.size()});
  auto regs = e.reg_mrs(all);
  EXPECT_EQ(regs.size(), bufs.size());
  for (auto& [h, d] : regs) e.dereg_mr(h);
}

TEST(RegMrsRefusal, ABadEntryRefusesTheWholeCall) {
  EngineConfig cfg = config_for(kTcp);
  cfg.max_regions = 4;
  TransferEngine e(cfg);
  std::vector<std::vector<uint8_t>> bufs(4, std::vector<uint8_t>(8192, 1));
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  // Unmapped memory the kernel never hands out by itself (below vm.mmap_min_addr): a page freed
  // with munmap can be mapped again by another thread before the call (it was, under ASan).
  void* hole = reinterpret_cast<void*>(uintptr_t{page});

  std::vector<MrRequest> req = {{.ptr = bufs[0].data(), .len = 8192}, {.ptr = bufs[1].data(), .len = 8192},
                                {.ptr = nullptr, .len = 8192}};
  expect_error(ErrorCode::kInvalidArgument, "reg_mrs: region 2 of 3: pointer must be non-null",
               [&] { e.reg_mrs(req); });
  req[2] = {.ptr = bufs[2].data(), .len = 0};
  expect_error(ErrorCode::kInvalidArgument, "region 2 of 3: pointer must be non-null and length > 0; nothing was registered",
               [&] { e.reg_mrs(req); });
  req[2] = {.ptr = hole, .len = 2 * page};
  expect_error(ErrorCode::kInvalidArgument, "region 2 of 3: [", [&] { e.reg_mrs(req); });
  req[2] = {.ptr = bufs[2].data(), .len = 8192, .device = Device::host_for_worker(3)};
  expect_error(ErrorCode::kInvalidArgument, "region 2 of 3", [&] { e.reg_mrs(req); });
  ImmReservation none;
  req[2] = {.ptr = bufs[2].data(), .len = 8192, .imms = &none};
  expect_error(ErrorCode::kInvalidArgument, "region 2 of 3: the immediate reservation is not held",
               [&] { e.reg_mrs(req); });
  // Mapped but not writable: its prefault fails, after the checks, before any registration.
  void* readonly = mmap(nullptr, page, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(readonly, MAP_FAILED);
  req[2] = {.ptr = readonly, .len = page, .prefault = true};
  expect_error(ErrorCode::kInvalidArgument, "region 2 of 3: prefault of", [&] { e.reg_mrs(req); });
  munmap(readonly, page);
  EXPECT_EQ(metric(e, "fabric_registrations_total"), 0);
  EXPECT_EQ(metric(e, "fabric_registration_failures_total"), 5);  // the unheld reservation is refused before the engine
  expect_all_slots_free(e, bufs);
}

// A failure after some regions were registered (the slots run out at the fifth) undoes them.
TEST(RegMrsRefusal, AFailurePartWayDeregistersWhatWasDone) {
  EngineConfig cfg = config_for(kTcp);
  cfg.max_regions = 4;
  TransferEngine e(cfg);
  std::vector<std::vector<uint8_t>> bufs(5, std::vector<uint8_t>(8192, 1));
  std::vector<MrRequest> req;
  for (auto& b : bufs) req.push_back({.ptr = b.data(), .len = b.size()});
  expect_error(ErrorCode::kResourceExhausted, "reg_mrs: region 4 of 5: all 4 region slots are in use",
               [&] { e.reg_mrs(req); });
  bufs.pop_back();
  expect_all_slots_free(e, bufs);
}

// Across workers: worker 0's regions were registered and published when worker 1 ran out of
// slots; they are undone too.
TEST(RegMrsRefusal, AFailureOnASecondWorkerUndoesTheFirst) {
  EngineConfig cfg = config_for({"tcp;ofi_rxm", 1, false});
  cfg.max_regions = 3;
  cfg.workers.resize(2);
  for (size_t w = 0; w < 2; w++) cfg.workers[w].nics = {NicConfig{"", "127.0.0." + std::to_string(2 + w)}};
  TransferEngine e(cfg);
  std::vector<std::vector<uint8_t>> bufs(4, std::vector<uint8_t>(8192, 1));
  std::vector<MrRequest> req;
  for (size_t i = 0; i < 4; i++)
    req.push_back({.ptr = bufs[i].data(), .len = 8192, .device = Device::host_for_worker(i < 2 ? 0 : 1)});
  expect_error(ErrorCode::kResourceExhausted, "region 3 of 4", [&] { e.reg_mrs(req); });
  bufs.pop_back();
  expect_all_slots_free(e, bufs);
  // And a WRITE through a region registered afterwards on the slot one of them held works.
  auto [h, d] = e.reg_mr(bufs[0].data(), bufs[0].size());
  expect_write_to_self_works(e, h, bufs[0], 1);
  e.dereg_mr(h);
}

}  // namespace
}  // namespace fabric::testing
