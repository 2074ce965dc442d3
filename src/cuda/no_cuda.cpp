// Builds without CUDA: every GPU-only call says so.
#include "cuda/driver_api.h"
#include "cuda/gpu_signals.h"

namespace fabric {
namespace {
[[noreturn]] void unsupported(const char* what) {
  throw Error(ErrorCode::kUnsupported,
              std::string(what) + ": this fabric-lib was built without CUDA (nvcc not found at "
                                  "configure time); rebuild with the CUDA toolkit installed");
}
}  // namespace

std::unique_ptr<GpuSignals> make_gpu_signals(const EngineConfig&) { unsupported("GPU signals"); }
void gpu_stream_wait(void*, const GpuCounter&, uint64_t) { unsupported("gpu_stream_wait"); }
namespace cuda {
void check_device_range(const void*, size_t, int) { unsupported("reg_mr of CUDA device memory"); }
}  // namespace cuda

}  // namespace fabric
