// The CUDA block quantization behind cuda_unit_hook (gpu_quantize.cu): plain types only, so the
// C++20 hook (cuda_hook.cpp) and the C++17 kernel file share it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fabric::weights::gpu {

// rows x cols BF16 at `in` (row i at in + i * in_stride bytes) into e4m3 rows packed at `out`
// (cols bytes each) and row-major ceil(rows/128) x ceil(cols/128) fp32 scales: the arithmetic of
// fp8::quantize_blocks, bit for bit.
struct QuantizeLaunch {
  const void* in = nullptr;
  uint64_t in_stride = 0;
  uint64_t rows = 0, cols = 0;
  void* out = nullptr;
  float* scales = nullptr;
};
cudaError_t launch_quantize(const QuantizeLaunch& q, cudaStream_t stream);

}  // namespace fabric::weights::gpu
