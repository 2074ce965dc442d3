// CUDA memory of an AllToAll (memory.h): pinned device-mapped host blocks (the RDMA regions and
// the signal words, which the NICs and the proxy reach as host memory), device blocks, and the
// node region as a device allocation its node-mates open by CUDA IPC. All on the current device.
#include <cuda_runtime_api.h>

#include <cstring>
#include <vector>

#include "cuda/cuda_check.h"
#include "memory.h"

namespace fabric::moe::detail {

namespace {

using ::fabric::cuda::check;

// CUDA refuses empty allocations; a block of no bytes still gets a page.
size_t at_least_a_page(size_t len) { return len == 0 ? 4096 : len; }

// cudaMalloc'd and zeroed before anyone can see it: a kernel on any stream, a node-mate.
void* zeroed_device(size_t len) {
  void* p = nullptr;
  check("cudaMalloc", cudaMalloc(&p, len));
  cudaError_t rc = cudaMemset(p, 0, len);
  if (rc == cudaSuccess) rc = cudaStreamSynchronize(nullptr);  // cudaMemset may return before it is done
  if (rc != cudaSuccess) {
    (void)cudaFree(p);
    check("cudaMemset", rc);
  }
  return p;
}

class CudaNodeRegion final : public NodeRegion {
 public:
  explicit CudaNodeRegion(size_t len) : own_(zeroed_device(at_least_a_page(len))) {
    cudaIpcMemHandle_t h;
    const cudaError_t rc = cudaIpcGetMemHandle(&h, own_);
    if (rc != cudaSuccess) {
      (void)cudaFree(own_);
      check("cudaIpcGetMemHandle", rc);
    }
    handle_.resize(sizeof h);
    std::memcpy(handle_.data(), &h, sizeof h);
  }
  ~CudaNodeRegion() override {
    for (void* p : opened_) (void)cudaIpcCloseMemHandle(p);
    (void)cudaFree(own_);
  }
  CudaNodeRegion(const CudaNodeRegion&) = delete;
  CudaNodeRegion& operator=(const CudaNodeRegion&) = delete;

  std::byte* own() const override { return static_cast<std::byte*>(own_); }
  std::vector<std::byte> handle() const override { return handle_; }

  std::byte* open(const std::vector<std::byte>& handle) override {
    if (handle == handle_) return own();  // CUDA cannot open a process's own allocation by IPC
    cudaIpcMemHandle_t h;
    if (handle.size() != sizeof h)
      throw Error(ErrorCode::kMalformed, "MoE: a node-mate's CUDA IPC handle has " + std::to_string(handle.size()) + " bytes, not " +
                                             std::to_string(sizeof h) + " (mixed host and CUDA kernel sides?)");
    std::memcpy(&h, handle.data(), sizeof h);
    void* p = nullptr;
    check("cudaIpcOpenMemHandle (a node-mate's MoE node region: is node_size right, and is every GPU of the node visible to "
          "each rank?)",
          cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess));
    opened_.push_back(p);
    return static_cast<std::byte*>(p);
  }

 private:
  void* own_;
  std::vector<std::byte> handle_;
  std::vector<void*> opened_;
};

}  // namespace

Block pinned_block(size_t len) {
  const size_t bytes = at_least_a_page(len);
  void* host = nullptr;
  check("cudaHostAlloc", cudaHostAlloc(&host, bytes, cudaHostAllocMapped | cudaHostAllocPortable));
  std::memset(host, 0, bytes);
  void* device = nullptr;
  const cudaError_t rc = cudaHostGetDevicePointer(&device, host, 0);
  if (rc != cudaSuccess) {
    (void)cudaFreeHost(host);
    check("cudaHostGetDevicePointer", rc);
  }
  return Block(static_cast<std::byte*>(host), static_cast<std::byte*>(device), len, [host] { (void)cudaFreeHost(host); });
}

Block device_block(size_t len) {
  void* device = zeroed_device(at_least_a_page(len));
  return Block(nullptr, static_cast<std::byte*>(device), len, [device] { (void)cudaFree(device); });
}

std::unique_ptr<NodeRegion> cuda_node_region(size_t len) { return std::make_unique<CudaNodeRegion>(len); }

}  // namespace fabric::moe::detail
