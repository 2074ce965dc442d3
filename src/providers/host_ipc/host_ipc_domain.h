// The host_ipc provider: WRITEs to same-host peers in host memory, one copy by the initiator
// (process_vm_writev straight into the peer's registered memory; its CPU does nothing for the
// bytes), with immediates and messages delivered through the peer's shared-memory inboxes.
#pragma once

#include <memory>

#include "domain/domain.h"

namespace fabric {

std::unique_ptr<Domain> open_host_ipc_domain(const EngineConfig& config);

}  // namespace fabric
