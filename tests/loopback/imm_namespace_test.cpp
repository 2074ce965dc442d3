// Immediate namespaces (TransferEngine::reserve_imms): reservations are disjoint and an overlap is
// refused naming its holder; WRITEs into a reserved region are counted in its owner's range, as
// local values, by every kind of request; a local value that does not fit is refused at submit
// with nothing posted; nobody but the holder counts or discards a reserved value.
#include <gtest/gtest.h>

#include <atomic>
#include <vector>

#include "loopback/test_support.h"

namespace fabric {
namespace {

using testing::config_for;
using testing::expect_error;
using testing::ProviderCase;
using testing::wait_until;

TEST(ImmNamespaces, ReservationsAreDisjointAndAnOverlapIsRefusedNamingItsHolder) {
  TransferEngine e(config_for({"tcp;ofi_rxm", 1, false}));
  ImmReservation kv = e.reserve_imms({.holder = "kv receiver", .bits = 28});
  ImmReservation moe = e.reserve_imms({.holder = "moe a", .bits = 28});
  EXPECT_EQ(kv.range(), (ImmRange{0xF0000000, 28})) << "the highest free block";
  EXPECT_EQ(moe.range(), (ImmRange{0xE0000000, 28}));
  EXPECT_EQ(kv.holder(), "kv receiver");
  expect_error(ErrorCode::kInvalidArgument, "held by 'kv receiver'",
               [&] { e.reserve_imms({.holder = "late", .bits = 27, .base = 0xF8000000}); });
  expect_error(ErrorCode::kInvalidArgument, "held by 'kv receiver'",
               [&] { e.reserve_imms({.holder = "everything", .bits = 32, .base = 0}); });
  expect_error(ErrorCode::kInvalidArgument, "not a multiple", [&] { e.reserve_imms({.holder = "x", .bits = 8, .base = 0x10}); });
  expect_error(ErrorCode::kInvalidArgument, "0 bits", [&] { e.reserve_imms({.holder = "x", .bits = 0}); });
  expect_error(ErrorCode::kInvalidArgument, "33 bits", [&] { e.reserve_imms({.holder = "x", .bits = 33}); });
  // An explicit base that is free is taken as asked.
  ImmReservation fixed = e.reserve_imms({.holder = "fixed", .bits = 16, .base = 0x00010000});
  EXPECT_EQ(fixed.range().base, 0x00010000u);

  // The other 13 free blocks of 2^28 (one of the 16 holds `fixed`) and then none.
  std::vector<ImmReservation> rest;
  for (int i = 0; i < 13; i++) rest.push_back(e.reserve_imms({.holder = "filler", .bits = 28}));
  for (const ImmReservation& r : rest) EXPECT_FALSE(r.range().overlaps(fixed.range()));
  expect_error(ErrorCode::kResourceExhausted, "'moe a' [0xe0000000, 0xefffffff]",
               [&] { e.reserve_imms({.holder = "one too many", .bits = 28}); });
  // A smaller block still fits beside `fixed`.
  ImmReservation small = e.reserve_imms({.holder = "small", .bits = 8});
  EXPECT_TRUE(small.range().base < 0x10000000u);

  // Released (by release(), by destruction or by a move over it), a range can be taken again.
  kv.release();
  EXPECT_FALSE(kv.held());
  ImmReservation again = e.reserve_imms({.holder = "kv again", .bits = 28});
  EXPECT_EQ(again.range().base, 0xF0000000u);
  again = std::move(moe);  // gives 0xF0000000 back and takes over 'moe a'
  EXPECT_FALSE(moe.held());  // NOLINT(bugprone-use-after-move): a moved-from reservation holds nothing
  EXPECT_EQ(e.reserve_imms({.holder = "third", .bits = 28}).range().base, 0xF0000000u);
  expect_error(ErrorCode::kNotFound, "not held", [&] { kv.count(1); });
}

TEST(ImmNamespaces, OnlyTheHolderCountsOrDiscardsItsValues) {
  TransferEngine e(config_for({"tcp;ofi_rxm", 1, false}));
  ImmReservation r = e.reserve_imms({.holder = "weights trainer 3", .bits = 28});
  const uint32_t inside = r.imm(5);
  EXPECT_EQ(inside, 0xF0000005u);
  std::atomic<int> flag{kDonePending};
  expect_error(ErrorCode::kInvalidArgument, "'weights trainer 3'",
               [&] { e.expect_imm_count(inside, 1, OnDone::flag(&flag)); });
  expect_error(ErrorCode::kInvalidArgument, "'weights trainer 3'", [&] { e.imm_count(inside); });
  expect_error(ErrorCode::kInvalidArgument, "'weights trainer 3'", [&] { e.discard_imm_count(inside); });
  EXPECT_EQ(flag.load(), kDonePending) << "a refused expectation is never called back";
  expect_error(ErrorCode::kInvalidArgument, "outside its 28 bits", [&] { r.expect(1u << 28, 1, OnDone::flag(&flag)); });
  expect_error(ErrorCode::kInvalidArgument, "outside its 28 bits", [&] { r.discard(1u << 28); });
  // Values outside every reservation stay the raw API's.
  ImmExpectation x = e.expect_imm_count(5, 1, OnDone::flag(&flag));
  EXPECT_TRUE(e.cancel_imm_expectation(x));
  EXPECT_EQ(flag.load(), kDoneFailed);
  // The holder's own expectation can be cancelled through it.
  std::atomic<int> mine{kDonePending};
  ImmExpectation y = r.expect(5, 1, OnDone::flag(&mine));
  EXPECT_EQ(y.imm, inside);
  EXPECT_TRUE(r.cancel(y));
  EXPECT_EQ(mine.load(), kDoneFailed);
  r.release();
  EXPECT_EQ(e.imm_count(inside), 0u) << "released: the value is the raw API's again";
}

class ImmNamespaceWrites : public ::testing::TestWithParam<ProviderCase> {};

// Every kind of request, into a region of `b` registered under an 8-bit reservation, beside an
// unreserved region of `b` that receives the same values raw.
TEST_P(ImmNamespaceWrites, EveryKindOfWriteIsCountedInItsDestinationsRangeAndNothingElse) {
  const ProviderCase pc = GetParam();
  TransferEngine a(config_for(pc)), b(config_for(pc));
  ImmReservation r = b.reserve_imms({.holder = "b's user", .bits = 8});
  std::vector<uint8_t> src(4096, 7), reserved(4096), raw(4096);
  auto [hs, ds] = a.reg_mr(src.data(), src.size());
  auto [hr, dr] = b.reg_mr(reserved.data(), reserved.size(), Device::host(), r);
  auto [hw, dw] = b.reg_mr(raw.data(), raw.size());
  EXPECT_EQ(dr.imms(), r.range());
  EXPECT_EQ(dw.imms(), (ImmRange{0, 32}));
  const RemoteMr to_r = a.add_remote(dr), to_w = a.add_remote(dw);
  const std::vector<RemoteMr> both{to_r, to_w};
  const PeerGroupHandle group = a.add_peer_group(both);

  // Local values 1-6 into the reserved region (kinds in that order), the same values raw.
  std::vector<std::atomic<int>> sent(12);
  for (auto& s : sent) s = kDonePending;
  const uint32_t pages[] = {0, 2};
  a.submit(SingleWrite{.len = 64, .src = {hs, 0}, .dst = {to_r, 0}, .imm = 1}, OnDone::flag(&sent[0]));
  a.submit(PagedWrites{.page_len = 64, .src = hs, .src_pages = {pages, 64, 0}, .dst = to_r,
                       .dst_pages = {pages, 64, 512}, .imm = 2},
           OnDone::flag(&sent[1]));
  const ScatterSlice slices[] = {{.len = 32, .src_offset = 0, .dst = {to_r, 1024}}, {.len = 32, .src_offset = 0, .dst = {to_w, 1024}}};
  a.submit(Scatter{.src = hs, .slices = slices, .imm = 3}, OnDone::flag(&sent[2]));
  a.submit(Barrier{.dsts = both, .imm = 4}, OnDone::flag(&sent[3]));
  const GroupSlice gslices[] = {{.len = 16, .src_offset = 0, .dst_offset = 2048}, {.len = 16, .src_offset = 0, .dst_offset = 2048}};
  a.submit(GroupScatter{.group = group, .src = hs, .slices = gslices, .imm = 5}, OnDone::flag(&sent[4]));
  a.submit(GroupBarrier{.group = group, .imm = 6}, OnDone::flag(&sent[5]));
  for (uint32_t v = 1; v <= 2; v++)
    a.submit(SingleWrite{.len = 64, .src = {hs, 0}, .dst = {to_w, 0}, .imm = v}, OnDone::flag(&sent[5 + v]));
  ASSERT_TRUE(wait_until([&] {
    for (size_t i = 0; i < 8; i++)
      if (sent[i].load() == kDonePending) return false;
    return true;
  }));
  for (size_t i = 0; i < 8; i++) EXPECT_EQ(sent[i].load(), kDoneSucceeded) << i;
  const uint64_t single = single_write_imm_count(64, pc.nics, false);
  const uint64_t in_r[] = {0, single, 2, 1, 1, 1, 1};   // by local value 1-6
  const uint64_t raw_n[] = {0, single, single, 1, 1, 1, 1};  // raw: 1, 2 (single writes), 3-6 (one slice or member each)
  for (uint32_t v = 1; v <= 6; v++) {
    std::atomic<int> landed{kDonePending};
    r.expect(v, in_r[v], OnDone::flag(&landed), {.timeout = std::chrono::seconds(60)});
    ASSERT_TRUE(wait_until([&] { return landed.load() != kDonePending; }));
    EXPECT_EQ(landed.load(), kDoneSucceeded) << "local value " << v;
    EXPECT_TRUE(wait_until([&] { return b.imm_count(v) == raw_n[v]; })) << "raw value " << v << ": " << b.imm_count(v);
  }
  EXPECT_EQ(r.count(1), 0u) << "nothing beyond what was expected";
  EXPECT_EQ(std::vector<uint8_t>(reserved.begin(), reserved.begin() + 64), std::vector<uint8_t>(64, 7));
  EXPECT_EQ(raw[2048], 7);

  // discard touches its own range only: value 7 lands twice there and once raw.
  for (const RemoteMr& d : {to_r, to_r, to_w})
    a.submit(Barrier{.dsts = {&d, 1}, .imm = 7}, OnDone::none());
  ASSERT_TRUE(wait_until([&] { return r.count(7) == 2 && b.imm_count(7) == 1; }));
  EXPECT_EQ(r.discard(7), 2u);
  EXPECT_EQ(b.imm_count(7), 1u) << "the holder's discard left the raw value's count alone";
  EXPECT_EQ(b.discard_imm_count(7), 1u);

  // A local value that does not fit the destination's 8 bits: refused at submit, never called back.
  std::atomic<int> refused{kDonePending};
  const char* fit = "does not fit the 8-bit immediate range";
  expect_error(ErrorCode::kInvalidArgument, fit, [&] {
    a.submit(SingleWrite{.len = 64, .src = {hs, 0}, .dst = {to_r, 0}, .imm = 256}, OnDone::flag(&refused));
  });
  expect_error(ErrorCode::kInvalidArgument, fit, [&] {
    a.submit(PagedWrites{.page_len = 64, .src = hs, .src_pages = {pages, 64, 0}, .dst = to_r, .dst_pages = {pages, 64, 0},
                         .imm = 256},
             OnDone::flag(&refused));
  });
  expect_error(ErrorCode::kInvalidArgument, "destination 0", [&] {  // the reserved destination is slice 0
    a.submit(Scatter{.src = hs, .slices = slices, .imm = 0x1000}, OnDone::flag(&refused));
  });
  expect_error(ErrorCode::kInvalidArgument, "destination 0", [&] {
    a.submit(Barrier{.dsts = both, .imm = 0x1000}, OnDone::flag(&refused));
  });
  expect_error(ErrorCode::kInvalidArgument, fit, [&] {
    a.submit(GroupScatter{.group = group, .src = hs, .slices = gslices, .imm = 256}, OnDone::flag(&refused));
  });
  expect_error(ErrorCode::kInvalidArgument, fit,
               [&] { a.submit(GroupBarrier{.group = group, .imm = 256}, OnDone::flag(&refused)); });
  // The unreserved region still takes any value.
  std::atomic<int> wide{kDonePending};
  a.submit(SingleWrite{.len = 64, .src = {hs, 0}, .dst = {to_w, 0}, .imm = 0xF0000001}, OnDone::flag(&wide));
  ASSERT_TRUE(wait_until([&] { return wide.load() != kDonePending && b.imm_count(0xF0000001) == single; }));
  EXPECT_EQ(wide.load(), kDoneSucceeded);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(refused.load(), kDonePending);
  EXPECT_EQ(r.count(0), 0u) << "no refused write reached the reserved range";
}

INSTANTIATE_TEST_SUITE_P(Loopback, ImmNamespaceWrites,
                         ::testing::Values(ProviderCase{"tcp;ofi_rxm", 1, false}, ProviderCase{"shm", 2, false},
                                           ProviderCase{"tcp;ofi_rxm", 2, true}),
                         testing::case_name);

}  // namespace
}  // namespace fabric
