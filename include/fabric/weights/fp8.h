// FP8 e4m3 with 128 x 128 block scales, the format inference engines load quantized weights in
// (DeepSeek-V3 / Kimi-K2 checkpoints, vLLM and SGLang block-FP8 linear layers). The RL weight
// update quantizes on the training side, so inference ranks receive their final bytes and need no
// pass of their own.
//
// The e4m3 format and its conversion are in fabric/e4m3.h.
#pragma once

#include <cstdint>
#include <span>

#include "fabric/e4m3.h"

namespace fabric::fp8 {

inline constexpr uint64_t kBlock = 128;

// A rows x cols BF16 matrix (row i at in + i * in_stride elements) quantized block by block:
// scale = amax / 448 over each 128 x 128 block (1 for a block of zeros), out = e4m3(x / scale).
// `out` is rows x cols bytes at out_stride bytes per row; `scales` is row-major
// ceil(rows / 128) x ceil(cols / 128) floats (what engines call weight_scale_inv: x ~ out * scale).
// Edge blocks are partial. Throws fabric::Error(kInvalidArgument) when a span is too small.
struct QuantizeRequest {
  std::span<const uint16_t> in;
  uint64_t rows = 0, cols = 0;
  uint64_t in_stride = 0;  // elements; 0: cols
  std::span<uint8_t> out;
  uint64_t out_stride = 0;  // bytes; 0: cols
  std::span<float> scales;
};
void quantize_blocks(const QuantizeRequest& r);

inline uint64_t scale_rows(uint64_t rows) { return (rows + kBlock - 1) / kBlock; }
inline uint64_t scale_cols(uint64_t cols) { return (cols + kBlock - 1) / kBlock; }

}  // namespace fabric::fp8
