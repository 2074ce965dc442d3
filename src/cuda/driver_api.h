// The few CUDA driver calls the library needs, reached through the runtime's entry-point query so
// that nothing links libcuda: a CUDA build still loads on machines without a GPU driver.
#pragma once

#include <cstddef>
#include <cstdint>

namespace fabric::cuda {

struct AddressRange {
  uint8_t* base = nullptr;
  size_t size = 0;
};

// The allocation that contains `ptr` (cuMemGetAddressRange). Throws fabric::Error.
AddressRange allocation_of(const void* ptr);

// A dma-buf file descriptor for the pages under [ptr, ptr + len) (cuMemGetHandleForAddressRange),
// for NIC registration without nvidia-peermem. The range is widened to whole pages; `offset` is
// where ptr lies inside it. The caller closes the descriptor. Throws fabric::Error.
struct DmaBuf {
  int fd = -1;
  uint64_t offset = 0;
};
DmaBuf dmabuf_of(const void* ptr, size_t len);

// Makes `stream` wait until the 64-bit word at `device_word` is >= value (cuStreamWaitValue64).
void stream_wait_geq(void* stream, const void* device_word, uint64_t value);

}  // namespace fabric::cuda
