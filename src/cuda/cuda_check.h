// CUDA runtime return codes become fabric::Error here, naming the call that failed.
#pragma once

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include "fabric/error.h"

namespace fabric::cuda {

inline void check(const char* call, cudaError_t rc) {
  if (rc != cudaSuccess) {
    cudaGetLastError();  // clear a non-sticky error so the next call starts clean
    throw Error(ErrorCode::kProvider,
                fmt::format("{} failed: {} ({})", call, cudaGetErrorString(rc), static_cast<int>(rc)));
  }
}

// Makes `device` current on the calling thread (each engine thread works on its engine's GPU).
inline void use_device(int device) { check("cudaSetDevice", cudaSetDevice(device)); }

}  // namespace fabric::cuda
