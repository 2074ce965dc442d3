// reg_mr's check that the memory it is given exists: a region longer than its allocation would let a
// peer's WRITE land past the end (a crash inside the provider, or another object's bytes).
#pragma once

#include <cstddef>

#include "fabric/types.h"

namespace fabric {

// Throws Error(kInvalidArgument) naming the first unmapped byte when host memory [ptr, ptr + len)
// is not mapped in full, or when device memory does not lie in one allocation of its device.
void check_mapped(const void* ptr, size_t len, Device device);

}  // namespace fabric
