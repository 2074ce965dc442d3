// Test models for the weight-update suites: random manifests (unaligned FSDP shards, replicas,
// column splits, FP8 and BF16 tensors) with their full BF16 values, and the exact check of every
// inference byte against the block quantization of the full tensors.
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "fabric/weights/fp8.h"
#include "fabric/weights/plan.h"

namespace fabric::weights::testing {

struct Model {
  Manifest m;
  std::vector<std::vector<uint16_t>> full;  // each tensor's BF16 values, row-major
  std::vector<uint64_t> dst_size;           // bytes per inference rank
};

// Every inference byte against the quantization of the full tensors.
inline void expect_exact(const Model& model, const std::vector<std::vector<uint8_t>>& dst) {
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

inline uint16_t random_bf16(std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 0.05f);
  float f = normal(rng);
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return static_cast<uint16_t>(bits >> 16);
}

// `replicas` data-parallel copies of `fsdp` ranks each, rows split evenly (not block-aligned);
// each inference rank takes a column split (128-aligned) of every tensor, or the whole tensor
// when it is too narrow; FP8 pieces get their scales placed after them.
inline Model random_model(uint32_t seed) {
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

}  // namespace fabric::weights::testing
