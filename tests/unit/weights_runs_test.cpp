// The executor's request merging (schedule.h merge_runs) and its cost model (predict_update):
// a column split's rows become one paged request that delivers the immediates its WRITEs would,
// and the prediction counts those requests.
#include <gtest/gtest.h>

#include <memory>

#include "fabric/error.h"
#include "fabric/weights/plan.h"
#include "fabric/weights/update.h"
#include "weights/schedule.h"

namespace fabric::weights {
namespace {

using detail::ScheduledWrite;
using detail::WriteRun;

std::vector<uint32_t> all(size_t n) {
  std::vector<uint32_t> idx(n);
  for (uint32_t i = 0; i < n; i++) idx[i] = i;
  return idx;
}

TEST(WeightsRuns, AColumnSplitsRowsBecomeOneRunPerDestination) {
  // 64 rows of 1 KiB from a packed 2 KiB-wide slot: columns [0, 1 KiB) to rank 0, the rest to 1.
  std::vector<ScheduledWrite> w;
  for (uint32_t d = 0; d < 2; d++)
    for (uint64_t r = 0; r < 64; r++) w.push_back({0, d, 4096 + r * 2048 + d * 1024, 512 + r * 1024, 1024, 0});
  const std::vector<WriteRun> runs = detail::merge_runs(w, all(w.size()), 1);
  ASSERT_EQ(runs.size(), 2u);
  for (uint32_t d = 0; d < 2; d++) {
    EXPECT_EQ(runs[d].dst_rank, d);
    EXPECT_EQ(runs[d].count, 64u);
    EXPECT_EQ(runs[d].first, d * 64);
    EXPECT_EQ(runs[d].len, 1024u);
    EXPECT_EQ(runs[d].src_offset, 4096 + d * 1024);
    EXPECT_EQ(runs[d].src_stride, 2048u);
    EXPECT_EQ(runs[d].dst_offset, 512u);
    EXPECT_EQ(runs[d].dst_stride, 1024u);
  }
}

TEST(WeightsRuns, IrregularStridesLengthsAndBackwardStepsBreakARun) {
  std::vector<ScheduledWrite> w = {
      {0, 0, 0, 0, 100, 0},    {0, 0, 200, 100, 100, 0}, {0, 0, 400, 200, 100, 0},  // a run of 3
      {0, 0, 700, 300, 100, 0},                                                       // the source stride changes
      {0, 0, 800, 400, 100, 0},                                                       // ... and goes on: a run of 2
      {0, 0, 900, 500, 50, 0},                                                        // the length changes
      {0, 0, 10, 600, 50, 0},                                                         // the source steps back
  };
  const std::vector<WriteRun> runs = detail::merge_runs(w, all(w.size()), 1);
  ASSERT_EQ(runs.size(), 4u);
  EXPECT_EQ(runs[0].count, 3u);
  EXPECT_EQ(runs[1].count, 2u);
  EXPECT_EQ(runs[1].first, 3u);
  EXPECT_EQ(runs[1].src_stride, 100u);
  EXPECT_EQ(runs[2].count, 1u);
  EXPECT_EQ(runs[3].count, 1u);
  uint32_t writes = 0;
  for (const WriteRun& r : runs) writes += r.count;
  EXPECT_EQ(writes, w.size()) << "every WRITE in exactly one run";
}

TEST(WeightsRuns, WritesASingleWriteWouldShardAreNotMerged) {
  // 64 KiB WRITEs: over 2 NICs each single WRITE delivers 2 immediates, a page only 1.
  std::vector<ScheduledWrite> w;
  for (uint64_t r = 0; r < 4; r++) w.push_back({0, 0, r * (64 << 10), r * (64 << 10), 64 << 10, 0});
  EXPECT_EQ(detail::merge_runs(w, all(w.size()), 2).size(), 4u);
  EXPECT_EQ(detail::merge_runs(w, all(w.size()), 1).size(), 1u);
  for (size_t nics : {1, 2}) {
    uint64_t imms = 0;
    for (const WriteRun& r : detail::merge_runs(w, all(w.size()), nics))
      imms += r.count == 1 ? single_write_imm_count(r.len, nics, false) : r.count;
    EXPECT_EQ(imms, 4 * single_write_imm_count(64 << 10, nics, false)) << nics << " NICs";
  }
}

// One FP8 tensor, 256 x 512, held as two FSDP halves, needed column-split by two inference ranks.
std::shared_ptr<const UpdatePlan> column_split_plan() {
  Manifest m{.tensors = {{"o", 256, 512, 2, true}}, .src_ranks = 2, .dst_ranks = 2};
  m.sources = {{0, 0, {0, 128, 0, 512}, 0}, {0, 1, {128, 256, 0, 512}, 0}};
  for (uint32_t d = 0; d < 2; d++) {
    m.dests.push_back({0, d, {0, 256, d * 256, (d + 1) * 256}, 0});
    m.dest_scales.push_back({0, d, {0, 2, d * 2, d * 2 + 2}, 256 * 256});
  }
  return std::make_shared<const UpdatePlan>(plan_update(m));
}

TEST(WeightsRuns, ThePredictionCountsTheExecutorsRequestsAndBoundsItsTime) {
  auto plan = column_split_plan();
  const UpdatePrediction one = predict_update(plan, {.link_gbs = 100, .post_us = 10, .one_device = true});
  // The owner: one credit barrier, one gather; per inference rank one paged run of 256 rows and
  // its scales (2 rows of 8 bytes, a run too).
  EXPECT_EQ(one.requests_max, 1u + 2 * 2) << "the quantizer's requests";
  EXPECT_DOUBLE_EQ(one.post_ms, one.requests_max * 10 / 1e3);
  EXPECT_GT(one.predicted_ms, one.lower_bound_ms);
  EXPECT_GT(one.fill_ms, 0);
  const UpdatePrediction many = predict_update(plan, {.link_gbs = 100, .post_us = 10});
  EXPECT_LT(many.link_ms, one.link_ms) << "bytes spread over every rank's links";
  // Latency: one gathered unit whose hook takes 50 us, a round trip of 100 us: the fill's round
  // trip, then the unit at max(h, (h + rtt) / window), then half a round trip for its sends.
  const UpdatePrediction slow =
      predict_update(plan, {.link_gbs = 100, .unit_us = 50, .write_rtt_us = 100, .one_device = true, .window = 2});
  EXPECT_NEAR(slow.chain_ms, (100 + 75 + 50) / 1e3, 1e-9);
  EXPECT_GE(slow.predicted_ms, slow.chain_ms);
  EXPECT_EQ(one.chain_ms, 0) << "no latency terms given";
  EXPECT_THROW(predict_update(plan, {.link_gbs = 0}), Error);
  EXPECT_THROW(predict_update(nullptr, {.link_gbs = 1}), Error);
}

// Two whole 512 x 512 FP8 tensors (experts) on one training rank, back to back at the inference
// rank: FP8 bytes then 64 bytes of scales each, so with no padding between them writes_of merges
// both units' sends into one WRITE (the Qwen3-MoE experts of examples/rl_weights did this). The
// schedule splits it again per unit, each piece read from that unit's window slot.
TEST(WeightsRuns, AWriteMergedAcrossUnitsIsSplitPerUnitByTheSchedule) {
  const uint64_t fp8 = 512 * 512, scales = 4 * 4 * sizeof(float), unit = fp8 + scales;
  Manifest m{.tensors = {{"e0", 512, 512, 2, true}, {"e1", 512, 512, 2, true}}, .src_ranks = 1, .dst_ranks = 1};
  for (uint32_t t = 0; t < 2; t++) {
    m.sources.push_back({t, 0, {0, 512, 0, 512}, t * 512 * 512 * 2});
    m.dests.push_back({t, 0, {0, 512, 0, 512}, t * unit});
    m.dest_scales.push_back({t, 0, {0, 4, 0, 4}, t * unit + fp8});
  }
  auto plan = std::make_shared<const UpdatePlan>(plan_update(m));
  ASSERT_EQ(check_update(m, *plan), "");
  ASSERT_EQ(writes_of(plan->send).size(), 1u) << "the test needs the two units merged into one WRITE";
  for (uint32_t window : {1u, 2u}) {
    const detail::Schedule s = detail::schedule_update(plan, window);
    ASSERT_EQ(s.send.size(), 2u) << "window " << window;
    for (uint32_t i = 0; i < 2; i++) {
      const ScheduledWrite& w = s.send[i];
      const uint32_t u = w.unit;
      ASSERT_LT(u, s.ranks[0].units.size());
      EXPECT_EQ(w.len, unit);
      EXPECT_EQ(w.dst_offset, i * unit);
      EXPECT_EQ(w.src_offset, s.ranks[0].units[u].task.out_offset) << "read from the unit's slot";
      EXPECT_EQ(m.tensors[s.ranks[0].units[u].task.tensor].name, i == 0 ? "e0" : "e1");
    }
  }
}

}  // namespace
}  // namespace fabric::weights
