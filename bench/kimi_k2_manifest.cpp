// Kimi-K2's tensors on both sides of a weight update (bench/kimi_k2_manifest.h).
#include "kimi_k2_manifest.h"

#include <algorithm>
#include <initializer_list>
#include <string>
#include <vector>

#include "fabric/weights/fp8.h"

namespace fabric::bench {

namespace {

using weights::Box;
using weights::Manifest;
using weights::Placement;
using weights::TensorSpec;

struct Builder {
  const KimiK2Layout& layout;
  Manifest m;
  std::vector<uint64_t> src_cursor, dst_cursor;

  explicit Builder(const KimiK2Layout& l) : layout(l) {
    m.src_ranks = l.fsdp * l.pp * l.ep;
    m.dst_ranks = l.replicas * l.replica_ep;
    src_cursor.assign(m.src_ranks, 0);
    dst_cursor.assign(m.dst_ranks, 0);
  }

  uint32_t add_tensor(std::string name, uint64_t rows, uint64_t cols, bool fp8) {
    m.tensors.push_back({std::move(name), rows, cols, 2, fp8});
    return static_cast<uint32_t>(m.tensors.size() - 1);
  }

  // Rows split evenly over the FSDP ranks of (stage, ep_rank).
  void hold(uint32_t t, uint32_t stage, uint32_t ep_rank) {
    const TensorSpec& spec = m.tensors[t];
    for (uint32_t f = 0; f < layout.fsdp; f++) {
      Box box{spec.rows * f / layout.fsdp, spec.rows * (f + 1) / layout.fsdp, 0, spec.cols};
      if (box.empty()) continue;
      const uint32_t rank = stage * layout.fsdp * layout.ep + ep_rank * layout.fsdp + f;
      m.sources.push_back({.tensor = t, .rank = rank, .box = box, .offset = src_cursor[rank], .row_stride = 0});
      src_cursor[rank] += box.rows() * box.cols() * 2;
    }
  }

  void need(uint32_t t, uint32_t rank, Box box) {
    const TensorSpec& spec = m.tensors[t];
    m.dests.push_back({.tensor = t, .rank = rank, .box = box, .offset = dst_cursor[rank], .row_stride = 0});
    dst_cursor[rank] += box.rows() * box.cols() * (spec.fp8_blocks ? 1 : 2);
    if (!spec.fp8_blocks) return;
    dst_cursor[rank] = (dst_cursor[rank] + 15) / 16 * 16;
    Box scales{box.r0 / fp8::kBlock, fp8::scale_rows(box.r1), box.c0 / fp8::kBlock, fp8::scale_cols(box.c1)};
    m.dest_scales.push_back({.tensor = t, .rank = rank, .box = scales, .offset = dst_cursor[rank], .row_stride = 0});
    dst_cursor[rank] += scales.rows() * scales.cols() * sizeof(float);
  }

  // A non-expert tensor on the inference side: 128-row blocks over each replica's ranks.
  void spread(uint32_t t) {
    const TensorSpec& spec = m.tensors[t];
    const uint64_t blocks = fp8::scale_rows(spec.rows);
    for (uint32_t rep = 0; rep < layout.replicas; rep++) {
      const uint32_t first = rep * layout.replica_ep;
      if (spec.rows == 1) {
        for (uint32_t j = 0; j < layout.replica_ep; j++) need(t, first + j, {0, 1, 0, spec.cols});
      } else if (blocks >= layout.replica_ep) {
        for (uint32_t j = 0; j < layout.replica_ep; j++) {
          const uint64_t b0 = blocks * j / layout.replica_ep, b1 = blocks * (j + 1) / layout.replica_ep;
          need(t, first + j, {b0 * fp8::kBlock, std::min(spec.rows, b1 * fp8::kBlock), 0, spec.cols});
        }
      } else {
        auto least = std::min_element(dst_cursor.begin() + first, dst_cursor.begin() + first + layout.replica_ep);
        need(t, static_cast<uint32_t>(least - dst_cursor.begin()), {0, spec.rows, 0, spec.cols});
      }
    }
  }

