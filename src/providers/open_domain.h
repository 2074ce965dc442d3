// The provider factory: the one place where a provider is chosen (open_domain.cpp). The layers
// above (the worker's DomainGroup, tests that drive a Domain) include this header and no other
// provider header; adding a NIC type means adding a folder here and a line in open_domain.cpp.
#pragma once

#include <cstddef>
#include <memory>

#include "domain/domain.h"
#include "fabric/config.h"
#include "providers/fault/fault_domain.h"  // injected_faults: the test wrappers' counts

namespace fabric {

// NIC `nic_index` of the configured provider (wrapped for fault injection where configured).
std::unique_ptr<Domain> open_domain(const EngineConfig& config, size_t nic_index);
// The local domain for same-host peers: cuda_ipc (GPU memory) or host_ipc (host memory), as the
// configuration asks. Its address is "<host scope>/<endpoint>" (local_scope, domain.h).
std::unique_ptr<Domain> open_local_domain(const EngineConfig& config);

}  // namespace fabric
