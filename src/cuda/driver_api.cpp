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

void stream_wait_geq(void* stream, const void* device_word, uint64_t value) {
  using Fn = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
  static Fn fn = entry_point<Fn>("cuStreamWaitValue64");
  check_driver("cuStreamWaitValue64", fn(static_cast<CUstream>(stream),
                                         reinterpret_cast<CUdeviceptr>(device_word), value,
                                         CU_STREAM_WAIT_VALUE_GEQ));
}

}  // namespace fabric::cuda
