// libfabric names newer than the headers we may be built against (Debian bookworm ships 1.17),
// with their upstream values, so that the same source serves EFA hosts with a newer libfabric.
#pragma once

#include <rdma/fabric.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>

#include <cstddef>
#include <cstdint>

#define FABRIC_FI_HEADER_VERSION FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION)

namespace fabric::fi_compat {

// FI_OPT_ENDPOINT option names. Upstream declares them as enumerators (invisible to #ifndef), so
// the guard is the headers' version: FI_OPT_CUDA_API_PERMITTED came in 1.18 (value 10),
// FI_OPT_SHARED_MEMORY_PERMITTED in 1.21 (value 11); both take a bool. A libfabric older than
// that answers -FI_ENOPROTOOPT.
#if FABRIC_FI_HEADER_VERSION >= FI_VERSION(1, 18)
inline constexpr int kOptCudaApiPermitted = FI_OPT_CUDA_API_PERMITTED;
#else
inline constexpr int kOptCudaApiPermitted = 10;
#endif
#if FABRIC_FI_HEADER_VERSION >= FI_VERSION(1, 21)
inline constexpr int kOptSharedMemoryPermitted = FI_OPT_SHARED_MEMORY_PERMITTED;
#else
inline constexpr int kOptSharedMemoryPermitted = 11;
#endif

// fi_mr_regattr flag and descriptor for dma-buf registration (libfabric 1.20). FI_MR_DMABUF is a
// macro upstream; struct fi_mr_dmabuf came with it. In fi_mr_attr, `dmabuf` shares a union with
// `mr_iov` (the first member in every version), so a 1.17 fi_mr_attr carries it there.
#ifndef FI_MR_DMABUF
#define FI_MR_DMABUF (1ULL << 40)
struct fi_mr_dmabuf {
  int fd;
  uint64_t offset;  // where the region starts inside the dma-buf
  size_t len;
  void* base_addr;  // virtual address of the dma-buf's start: the region is base_addr + offset
};
#else
using ::fi_mr_dmabuf;
#endif

inline void set_dmabuf(fi_mr_attr& attr, const fi_mr_dmabuf* d) {
#if FABRIC_FI_HEADER_VERSION >= FI_VERSION(1, 20)
  attr.dmabuf = d;
#else
  attr.mr_iov = reinterpret_cast<const iovec*>(d);
#endif
}
inline const fi_mr_dmabuf* get_dmabuf(const fi_mr_attr& attr) {
#if FABRIC_FI_HEADER_VERSION >= FI_VERSION(1, 20)
  return attr.dmabuf;
#else
  return reinterpret_cast<const fi_mr_dmabuf*>(attr.mr_iov);
#endif
}

// The API version the domain asks fi_getinfo for: 1.20 (dma-buf registration) where the headers
// have it, 1.17 otherwise; never newer than the headers (libfabric fills structures, such as
// fi_cq_err_entry, to the layout of the version asked for) nor than the library at run time.
inline constexpr uint32_t kWantedApi =
    FABRIC_FI_HEADER_VERSION >= FI_VERSION(1, 20) ? FI_VERSION(1, 20) : FI_VERSION(1, 17);
inline constexpr uint32_t kDmabufApi = FI_VERSION(1, 20);

}  // namespace fabric::fi_compat
