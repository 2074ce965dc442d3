// Weight updates with FP8 destinations (plan_update): the plan is executed here on byte arrays,
// gather, quantize and send, exactly as the executor will on registered buffers, and every
// inference byte (FP8 values, block scales, BF16 tensors) must equal the block quantization of
// the full tensor; random manifests with unaligned FSDP shards, replicas and TP splits.
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "fabric/error.h"
#include "fabric/weights/fp8.h"
#include "fabric/weights/plan.h"
#include "weights_model.h"

namespace fabric::weights {
namespace {

using testing::expect_exact;
using testing::Model;
using testing::random_bf16;
using testing::random_model;


// Runs gather, quantize and send over per-rank byte arrays; returns the inference ranks' bytes.
std::vector<std::vector<uint8_t>> execute(const Model& model, const UpdatePlan& up) {
  const Manifest& m = model.m;
  std::vector<std::vector<uint8_t>> src(m.src_ranks), dst(m.dst_ranks);
  for (uint32_t r = 0; r < m.src_ranks; r++) src[r].assign(up.staging_base[r] + up.staging_bytes[r], 0);
  for (uint32_t r = 0; r < m.dst_ranks; r++) dst[r].assign(model.dst_size[r], 0);
  for (const Placement& s : m.sources) {
    const TensorSpec& t = m.tensors[s.tensor];
    const uint64_t stride = s.row_stride ? s.row_stride : s.box.cols() * 2;
    for (uint64_t i = 0; i < s.box.rows(); i++)
      std::memcpy(&src[s.rank][s.offset + i * stride], &model.full[s.tensor][(s.box.r0 + i) * t.cols + s.box.c0],
                  s.box.cols() * 2);
  }
  auto run = [](const Copy& c, const std::vector<uint8_t>& from, std::vector<uint8_t>& to) {
    for (uint64_t i = 0; i < c.rows; i++) {
      if (c.src_offset + i * c.src_stride + c.row_bytes > from.size() ||
          c.dst_offset + i * c.dst_stride + c.row_bytes > to.size()) {
        ADD_FAILURE() << "a copy of tensor " << c.tensor << " reaches outside a buffer";
        return;
      }
      std::memcpy(&to[c.dst_offset + i * c.dst_stride], &from[c.src_offset + i * c.src_stride], c.row_bytes);
    }
  };
  // Local gather copies are memcpys; everything else goes as the WRITEs writes_of merges.
  auto put = [](const Write& w, const std::vector<uint8_t>& from, std::vector<uint8_t>& to) {
    if (w.src_offset + w.len > from.size() || w.dst_offset + w.len > to.size()) {
      ADD_FAILURE() << "a WRITE from rank " << w.src_rank << " to rank " << w.dst_rank << " reaches outside a buffer";
      return;
    }
    std::memcpy(&to[w.dst_offset], &from[w.src_offset], w.len);
  };
  for (const Copy& c : up.gather.copies)
    if (c.local) run(c, src[c.src_rank], src[c.dst_rank]);
  for (const Write& w : writes_of(up.gather)) put(w, src[w.src_rank], src[w.dst_rank]);
  for (const QuantizeTask& q : up.quantize) {
    const TensorSpec& t = m.tensors[q.tensor];
    const uint64_t rows = q.r1 - q.r0;
    std::vector<uint16_t> in(rows * t.cols);
    for (uint64_t i = 0; i < rows; i++)
      std::memcpy(&in[i * t.cols], &src[q.rank][q.in_offset + i * q.in_stride], t.cols * 2);
    std::vector<float> scales((fp8::scale_rows(q.r1) - q.r0 / fp8::kBlock) * fp8::scale_cols(t.cols));
    fp8::quantize_blocks({.in = in, .rows = rows, .cols = t.cols, .out = {&src[q.rank][q.out_offset], rows * t.cols},
                          .scales = scales});
    std::memcpy(&src[q.rank][q.scale_offset], scales.data(), scales.size() * sizeof(float));
  }
  for (const Copy& c : up.send.copies) EXPECT_FALSE(c.local);
  for (const Write& w : writes_of(up.send)) put(w, src[w.src_rank], dst[w.dst_rank]);
  return dst;
}

// One 896 x 128 FP8 tensor (7 bands) over FSDP 2, split at row 448 (inside band 3), to one
// inference rank that holds it whole with its scales after it.
Model two_shard_model(uint32_t seed) {
  Model model;
  Manifest& m = model.m;
  m.tensors = {{"w2", 896, 128, 2, true}};
  m.src_ranks = 2;
  m.dst_ranks = 1;
  std::mt19937 rng(seed);
  model.full.emplace_back(896 * 128);
  for (auto& v : model.full[0]) v = random_bf16(rng);
  for (uint32_t r = 0; r < 2; r++)
    m.sources.push_back({.tensor = 0, .rank = r, .box = {448 * r, 448 * r + 448, 0, 128}, .offset = 0, .row_stride = 0});
  m.dests.push_back({.tensor = 0, .rank = 0, .box = {0, 896, 0, 128}, .offset = 0, .row_stride = 0});
  m.dest_scales.push_back({.tensor = 0, .rank = 0, .box = {0, 7, 0, 1}, .offset = 896 * 128, .row_stride = 0});
  model.dst_size = {896 * 128 + 28};
  return model;
}

TEST(WeightsUpdate, AlignedShardsQuantizeInPlaceWithoutAGather) {
  // 512 x 256 over FSDP 4 (128 rows each: one band per rank) into TP 2 column halves.
  Model model;
  Manifest& m = model.m;
  m.tensors = {{"w", 512, 256, 2, true}};
  m.src_ranks = 4;
  m.dst_ranks = 2;
  std::mt19937 rng(1);
  model.full.emplace_back(512 * 256);
  for (auto& v : model.full[0]) v = random_bf16(rng);
  for (uint32_t r = 0; r < 4; r++)
    m.sources.push_back({.tensor = 0, .rank = r, .box = {128 * r, 128 * r + 128, 0, 256}, .offset = 0, .row_stride = 0});
  for (uint32_t d = 0; d < 2; d++) {
    m.dests.push_back({.tensor = 0, .rank = d, .box = {0, 512, 128 * d, 128 * d + 128}, .offset = 0, .row_stride = 0});
    m.dest_scales.push_back({.tensor = 0, .rank = d, .box = {0, 4, d, d + 1}, .offset = 512 * 128, .row_stride = 0});
  }
  model.dst_size = {512 * 128 + 16, 512 * 128 + 16};
  UpdatePlan up = plan_update(m, {.owner_rows = 128});
  EXPECT_EQ(check_update(m, up), "");
  EXPECT_TRUE(up.gather.copies.empty()) << "every band lies within one shard";
  ASSERT_EQ(up.quantize.size(), 4u);
  for (uint32_t r = 0; r < 4; r++) EXPECT_EQ(up.quantize[r].rank, r);
  EXPECT_DOUBLE_EQ(up.send.src_max_over_mean(), 1.0);
  expect_exact(model, execute(model, up));
}

TEST(WeightsUpdate, UnalignedShardsGatherOnlyTheBandsThatStraddle) {
  // Band 3 (rows 384-512) straddles the shards: its owner gathers 64 rows.
  Model model = two_shard_model(2);
  const Manifest& m = model.m;
  UpdatePlan up = plan_update(m, {.owner_rows = 128});
  EXPECT_EQ(check_update(m, up), "");
  uint64_t remote = 0, local = 0;
  for (const Copy& c : up.gather.copies) (c.local ? local : remote) += c.bytes();
  EXPECT_EQ(remote, 64u * 128 * 2) << "half a band crosses";
  EXPECT_EQ(local, 64u * 128 * 2);
  EXPECT_EQ(up.quantize.size(), 7u);
  expect_exact(model, execute(model, up));
}

TEST(WeightsUpdate, WholeTensorOwnersGatherTheRestAndSendOneWritePerDestination) {
  // Whole-tensor units: one owner gathers the other half.
  Model model = two_shard_model(3);
  const Manifest& m = model.m;
  UpdatePlan up = plan_update(m);
  EXPECT_EQ(check_update(m, up), "");
  ASSERT_EQ(up.quantize.size(), 1u);
  EXPECT_TRUE(up.quantize[0].gathered);
  uint64_t remote = 0;
  for (const Copy& c : up.gather.copies) remote += c.local ? 0 : c.bytes();
  EXPECT_EQ(remote, 448u * 128 * 2) << "the other rank's half";
  EXPECT_EQ(up.send.dst_writes[0], 2u) << "the FP8 tensor and its scales";
  EXPECT_EQ(writes_of(up.send).size(), 1u) << "side by side on both sides: one WRITE";
  expect_exact(model, execute(model, up));
  EXPECT_THROW(plan_update(m, {.owner_rows = 100}), Error);
}

TEST(WeightsUpdate, RandomManifestsAreExactBitForBit) {
  for (uint32_t seed = 0; seed < 90; seed++) {
    Model model = random_model(seed);
    const uint64_t owner_rows = 128 * (seed % 3);  // whole tensors, bands, pairs of bands
    UpdatePlan up = plan_update(model.m, {.owner_rows = owner_rows});
    ASSERT_EQ(check_update(model.m, up), "") << "seed " << seed;
    expect_exact(model, execute(model, up));
    if (HasFatalFailure()) {
      ADD_FAILURE() << "seed " << seed;
      return;
    }
  }
}

TEST(WeightsUpdate, ReplicasBalanceTheQuantizingAndSending) {
  // 32 aligned tensors held by 2 replicas of FSDP 2: the 4 ranks share the bands evenly.
  Manifest m;
  m.src_ranks = 4;
  m.dst_ranks = 2;
  for (uint32_t t = 0; t < 32; t++) {
    m.tensors.push_back({"e" + std::to_string(t), 256, 256, 2, true});
    for (uint32_t r = 0; r < 4; r++)
      m.sources.push_back({.tensor = t, .rank = r, .box = {128 * (r % 2), 128 * (r % 2) + 128, 0, 256},
                           .offset = 65536 * t, .row_stride = 0});
    m.dests.push_back({.tensor = t, .rank = t % 2, .box = {0, 256, 0, 256}, .offset = 65536 * t, .row_stride = 0});
    m.dest_scales.push_back({.tensor = t, .rank = t % 2, .box = {0, 2, 0, 2}, .offset = 65536 * 32 + 16 * t, .row_stride = 0});
  }
  UpdatePlan up = plan_update(m);
  EXPECT_EQ(check_update(m, up), "");
  EXPECT_LE(up.send.src_max_over_mean(), 1.01);
}

TEST(WeightsUpdate, MisalignedFp8PiecesAndBrokenPlansAreRefused) {
  Manifest m{.tensors = {{"w", 256, 256, 2, true}}, .src_ranks = 1, .dst_ranks = 2};
  m.sources.push_back({.tensor = 0, .rank = 0, .box = {0, 256, 0, 256}, .offset = 0, .row_stride = 0});
  m.dests.push_back({.tensor = 0, .rank = 0, .box = {0, 256, 0, 100}, .offset = 0, .row_stride = 0});
  try {
    plan_update(m);
    ADD_FAILURE() << "a piece splitting a block was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("aligned to 128 x 128"), std::string::npos) << e.what();
  }
  m.dests[0].box = {0, 256, 0, 128};
  m.dests.push_back({.tensor = 0, .rank = 1, .box = {0, 256, 128, 256}, .offset = 0, .row_stride = 0});
  m.dest_scales.push_back({.tensor = 0, .rank = 0, .box = {0, 2, 0, 1}, .offset = 256 * 128, .row_stride = 0});
  m.dest_scales.push_back({.tensor = 0, .rank = 1, .box = {0, 2, 1, 2}, .offset = 256 * 128, .row_stride = 0});
  UpdatePlan up = plan_update(m);
  ASSERT_EQ(check_update(m, up), "");
  UpdatePlan dropped = up;
  dropped.quantize.pop_back();
  EXPECT_NE(check_update(m, dropped).find("never quantized"), std::string::npos);
  UpdatePlan doubled = up;
  doubled.quantize.push_back(up.quantize[0]);
  EXPECT_NE(check_update(m, doubled).find("quantized 2 times"), std::string::npos);
  UpdatePlan misread = up;
  misread.quantize[0].in_offset += 2;
  EXPECT_NE(check_update(m, misread).find("not the whole unit"), std::string::npos);
}

}  // namespace
}  // namespace fabric::weights
