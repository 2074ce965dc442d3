// Host memory: mincore(2) fails with ENOMEM on a range that holds an unmapped page, without
// touching (or faulting in) the pages; it is asked in chunks so its vector stays small. Device
// memory: the CUDA driver's allocation of the pointer (cuda/driver_api.h).
#include "engine/mapped_range.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <vector>

#include <fmt/format.h>

#include "cuda/driver_api.h"
#include "fabric/error.h"

namespace fabric {

void check_mapped(const void* ptr, size_t len, Device device) {
  if (device.kind == Device::Kind::kCuda) {
    cuda::check_device_range(ptr, len, device.index);
    return;
  }
  const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const auto start = reinterpret_cast<uintptr_t>(ptr);
  if (len > UINTPTR_MAX - start)
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("reg_mr: [{}, +{}) wraps around the address space", ptr, len));
  const uintptr_t end = start + len;
  constexpr size_t kChunkPages = size_t{1} << 18;  // 1 GiB of 4 KiB pages per call
  std::vector<unsigned char> vec(kChunkPages);
  for (uintptr_t at = start & ~(page - 1); at < end;) {
    const size_t bytes = std::min<uintptr_t>(end - at, kChunkPages * page);
    if (mincore(reinterpret_cast<void*>(at), bytes, vec.data()) != 0) {
      if (errno != ENOMEM) return;  // the kernel cannot tell: let the provider decide
      // Find the first unmapped page of the chunk, to name it.
      uintptr_t hole = at;
      while (hole < at + bytes && mincore(reinterpret_cast<void*>(hole), page, vec.data()) == 0)
        hole += page;
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("reg_mr: [{}, +{}) is not mapped memory in full: the page at {:#x} "
                              "({} bytes in) is unmapped; register only memory you allocated, with "
                              "its real length",
                              ptr, len, hole, hole > start ? hole - start : 0));
    }
    at += bytes;
  }
}

}  // namespace fabric
