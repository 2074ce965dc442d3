// FP8 e4m3 conversion and 128 x 128 block quantization (include/fabric/weights/fp8.h).
#include "fabric/weights/fp8.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cmath>

#include "fabric/error.h"

namespace fabric::fp8 {

uint8_t to_e4m3(float x) {
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80);
  const float a = std::fabs(x);
  if (std::isnan(a)) return sign | 0x7F;
  if (a >= kE4m3Max) return sign | 0x7E;
  if (a < 0x1p-6f) {
    // Subnormals are multiples of 2^-9: scaling by 2^9 is exact, and nearbyint rounds to nearest
    // even. 8 (a just below 2^-6 rounding up) is the smallest normal's code, 0x08.
    return sign | static_cast<uint8_t>(std::nearbyint(a * 0x1p9f));
  }
  // Normal: keep 3 of the 23 mantissa bits, rounding the 20 dropped ones to nearest even.
  const uint32_t abits = bits & 0x7FFFFFFF;
  int exponent = static_cast<int>(abits >> 23) - 127;  // -6 .. 8
  uint32_t mantissa = (abits >> 20) & 0x7;
  const uint32_t dropped = abits & 0xFFFFF;
  if (dropped > 0x80000 || (dropped == 0x80000 && (mantissa & 1))) mantissa++;
  if (mantissa == 8) {  // rounded up into the next binade
    mantissa = 0;
    exponent++;
  }
  // a < 448 rounds to at most 448 (exponent 8, mantissa 6): never the NaN pattern.
  return sign | static_cast<uint8_t>(((exponent + 7) << 3) | mantissa);
}

float from_e4m3(uint8_t b) {
  const float sign = (b & 0x80) ? -1.0f : 1.0f;
  const int exponent = (b >> 3) & 0xF;
  const int mantissa = b & 0x7;
  if (exponent == 0xF && mantissa == 0x7) return std::nanf("");
  if (exponent == 0) return sign * std::ldexp(static_cast<float>(mantissa), -9);
  return sign * std::ldexp(1.0f + static_cast<float>(mantissa) / 8.0f, exponent - 7);
}

void quantize_blocks(const QuantizeRequest& r) {
  const uint64_t in_stride = r.in_stride ? r.in_stride : r.cols;
  const uint64_t out_stride = r.out_stride ? r.out_stride : r.cols;
  if (r.rows == 0 || r.cols == 0) return;
  if (in_stride < r.cols || out_stride < r.cols)
    throw Error(ErrorCode::kInvalidArgument, "quantize_blocks: a row stride is shorter than a row");
  if (r.in.size() < (r.rows - 1) * in_stride + r.cols)
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("quantize_blocks: {} input elements for {} x {} at stride {}",
                            r.in.size(), r.rows, r.cols, in_stride));
  if (r.out.size() < (r.rows - 1) * out_stride + r.cols)
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("quantize_blocks: {} output bytes for {} x {} at stride {}",
                            r.out.size(), r.rows, r.cols, out_stride));
  const uint64_t brows = scale_rows(r.rows), bcols = scale_cols(r.cols);
  if (r.scales.size() < brows * bcols)
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("quantize_blocks: {} scales for {} x {} blocks", r.scales.size(), brows, bcols));
  for (uint64_t br = 0; br < brows; br++) {
    const uint64_t r0 = br * kBlock, r1 = std::min(r.rows, r0 + kBlock);
    for (uint64_t bc = 0; bc < bcols; bc++) {
      const uint64_t c0 = bc * kBlock, c1 = std::min(r.cols, c0 + kBlock);
      float amax = 0.0f;
      for (uint64_t i = r0; i < r1; i++)
        for (uint64_t j = c0; j < c1; j++) amax = std::max(amax, std::fabs(from_bf16(r.in[i * in_stride + j])));
      const float scale = amax > 0.0f ? amax / kE4m3Max : 1.0f;
      r.scales[br * bcols + bc] = scale;
      for (uint64_t i = r0; i < r1; i++)
        for (uint64_t j = c0; j < c1; j++)
          r.out[i * out_stride + j] = to_e4m3(from_bf16(r.in[i * in_stride + j]) / scale);
    }
  }
}

}  // namespace fabric::fp8
