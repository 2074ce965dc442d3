// Builds without CUDA: the CUDA kernel side of the MoE all-to-all and its CUDA memory say so.
#include <string>

#include "fabric/error.h"
#include "kernel_side.h"
#include "memory.h"

namespace fabric::moe::detail {

namespace {
[[noreturn]] void needs_cuda(const char* what) {
  throw Error(ErrorCode::kUnsupported, std::string("MoE ") + what +
                                           " needs a CUDA build (this fabric-lib was built without nvcc); use KernelSide::kHost "
                                           "or rebuild with the CUDA toolkit installed");
}
}  // namespace

Block pinned_block(size_t) { needs_cuda("pinned host memory"); }
Block device_block(size_t) { needs_cuda("device memory"); }
std::unique_ptr<NodeRegion> cuda_node_region(size_t) { needs_cuda("CUDA node region"); }

namespace cuda {
void dispatch_send(const Views&, const DispatchArgs&) { needs_cuda("KernelSide::kCuda dispatch send"); }
void dispatch_recv(const Views&, void*, int64_t*) { needs_cuda("KernelSide::kCuda dispatch receive"); }
void combine_send(const Views&, const CombineArgs&) { needs_cuda("KernelSide::kCuda combine send"); }
void combine_recv(const Views&, const CombineArgs&) { needs_cuda("KernelSide::kCuda combine receive"); }
uint32_t blocks_per_half(uint32_t) { needs_cuda("KernelSide::kCuda"); }
void prepare_kernels(const Dims&) { needs_cuda("KernelSide::kCuda"); }
}  // namespace cuda

}  // namespace fabric::moe::detail
