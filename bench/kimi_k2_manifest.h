// The weight-update manifest of Kimi-K2 (DeepSeek-V3 architecture, about 1.03 T parameters) for
// fabric-weights-plan: training ranks BF16 under FSDP x PP x EP, inference replicas FP8 e4m3 with
// 128 x 128 block scales under EP. Shapes only; no memory behind them.
#pragma once

#include <cstdint>

#include "fabric/weights/plan.h"

namespace fabric::bench {

struct KimiK2Shape {
  uint32_t layers = 61, dense_layers = 1;
  uint64_t hidden = 7168, experts = 384, moe_inter = 2048, dense_inter = 18432, vocab = 163840;
  uint64_t heads = 64, q_lora = 1536, kv_lora = 512, nope = 128, rope = 64, v_head = 128;
};

struct KimiK2Layout {
  uint32_t fsdp = 16, pp = 2, ep = 8;  // training: rank = stage * fsdp * ep + ep_rank * fsdp + fsdp_rank
  uint32_t replicas = 4, replica_ep = 32;  // inference: rank = replica * replica_ep + ep_rank
};

// Training: expert tensors FSDP-sharded along dim 0 within their EP group; every other tensor
// FSDP-sharded the same way in each of the ep groups of its stage (ep replicas). Inference: each
// replica's rank j holds experts [j * E / replica_ep, ...) of every MoE layer whole; other
// tensors are split along dim 0 in 128-row blocks over the replica's ranks (a tensor of fewer
// blocks than ranks goes whole to its replica's least-loaded rank); 1-row norms go to every
// rank. Linear weights are FP8 with scales placed after each piece; embeddings, the output head,
// norms and the router stay BF16.
weights::Manifest kimi_k2_manifest(const KimiK2Shape& shape, const KimiK2Layout& layout);

}  // namespace fabric::bench
