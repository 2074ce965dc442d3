// Driver entry points, resolved once through cudaGetDriverEntryPointByVersion.
#include "cuda/driver_api.h"

#include <cuda.h>

#include "cuda/cuda_check.h"

namespace fabric::cuda {
namespace {

template <class Fn>
Fn entry_point(const char* symbol) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  check("cudaGetDriverEntryPointByVersion",
        cudaGetDriverEntryPointByVersion(symbol, &fn, 12000, cudaEnableDefault, &found));
  if (!fn || found != cudaDriverEntryPointSuccess)
    throw Error(ErrorCode::kUnsupported,
                fmt::format("the CUDA driver has no {} (driver too old?)", symbol));
  return reinterpret_cast<Fn>(fn);
}

void check_driver(const char* call, CUresult rc) {
  if (rc != CUDA_SUCCESS)
    throw Error(ErrorCode::kProvider, fmt::format("{} failed: CUresult {}", call, static_cast<int>(rc)));
}

}  // namespace

AddressRange allocation_of(const void* ptr) {
  using Fn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
  static Fn fn = entry_point<Fn>("cuMemGetAddressRange");
  CUdeviceptr base = 0;
  size_t size = 0;
  check_driver("cuMemGetAddressRange", fn(&base, &size, reinterpret_cast<CUdeviceptr>(ptr)));
  return {reinterpret_cast<uint8_t*>(base), size};
}

DmaBuf dmabuf_of(const void* ptr, size_t len) {
  using Fn = CUresult (*)(void*, CUdeviceptr, size_t, CUmemRangeHandleType, unsigned long long);
  static Fn fn = entry_point<Fn>("cuMemGetHandleForAddressRange");
  constexpr uint64_t kPage = 4096;  // dma-buf export wants host-page-aligned ranges
  auto addr = reinterpret_cast<uint64_t>(ptr);
  uint64_t start = addr & ~(kPage - 1), end = (addr + len + kPage - 1) & ~(kPage - 1);
  int fd = -1;
  check_driver("cuMemGetHandleForAddressRange",
               fn(&fd, static_cast<CUdeviceptr>(start), end - start,
                  CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0));
  return {fd, addr - start};
}

void stream_wait_geq(void* stream, const void* device_word, uint64_t value) {
  using Fn = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
  static Fn fn = entry_point<Fn>("cuStreamWaitValue64");
  check_driver("cuStreamWaitValue64", fn(static_cast<CUstream>(stream),
                                         reinterpret_cast<CUdeviceptr>(device_word), value,
                                         CU_STREAM_WAIT_VALUE_GEQ));
}

}  // namespace fabric::cuda
