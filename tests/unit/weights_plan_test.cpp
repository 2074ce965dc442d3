// The weight-update planner: every destination byte covered exactly once from a holder (checked
// by weights::check, itself shown to catch broken plans), replicas balanced, fused destinations,
// and manifests it cannot cover refused with a clear error; random manifests as a property test.
#include "fabric/weights/plan.h"

#include <gtest/gtest.h>

#include <random>

#include "fabric/error.h"

namespace fabric::weights {
namespace {

// Rows of `t` split evenly over `n` source ranks (FSDP along dim 0), each shard packed at offset 0
// of its rank's buffer plus `base`; ranks first_rank ... first_rank + n - 1.
void fsdp(Manifest& m, uint32_t tensor, uint32_t first_rank, uint32_t n, uint64_t base = 0) {
  const TensorSpec& t = m.tensors[tensor];
  for (uint32_t i = 0; i < n; i++)
    m.sources.push_back({.tensor = tensor, .rank = first_rank + i,
                         .box = {t.rows * i / n, t.rows * (i + 1) / n, 0, t.cols}, .offset = base, .row_stride = 0});
}

TEST(WeightsPlan, FsdpRowsIntoTensorParallelColumns) {
  Manifest m{.tensors = {{"w", 64, 32, 2}}, .src_ranks = 4, .dst_ranks = 2, .sources = {}, .dests = {}};
  fsdp(m, 0, 0, 4);
  for (uint32_t d = 0; d < 2; d++)
    m.dests.push_back({.tensor = 0, .rank = d, .box = {0, 64, 16 * d, 16 * d + 16}, .offset = 0, .row_stride = 0});
  Plan p = plan(m);
  EXPECT_EQ(check(m, p), "");
  EXPECT_EQ(p.copies.size(), 8u) << "each shard to each TP rank";
  EXPECT_DOUBLE_EQ(p.src_max_over_mean(), 1.0);
  for (uint32_t d = 0; d < 2; d++) {
    EXPECT_EQ(p.dst_bytes[d], 64u * 16 * 2);
    EXPECT_EQ(p.dst_writes[d], 64u) << "a half row of a packed shard is one WRITE per row";
  }
}

TEST(WeightsPlan, WritesOfAPlanExpandStridedCopiesAndMergeContinuations) {
  Plan p;
  // Strided (3 rows of 8 bytes), then two contiguous copies that continue each other on both
  // sides, one that continues only on the source side, and one to another rank; a local copy.
  p.copies.push_back({.tensor = 0, .src_rank = 0, .dst_rank = 0, .rows = 3, .row_bytes = 8, .src_offset = 0,
                      .src_stride = 16, .dst_offset = 0, .dst_stride = 32});
  p.copies.push_back({.tensor = 0, .src_rank = 0, .dst_rank = 0, .rows = 1, .row_bytes = 100, .src_offset = 1000,
                      .src_stride = 100, .dst_offset = 5000, .dst_stride = 100});
  p.copies.push_back({.tensor = 1, .src_rank = 0, .dst_rank = 0, .rows = 2, .row_bytes = 50, .src_offset = 1100,
                      .src_stride = 50, .dst_offset = 5100, .dst_stride = 50});
  p.copies.push_back({.tensor = 1, .src_rank = 0, .dst_rank = 0, .rows = 1, .row_bytes = 10, .src_offset = 1200,
                      .src_stride = 10, .dst_offset = 9000, .dst_stride = 10});
  p.copies.push_back({.tensor = 1, .src_rank = 0, .dst_rank = 1, .rows = 1, .row_bytes = 10, .src_offset = 1210,
                      .src_stride = 10, .dst_offset = 9010, .dst_stride = 10});
  p.copies.push_back({.tensor = 1, .src_rank = 0, .dst_rank = 0, .local = true, .rows = 1, .row_bytes = 10,
                      .src_offset = 1300, .src_stride = 10, .dst_offset = 9300, .dst_stride = 10});
  std::vector<Write> w = writes_of(p);
  ASSERT_EQ(w.size(), 6u);
  EXPECT_EQ(w[0].src_offset, 0u);
  EXPECT_EQ(w[2].dst_offset, 64u);  // the strided rows, one each
  EXPECT_EQ(w[3].src_offset, 1000u);
  EXPECT_EQ(w[3].len, 200u) << "the two continuing copies merged";
  EXPECT_EQ(w[4].dst_offset, 9000u) << "continues on the source side only: its own WRITE";
  EXPECT_EQ(w[5].dst_rank, 1u);
}

TEST(WeightsPlan, FusedDestinationsStackRowsOrSitSideBySide) {
  // q, k, v stacked along dim 0 into one qkv buffer; gate and up side by side (one row stride).
  Manifest m{.tensors = {{"q", 32, 16, 2}, {"k", 8, 16, 2}, {"v", 8, 16, 2}, {"gate", 24, 8, 2}, {"up", 24, 8, 2}},
             .src_ranks = 2, .dst_ranks = 1, .sources = {}, .dests = {}};
  for (uint32_t t = 0; t < 5; t++) fsdp(m, t, 0, 2, 1000 * t);
  const uint64_t row = 16 * 2;
  m.dests.push_back({.tensor = 0, .rank = 0, .box = {0, 32, 0, 16}, .offset = 0, .row_stride = 0});
  m.dests.push_back({.tensor = 1, .rank = 0, .box = {0, 8, 0, 16}, .offset = 32 * row, .row_stride = 0});
  m.dests.push_back({.tensor = 2, .rank = 0, .box = {0, 8, 0, 16}, .offset = 40 * row, .row_stride = 0});
  const uint64_t gu = 100000, fused_stride = 2 * 8 * 2;
  m.dests.push_back({.tensor = 3, .rank = 0, .box = {0, 24, 0, 8}, .offset = gu, .row_stride = fused_stride});
  m.dests.push_back({.tensor = 4, .rank = 0, .box = {0, 24, 0, 8}, .offset = gu + 16, .row_stride = fused_stride});
  Plan p = plan(m);
  EXPECT_EQ(check(m, p), "");
  EXPECT_EQ(p.dst_bytes[0], (32 + 8 + 8) * row + 2 * 24 * 16);
}

TEST(WeightsPlan, ReplicasShareTheWorkEvenly) {
  // Two data-parallel replicas (ranks 0-3 and 4-7) hold the same four shards of 16 tensors.
  Manifest m{.tensors = {}, .src_ranks = 8, .dst_ranks = 2, .sources = {}, .dests = {}};
  for (uint32_t t = 0; t < 16; t++) {
    m.tensors.push_back({"t" + std::to_string(t), 128, 64, 2});
    fsdp(m, t, 0, 4, t * 65536);
    fsdp(m, t, 4, 4, t * 65536);
    m.dests.push_back({.tensor = t, .rank = t % 2, .box = {0, 128, 0, 64}, .offset = (t / 2) * 16384, .row_stride = 0});
  }
  Plan p = plan(m);
  EXPECT_EQ(check(m, p), "");
  EXPECT_LE(p.src_max_over_mean(), 1.1);
  for (uint32_t r = 0; r < 8; r++) EXPECT_GT(p.src_bytes[r], 0u) << "rank " << r << " sends its share";
  for (const Copy& c : p.copies) EXPECT_EQ(c.writes(), 1u) << "packed shard into packed tensor: one WRITE";
}

TEST(WeightsPlan, ManifestsItCannotCoverAreRefusedWithAClearError) {
  auto expect_refused = [](const Manifest& m, const std::string& what) {
    try {
      plan(m);
      ADD_FAILURE() << "accepted; expected: " << what;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  Manifest m{.tensors = {{"w", 16, 8, 2}}, .src_ranks = 2, .dst_ranks = 1, .sources = {}, .dests = {}};
  m.sources.push_back({.tensor = 0, .rank = 0, .box = {0, 8, 0, 8}, .offset = 0, .row_stride = 0});
  m.dests.push_back({.tensor = 0, .rank = 0, .box = {0, 16, 0, 8}, .offset = 0, .row_stride = 0});
  expect_refused(m, "no training rank holds rows [8, 16)");
  m.sources.push_back({.tensor = 0, .rank = 1, .box = {8, 16, 0, 8}, .offset = 0, .row_stride = 0});
  EXPECT_EQ(check(m, plan(m)), "");
  Manifest overlap = m;
  overlap.dests.push_back({.tensor = 0, .rank = 0, .box = {0, 1, 0, 8}, .offset = 16, .row_stride = 0});
  expect_refused(overlap, "pieces overlap");
  Manifest outside = m;
  outside.dests[0].box.c1 = 9;
  expect_refused(outside, "outside w");
  Manifest bad_rank = m;
  bad_rank.sources[0].rank = 5;
  expect_refused(bad_rank, "rank 5 of 2");
  Manifest short_stride = m;
  short_stride.dests[0].row_stride = 8;
  expect_refused(short_stride, "row stride of 8 bytes");
}

TEST(WeightsPlan, TheCheckCatchesBrokenPlans) {
  Manifest m{.tensors = {{"w", 32, 16, 2}}, .src_ranks = 2, .dst_ranks = 1, .sources = {}, .dests = {}};
  fsdp(m, 0, 0, 2);
  m.dests.push_back({.tensor = 0, .rank = 0, .box = {0, 32, 0, 16}, .offset = 0, .row_stride = 0});
  Plan good = plan(m);
  ASSERT_EQ(check(m, good), "");
  Plan dropped = good;
  dropped.copies.pop_back();
  EXPECT_NE(check(m, dropped), "");
  Plan doubled = good;
  doubled.copies.push_back(good.copies.front());
  EXPECT_NE(check(m, doubled), "");
  Plan shifted = good;
  shifted.copies.front().dst_offset += 2;
  EXPECT_NE(check(m, shifted), "");
  Plan wrong_source = good;
  wrong_source.copies.front().src_offset += 32;
  EXPECT_NE(check(m, wrong_source), "");
}

// Random tensors, random row and column shard grids with random replication, random destination
// splits packed at random offsets: the plan always checks out and moves exactly what is needed.
TEST(WeightsPlan, RandomManifestsAreCoveredExactlyOnce) {
  std::mt19937_64 rng(17);
  auto pick = [&](uint64_t lo, uint64_t hi) { return lo + rng() % (hi - lo + 1); };
  auto cuts = [&](uint64_t n, uint64_t parts) {
    std::set<uint64_t> c{0, n};
    while (c.size() < std::min(parts + 1, n + 1)) c.insert(pick(1, n - 1));
    return std::vector<uint64_t>(c.begin(), c.end());
  };
  for (int iter = 0; iter < 200; iter++) {
    Manifest m;
    m.src_ranks = static_cast<uint32_t>(pick(1, 12));
    m.dst_ranks = static_cast<uint32_t>(pick(1, 6));
    std::vector<uint64_t> src_used(m.src_ranks, 0), dst_used(m.dst_ranks, 0);
    const uint32_t tensors = static_cast<uint32_t>(pick(1, 6));
    uint64_t wanted = 0;
    for (uint32_t t = 0; t < tensors; t++) {
      TensorSpec spec{"t" + std::to_string(t), pick(2, 40), pick(2, 24), static_cast<uint32_t>(pick(1, 4))};
      m.tensors.push_back(spec);
      const auto rc = cuts(spec.rows, pick(1, 4)), cc = cuts(spec.cols, pick(1, 3));
      for (size_t i = 0; i + 1 < rc.size(); i++)
        for (size_t j = 0; j + 1 < cc.size(); j++)
          for (uint64_t copy = 0, copies = pick(1, 3); copy < copies; copy++) {
            const uint32_t r = static_cast<uint32_t>(pick(0, m.src_ranks - 1));
            Placement p{.tensor = t, .rank = r, .box = {rc[i], rc[i + 1], cc[j], cc[j + 1]}, .offset = src_used[r],
                        .row_stride = (cc[j + 1] - cc[j]) * spec.elem_bytes + pick(0, 1) * 8};
            src_used[r] += p.row_stride * p.box.rows() + 64;
            m.sources.push_back(p);
          }
      const auto dr = cuts(spec.rows, pick(1, 3)), dc = cuts(spec.cols, pick(1, 2));
      for (size_t i = 0; i + 1 < dr.size(); i++)
        for (size_t j = 0; j + 1 < dc.size(); j++) {
          const uint32_t r = static_cast<uint32_t>(pick(0, m.dst_ranks - 1));
          Placement p{.tensor = t, .rank = r, .box = {dr[i], dr[i + 1], dc[j], dc[j + 1]}, .offset = dst_used[r],
                      .row_stride = 0};
          dst_used[r] += p.box.rows() * p.box.cols() * spec.elem_bytes + pick(0, 3) * 16;
          wanted += p.box.rows() * p.box.cols() * spec.elem_bytes;
          m.dests.push_back(p);
        }
    }
    Plan p = plan(m);
    ASSERT_EQ(check(m, p), "") << "iteration " << iter;
    uint64_t moved = 0;
    for (uint64_t b : p.dst_bytes) moved += b;
    EXPECT_EQ(moved, wanted) << "iteration " << iter;
    EXPECT_EQ(plan(m).copies.size(), p.copies.size()) << "deterministic";
  }
}

}  // namespace
}  // namespace fabric::weights
