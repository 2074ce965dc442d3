// The block-quantization kernel (gpu_quantize.h): one CUDA block per 128 x 128 block of the
// matrix. Pass one reads the block's BF16 values for its amax (a warp per row group, a shared
// reduction), pass two reads them again (from L2: 32 KiB per block) and writes e4m3 bytes.
// The arithmetic is fp8.cpp's: scale = amax / 448 rounded to nearest (1 for an all-zero block),
// value = e4m3(x / scale) with the division rounded to nearest and e4m3 rounded to nearest even,
// saturating at 448: fabric/e4m3.h, which host and device code share.
#include <cstdint>

#include "fabric/e4m3.h"
#include "weights/gpu_quantize.h"

namespace fabric::weights::gpu {
namespace {

constexpr int kBlock = 128;
constexpr int kThreads = 256;
using fp8::from_bf16;
using fp8::to_e4m3;

__global__ void __launch_bounds__(kThreads)
    quantize_blocks(const uint8_t* __restrict__ in, uint64_t in_stride, uint64_t rows, uint64_t cols,
                    uint8_t* __restrict__ out, float* __restrict__ scales, uint64_t bcols) {
  const uint64_t br = blockIdx.x / bcols, bc = blockIdx.x % bcols;
  const uint64_t r0 = br * kBlock, c0 = bc * kBlock;
  const uint32_t nr = static_cast<uint32_t>(rows - r0 < kBlock ? rows - r0 : kBlock);
  const uint32_t nc = static_cast<uint32_t>(cols - c0 < kBlock ? cols - c0 : kBlock);
  // Thread t walks column t % 128 of rows t / 128, t / 128 + 2, ...: a warp reads 64 contiguous bytes.
  const uint32_t col = threadIdx.x % kBlock, row0 = threadIdx.x / kBlock;
  constexpr uint32_t kRowStep = kThreads / kBlock;
  auto at = [&](uint32_t r) {
    return reinterpret_cast<const uint16_t*>(in + (r0 + r) * in_stride) + c0 + col;
  };
  float amax = 0.0f;
  if (col < nc)
    for (uint32_t r = row0; r < nr; r += kRowStep) amax = fmaxf(amax, fabsf(from_bf16(*at(r))));
  for (int off = 16; off > 0; off /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, off));
  __shared__ float warp_max[kThreads / 32];
  __shared__ float block_scale;
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = amax;
  __syncthreads();
  if (threadIdx.x == 0) {
    float m = 0.0f;
    for (int w = 0; w < kThreads / 32; w++) m = fmaxf(m, warp_max[w]);
    const float scale = fp8::amax_scale(m);
    block_scale = scale;
    scales[br * bcols + bc] = scale;
  }
  __syncthreads();
  const float scale = block_scale;
  if (col < nc)
    for (uint32_t r = row0; r < nr; r += kRowStep)
      out[(r0 + r) * cols + c0 + col] = to_e4m3(__fdiv_rn(from_bf16(*at(r)), scale));
}

}  // namespace

cudaError_t launch_quantize(const QuantizeLaunch& q, cudaStream_t stream) {
  if (q.rows == 0 || q.cols == 0) return cudaSuccess;
  const uint64_t brows = (q.rows + kBlock - 1) / kBlock, bcols = (q.cols + kBlock - 1) / kBlock;
  const uint64_t blocks = brows * bcols;
  if (blocks > 0x7FFFFFFFull) return cudaErrorInvalidValue;
  quantize_blocks<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      static_cast<const uint8_t*>(q.in), q.in_stride, q.rows, q.cols, static_cast<uint8_t*>(q.out), q.scales, bcols);
  return cudaGetLastError();
}

}  // namespace fabric::weights::gpu
