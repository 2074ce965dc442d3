// Driver entry points, resolved once through cudaGetDriverEntryPointByVersion.
#include "cuda/driver_api.h"

#include <cuda.h>

#include <map>
#include <mutex>

#include "cuda/cuda_check.h"
#include "util/log.h"

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

void check_device_range(const void* ptr, size_t len, int device) {
  using RangeFn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
  using AttrFn = CUresult (*)(void*, CUpointer_attribute, CUdeviceptr);
  static RangeFn range_fn = entry_point<RangeFn>("cuMemGetAddressRange");
  static AttrFn attr_fn = entry_point<AttrFn>("cuPointerGetAttribute");
  const auto p = reinterpret_cast<CUdeviceptr>(ptr);
  CUdeviceptr base = 0;
  size_t size = 0;
  int ordinal = -1;
  if (range_fn(&base, &size, p) != CUDA_SUCCESS ||
      attr_fn(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, p) != CUDA_SUCCESS)
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("reg_mr: {} is not CUDA device memory: register host memory with "
                            "Device::host(), device memory with the device it was allocated on",
                            ptr));
  if (ordinal != device)
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("reg_mr: {} is memory of CUDA device {}, not of device {}", ptr, ordinal,
                            device));
  const uint64_t end = static_cast<uint64_t>(p - base) + len;
  if (end > size)
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("reg_mr: [{}, +{}) runs {} bytes past the end of its CUDA allocation "
                            "({} bytes at {:#x}): pass the length of the tensor, not more",
                            ptr, len, end - size, size, static_cast<uint64_t>(base)));
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

int device_of_stream(void* stream) {
  using GetCtx = CUresult (*)(CUstream, CUcontext*);
  using Push = CUresult (*)(CUcontext);
  using Pop = CUresult (*)(CUcontext*);
  using GetDevice = CUresult (*)(CUdevice*);
  static GetCtx get_ctx = entry_point<GetCtx>("cuStreamGetCtx");
  static Push push = entry_point<Push>("cuCtxPushCurrent");
  static Pop pop = entry_point<Pop>("cuCtxPopCurrent");
  static GetDevice get_device = entry_point<GetDevice>("cuCtxGetDevice");
  CUcontext ctx = nullptr;
  CUdevice dev = 0;
  if (get_ctx(static_cast<CUstream>(stream), &ctx) == CUDA_SUCCESS && ctx &&
      push(ctx) == CUDA_SUCCESS) {
    CUresult rc = get_device(&dev);
    pop(&ctx);
    if (rc == CUDA_SUCCESS) return static_cast<int>(dev);
  }
  int current = 0;  // the default stream without a current context: the runtime's device
  check("cudaGetDevice", cudaGetDevice(&current));
  return current;
}

RemoteWriteOrdering remote_write_ordering(int device) {
  static std::mutex mu;
  static std::map<int, RemoteWriteOrdering> known;
  std::lock_guard lock(mu);
  if (auto it = known.find(device); it != known.end()) return it->second;
  using Fn = CUresult (*)(int*, CUdevice_attribute, CUdevice);
  static Fn fn = entry_point<Fn>("cuDeviceGetAttribute");
  auto attribute = [&](CUdevice_attribute a) {
    int v = 0;
    return fn(&v, a, static_cast<CUdevice>(device)) == CUDA_SUCCESS ? v : 0;  // unknown: none
  };
  RemoteWriteOrdering r;
  r.stream_flush = attribute(CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES) != 0;
  r.ordering = attribute(CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING);
  r.flush_options = attribute(CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS);
  if (!r.stream_flush && r.ordering < CU_GPU_DIRECT_RDMA_WRITES_ORDERING_OWNER)
    log::warn("CUDA device {} neither flushes remote writes from a stream "
              "(CAN_FLUSH_REMOTE_WRITES 0) nor orders GPUDirect RDMA writes (ordering {}): data "
              "that a NIC wrote into its memory is visible to work behind gpu_stream_wait only "
              "after a host-side cuFlushGPUDirectRDMAWrites (flush options {:#x})",
              device, r.ordering, r.flush_options);
  known.emplace(device, r);
  return r;
}

unsigned stream_wait_flags(int device) {
  unsigned flags = CU_STREAM_WAIT_VALUE_GEQ;
  if (remote_write_ordering(device).stream_flush) flags |= CU_STREAM_WAIT_VALUE_FLUSH;
  return flags;
}

void stream_wait_geq(void* stream, const void* device_word, uint64_t value) {
  using Fn = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
  static Fn fn = entry_point<Fn>("cuStreamWaitValue64");
  unsigned flags = stream_wait_flags(device_of_stream(stream));
  check_driver("cuStreamWaitValue64", fn(static_cast<CUstream>(stream),
                                         reinterpret_cast<CUdeviceptr>(device_word), value, flags));
}

bool flush_remote_writes(int device) {
  RemoteWriteOrdering r = remote_write_ordering(device);
  if (r.ordering >= CU_GPU_DIRECT_RDMA_WRITES_ORDERING_OWNER ||
      !(r.flush_options & CU_FLUSH_GPU_DIRECT_RDMA_WRITES_OPTION_HOST))
    return false;  // nothing to flush, or no way to
  using Fn = CUresult (*)(CUflushGPUDirectRDMAWritesTarget, CUflushGPUDirectRDMAWritesScope);
  static Fn fn = entry_point<Fn>("cuFlushGPUDirectRDMAWrites");
  use_device(device);
  check_driver("cuFlushGPUDirectRDMAWrites",
               fn(CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX,
                  CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER));
  return true;
}

}  // namespace fabric::cuda
