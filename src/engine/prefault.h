// Prefault of host memory before registration (MrRequest::prefault): every page populated
// writable, contents kept, spread over several threads because the kernel populates one
// thread's pages at a few GB/s at best, and registrations of tens of GB are common.
#pragma once

#include <cstddef>
#include <optional>
#include <span>
#include <utility>

#include "fabric/error.h"

namespace fabric {

struct HostRange {
  void* ptr = nullptr;
  size_t len = 0;
  size_t entry = 0;  // which entry of the caller's list, for its error
};

// Populates every range (MADV_POPULATE_WRITE) in pieces of 256 MiB taken by up to min(cores, 8)
// threads. On failure: the first failing range's entry and a kInvalidArgument error, `what`
// naming the call; pieces not yet taken are left.
std::optional<std::pair<size_t, Error>> prefault_host(std::span<const HostRange> ranges, const char* what);

}  // namespace fabric
