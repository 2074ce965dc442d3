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

// Makes `stream` wait until the 64-bit word at `device_word` is >= value (cuStreamWaitValue64).
void stream_wait_geq(void* stream, const void* device_word, uint64_t value);

}  // namespace fabric::cuda
