// FP8 e4m3 with 128 x 128 block scales, the format inference engines load quantized weights in
// (DeepSeek-V3 / Kimi-K2 checkpoints, vLLM and SGLang block-FP8 linear layers). The RL weight
// update quantizes on the training side, so inference ranks receive their final bytes and need no
// pass of their own.
//
// e4m3 here is OCP "e4m3fn" (torch.float8_e4m3fn): 1 sign, 4 exponent (bias 7), 3 mantissa bits,
// no infinities, largest finite 448, one NaN pattern per sign (0x7F / 0xFF).
#pragma once

#include <bit>
#include <cstdint>
#include <span>

namespace fabric::fp8 {

inline constexpr float kE4m3Max = 448.0f;
inline constexpr uint64_t kBlock = 128;

// Round to nearest, ties to even; values beyond +-448 saturate to +-448 (torch's cast gives NaN
// from 464 up; block scaling keeps values within 448, so both agree on what quantize produces).
// NaN stays NaN.
uint8_t to_e4m3(float x);
float from_e4m3(uint8_t b);

inline float from_bf16(uint16_t b) { return std::bit_cast<float>(uint32_t{b} << 16); }

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
