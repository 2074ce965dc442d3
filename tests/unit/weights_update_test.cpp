// Weight updates with FP8 destinations (plan_update): the plan is executed here on byte arrays,
// gather, quantize and send, exactly as the executor will on registered buffers, and every
// inference byte (FP8 values, block scales, BF16 tensors) must equal the block quantization of
// the full tensor; random manifests with unaligned FSDP shards, replicas and TP splits.
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "fabric/error.h"
#include "fabric/fp8.h"
#include "fabric/weights.h"

namespace fabric::weights {
namespace {

struct Model {
  Manifest m;
  std::vector<std::vector<uint16_t>> full;  // each tensor's BF16 values, row-major
  std::vector<uint64_t> dst_size;           // bytes per inference rank
};

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

// Every inference byte against the quantization of the full tensors.
void expect_exact(const Model& model, const std::vector<std::vector<uint8_t>>& dst) {
  const Manifest& m = model.m;
  std::vector<std::vector<uint8_t>> q(m.tensors.size());
  std::vector<std::vector<float>> s(m.tensors.size());
  for (uint32_t t = 0; t < m.tensors.size(); t++) {
    const TensorSpec& spec = m.tensors[t];
    if (!spec.fp8_blocks) continue;
    q[t].resize(spec.rows * spec.cols);
    s[t].resize(fp8::scale_rows(spec.rows) * fp8::scale_cols(spec.cols));
    fp8::quantize_blocks({.in = model.full[t], .rows = spec.rows, .cols = spec.cols, .out = q[t], .scales = s[t]});
  }
  for (const Placement& d : m.dests) {
    const TensorSpec& t = m.tensors[d.tensor];
    const uint64_t eb = t.fp8_blocks ? 1 : 2, stride = d.row_stride ? d.row_stride : d.box.cols() * eb;
    for (uint64_t i = 0; i < d.box.rows(); i++) {
      const uint8_t* got = &dst[d.rank][d.offset + i * stride];
      const uint64_t at = (d.box.r0 + i) * t.cols + d.box.c0;
      const void* want = t.fp8_blocks ? static_cast<const void*>(&q[d.tensor][at]) : &model.full[d.tensor][at];
      ASSERT_EQ(std::memcmp(got, want, d.box.cols() * eb), 0) << t.name << " row " << d.box.r0 + i << " on rank " << d.rank;
    }
  }
  for (const Placement& d : m.dest_scales) {
    const uint64_t sc = fp8::scale_cols(m.tensors[d.tensor].cols);
    for (uint64_t i = 0; i < d.box.rows(); i++)
      ASSERT_EQ(std::memcmp(&dst[d.rank][d.offset + i * d.box.cols() * 4], &s[d.tensor][(d.box.r0 + i) * sc + d.box.c0],
                            d.box.cols() * 4),
                0)
          << m.tensors[d.tensor].name << " scales on rank " << d.rank;
  }
}

uint16_t random_bf16(std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 0.05f);
  float f = normal(rng);
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return static_cast<uint16_t>(bits >> 16);
}

// `replicas` data-parallel copies of `fsdp` ranks each, rows split evenly (not block-aligned);
// each inference rank takes a column split (128-aligned) of every tensor, or the whole tensor
// when it is too narrow; FP8 pieces get their scales placed after them.
Model random_model(uint32_t seed) {
  std::mt19937 rng(seed);
  auto pick = [&](uint64_t lo, uint64_t hi) { return std::uniform_int_distribution<uint64_t>(lo, hi)(rng); };
  Model model;
  Manifest& m = model.m;
  const uint32_t replicas = static_cast<uint32_t>(pick(1, 2)), fsdp = static_cast<uint32_t>(pick(1, 5));
  m.src_ranks = replicas * fsdp;
  m.dst_ranks = static_cast<uint32_t>(pick(1, 3));
  const uint32_t tensors = static_cast<uint32_t>(pick(1, 6));
  std::vector<uint64_t> src_cursor(m.src_ranks, 0);
  model.dst_size.assign(m.dst_ranks, 0);
  for (uint32_t t = 0; t < tensors; t++) {
    TensorSpec spec{"t" + std::to_string(t), pick(1, 700), pick(1, 600), 2, pick(0, 9) < 7};
    m.tensors.push_back(spec);
    auto& full = model.full.emplace_back(spec.rows * spec.cols);
    for (auto& v : full) v = random_bf16(rng);
    for (uint32_t rep = 0; rep < replicas; rep++)
      for (uint32_t i = 0; i < fsdp; i++) {
        const uint32_t rank = rep * fsdp + i;
        Box box{spec.rows * i / fsdp, spec.rows * (i + 1) / fsdp, 0, spec.cols};
        if (box.empty()) continue;
        const uint64_t stride = spec.cols * 2 + pick(0, 1) * 16;
        m.sources.push_back({.tensor = t, .rank = rank, .box = box, .offset = src_cursor[rank], .row_stride = stride});
        src_cursor[rank] += box.rows() * stride + pick(0, 3) * 2;
      }
    const uint64_t blocks = fp8::scale_cols(spec.cols);
    const bool split = blocks >= m.dst_ranks;
    for (uint32_t d = 0; d < m.dst_ranks; d++) {
      const uint64_t b0 = split ? blocks * d / m.dst_ranks : 0, b1 = split ? blocks * (d + 1) / m.dst_ranks : blocks;
      Box box{0, spec.rows, b0 * 128, std::min(spec.cols, b1 * 128)};
      const uint64_t eb = spec.fp8_blocks ? 1 : 2;
      m.dests.push_back({.tensor = t, .rank = d, .box = box, .offset = model.dst_size[d], .row_stride = 0});
      model.dst_size[d] += box.rows() * box.cols() * eb;
      if (spec.fp8_blocks) {
        Box sbox{0, fp8::scale_rows(spec.rows), b0, b1};
        model.dst_size[d] = (model.dst_size[d] + 3) / 4 * 4;
        m.dest_scales.push_back({.tensor = t, .rank = d, .box = sbox, .offset = model.dst_size[d], .row_stride = 0});
        model.dst_size[d] += sbox.rows() * sbox.cols() * 4;
      }
    }
  }
  return model;
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
