// cuda_unit_hook (include/fabric/weights/update.h): a unit's local copies (cudaMemcpy2DAsync) and
// its block quantization (one kernel launch, gpu_quantize.cu) on a stream of the hook's own, on
// the arena's device, then one synchronisation: the unit's send WRITEs read the bytes as soon as
// the hook returns. The caller's current device is put back after each unit.
#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <memory>

#include "cuda/cuda_check.h"
#include "fabric/error.h"
#include "fabric/weights/update.h"
#include "weights/gpu_quantize.h"

namespace fabric::weights {
namespace {

// The arena's device current for one unit, then the caller's again.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    cuda::check("cudaGetDevice", cudaGetDevice(&previous_));
    if (previous_ != device) cuda::use_device(device);
  }
  ~DeviceScope() { cudaSetDevice(previous_); }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = 0;
};

struct HookStream {
  int device = 0;
  cudaStream_t stream = nullptr;
  ~HookStream() {
    if (stream) cudaStreamDestroy(stream);
  }
};

void run_unit(std::byte* arena, const HookStream& hs, const UnitWork& w) {
  DeviceScope scope(hs.device);
  for (const Copy& c : w.local_copies) {
    // A single row may come with any stride; cudaMemcpy2D wants pitches of at least a row.
    const uint64_t sp = c.rows == 1 ? c.row_bytes : c.src_stride, dp = c.rows == 1 ? c.row_bytes : c.dst_stride;
    cuda::check("cudaMemcpy2DAsync", cudaMemcpy2DAsync(arena + c.dst_offset, dp, arena + c.src_offset, sp, c.row_bytes,
                                                       c.rows, cudaMemcpyDeviceToDevice, hs.stream));
  }
  const QuantizeTask& q = w.task;
  cuda::check("the FP8 block-quantization launch",
              gpu::launch_quantize({.in = arena + q.in_offset,
                                    .in_stride = q.in_stride,
                                    .rows = q.r1 - q.r0,
                                    .cols = w.cols,
                                    .out = arena + q.out_offset,
                                    .scales = reinterpret_cast<float*>(arena + q.scale_offset)},
                                   hs.stream));
  cuda::check("cudaStreamSynchronize (a unit's copies and quantization)", cudaStreamSynchronize(hs.stream));
}

}  // namespace

UnitHook cuda_unit_hook(std::byte* arena) {
  cudaPointerAttributes attr{};
  cuda::check("cudaPointerGetAttributes", cudaPointerGetAttributes(&attr, arena));
  if (attr.type != cudaMemoryTypeDevice)
    throw Error(ErrorCode::kInvalidArgument,
                "cuda_unit_hook: the arena is not CUDA device memory (host arenas take the default hook)");
  auto hs = std::make_shared<HookStream>();
  hs->device = attr.device;
  {
    DeviceScope scope(hs->device);
    cuda::check("cudaStreamCreateWithFlags", cudaStreamCreateWithFlags(&hs->stream, cudaStreamNonBlocking));
  }
  return [arena, hs](const UnitWork& w) { run_unit(arena, *hs, w); };
}

}  // namespace fabric::weights
