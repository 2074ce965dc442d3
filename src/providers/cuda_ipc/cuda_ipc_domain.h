// The cuda_ipc provider: WRITEs to GPU peers on the same host, executed by the GPU (copy engines
// for large writes, one gather kernel per batch of small ones) through CUDA IPC mappings, with
// immediates and messages delivered through the peer's shared-memory inboxes.
#pragma once

#include <memory>

#include "domain/domain.h"

namespace fabric {

std::unique_ptr<Domain> open_cuda_ipc_domain(const EngineConfig& config);

}  // namespace fabric
