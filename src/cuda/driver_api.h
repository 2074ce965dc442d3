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

// Throws fabric::Error(kInvalidArgument) unless [ptr, ptr + len) lies inside one allocation of
// CUDA device `device` (what reg_mr checks before a NIC or a peer may write there).
void check_device_range(const void* ptr, size_t len, int device);

// A dma-buf file descriptor for the pages under [ptr, ptr + len) (cuMemGetHandleForAddressRange),
// for NIC registration without nvidia-peermem. The range is widened to whole pages; `offset` is
// where ptr lies inside it. The caller closes the descriptor. Throws fabric::Error.
struct DmaBuf {
  int fd = -1;
  uint64_t offset = 0;
};
DmaBuf dmabuf_of(const void* ptr, size_t len);

// How writes that a NIC makes into a device's memory (GPUDirect RDMA) become visible to work on
// that device. Read once per device.
struct RemoteWriteOrdering {
  bool stream_flush = false;  // CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES: CU_STREAM_WAIT_VALUE_FLUSH
  int ordering = 0;       // CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING: 0 none, 100 owner, 200 all
  int flush_options = 0;  // CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS: 1 host, 2 memops
};
RemoteWriteOrdering remote_write_ordering(int device);

// The device whose context `stream` belongs to (the current device for the default stream).
int device_of_stream(void* stream);

// The flags stream_wait_geq passes for a stream of `device`: GEQ, with CU_STREAM_WAIT_VALUE_FLUSH
// where the device supports it, so that remote writes that reached the device before the word
// did are visible to the work released by the wait.
unsigned stream_wait_flags(int device);

// Makes `stream` wait until the 64-bit word at `device_word` is >= value (cuStreamWaitValue64,
// with the flags above).
void stream_wait_geq(void* stream, const void* device_word, uint64_t value);

// For a host thread that has seen a NIC's completion of writes into `device`'s memory, before it
// lets GPU work consume them: cuFlushGPUDirectRDMAWrites(to owner) where the device does not
// order such writes itself and supports the host flush. Returns whether it flushed.
bool flush_remote_writes(int device);

}  // namespace fabric::cuda
