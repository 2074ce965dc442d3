// Builds without CUDA: the CUDA unit hook says so.
#include "fabric/error.h"
#include "fabric/weights/update.h"

namespace fabric::weights {

UnitHook cuda_unit_hook(std::byte*) {
  throw Error(ErrorCode::kUnsupported,
              "cuda_unit_hook needs a CUDA build (this fabric-lib was built without nvcc); use the torch hook "
              "or rebuild with the CUDA toolkit installed");
}

}  // namespace fabric::weights