  void dense(const std::string& name, uint64_t rows, uint64_t cols, bool fp8, uint32_t stage) {
    const uint32_t t = add_tensor(name, rows, cols, fp8);
    for (uint32_t e = 0; e < layout.ep; e++) hold(t, stage, e);
    spread(t);
  }
};

}  // namespace

Manifest kimi_k2_manifest(const KimiK2Shape& s, const KimiK2Layout& layout) {
  Builder b(layout);
  const uint32_t per_stage = (s.layers + layout.pp - 1) / layout.pp;
  const uint64_t experts_per_ep = s.experts / layout.ep, experts_per_dst = s.experts / layout.replica_ep;
  b.dense("embed_tokens", s.vocab, s.hidden, false, 0);
  for (uint32_t l = 0; l < s.layers; l++) {
    const uint32_t stage = l / per_stage;
    const std::string p = "layers." + std::to_string(l) + ".";
    b.dense(p + "input_layernorm", 1, s.hidden, false, stage);
    b.dense(p + "q_a_proj", s.q_lora, s.hidden, true, stage);
    b.dense(p + "q_a_layernorm", 1, s.q_lora, false, stage);
    b.dense(p + "q_b_proj", s.heads * (s.nope + s.rope), s.q_lora, true, stage);
    b.dense(p + "kv_a_proj_with_mqa", s.kv_lora + s.rope, s.hidden, true, stage);
    b.dense(p + "kv_a_layernorm", 1, s.kv_lora, false, stage);
    b.dense(p + "kv_b_proj", s.heads * (s.nope + s.v_head), s.kv_lora, true, stage);
    b.dense(p + "o_proj", s.hidden, s.heads * s.v_head, true, stage);
    b.dense(p + "post_attention_layernorm", 1, s.hidden, false, stage);
    if (l < s.dense_layers) {
      b.dense(p + "mlp.gate_proj", s.dense_inter, s.hidden, true, stage);
      b.dense(p + "mlp.up_proj", s.dense_inter, s.hidden, true, stage);
      b.dense(p + "mlp.down_proj", s.hidden, s.dense_inter, true, stage);
      continue;
    }
    b.dense(p + "mlp.gate", s.experts, s.hidden, false, stage);
    b.dense(p + "mlp.shared_experts.gate_proj", s.moe_inter, s.hidden, true, stage);
    b.dense(p + "mlp.shared_experts.up_proj", s.moe_inter, s.hidden, true, stage);
    b.dense(p + "mlp.shared_experts.down_proj", s.hidden, s.moe_inter, true, stage);
    for (uint64_t e = 0; e < s.experts; e++) {
      const std::string q = p + "mlp.experts." + std::to_string(e) + ".";
      const uint32_t ep_rank = static_cast<uint32_t>(e / experts_per_ep);
      const uint32_t dst_j = static_cast<uint32_t>(e / experts_per_dst);
      struct Proj {
        const char* name;
        uint64_t rows, cols;
      };
      for (const Proj& proj : {Proj{"gate_proj", s.moe_inter, s.hidden}, Proj{"up_proj", s.moe_inter, s.hidden},
                               Proj{"down_proj", s.hidden, s.moe_inter}}) {
        const uint64_t rows = proj.rows, cols = proj.cols;
        const char* name = proj.name;
        const uint32_t t = b.add_tensor(q + name, rows, cols, true);
        b.hold(t, stage, ep_rank);
        for (uint32_t rep = 0; rep < layout.replicas; rep++) b.need(t, rep * layout.replica_ep + dst_j, {0, rows, 0, cols});
      }
    }
  }
  b.dense("norm", 1, s.hidden, false, layout.pp - 1);
  b.dense("lm_head", s.vocab, s.hidden, false, layout.pp - 1);
  return std::move(b.m);
}

}  // namespace fabric::bench
