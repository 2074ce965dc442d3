// 128 x 128 block quantization (include/fabric/weights/fp8.h).
#include "fabric/weights/fp8.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "fabric/error.h"

namespace fabric::fp8 {

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
      const float scale = amax_scale(amax);
      r.scales[br * bcols + bc] = scale;
      for (uint64_t i = r0; i < r1; i++)
        for (uint64_t j = c0; j < c1; j++)
          r.out[i * out_stride + j] = to_e4m3(from_bf16(r.in[i * in_stride + j]) / scale);
    }
  }
}

}  // namespace fabric::fp8
