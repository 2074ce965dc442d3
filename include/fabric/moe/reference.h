// A plain CPU reference of MoE dispatch and combine (include/fabric/moe/all_to_all.h), computed from every
// rank's inputs at once with none of the protocol's machinery: the oracle the tests check the
// AllToAll against, byte for byte.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "fabric/moe/types.h"

namespace fabric::moe {

// One rank's dispatch input, laid out as DispatchArgs says.
struct ReferenceInput {
  uint32_t num_tokens = 0;
  std::vector<std::byte> x;      // [num_tokens][payload bytes of the dispatch dtype]
  std::vector<float> x_scales;   // [num_tokens][hidden / 128] (FP8)
  std::vector<int64_t> topk_idx;  // [num_tokens][topk]
  std::vector<float> topk_weights;
};

// What one rank's dispatch output holds, in DispatchOutput's layout; rows past counts[e] are zero.
struct ReferenceDispatch {
  std::vector<int32_t> counts;  // [local_experts]
  std::vector<std::byte> x;     // [local_experts][rows_per_expert][payload bytes]
  std::vector<float> scales;    // [local_experts][rows_per_expert][hidden / 128] (FP8)
  std::vector<int32_t> src;     // [local_experts][rows_per_expert], -1 past counts[e]
};

// Every rank's dispatch output, from every rank's input (inputs[r] is rank r's).
std::vector<ReferenceDispatch> reference_dispatch(const AllToAllConfig& config, std::span<const ReferenceInput> inputs);

// Rank `rank`'s combine output [num_tokens][hidden] BF16, given every rank's expert output
// ([local_experts][rows_per_expert][hidden] BF16, rows as reference_dispatch placed them).
std::vector<uint16_t> reference_combine(const AllToAllConfig& config, std::span<const ReferenceInput> inputs, uint32_t rank,
                                        std::span<const std::vector<uint16_t>> expert_out);

}  // namespace fabric::moe
