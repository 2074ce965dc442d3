// libfabric provider: one Domain is one fi_domain + RDM endpoint + CQ + AV (one NIC).
// Works with any provider offering FI_EP_RDM, FI_RMA | FI_MSG and remote CQ data: efa in
// production, tcp;ofi_rxm and shm on loopback. Codes for the mr_mode bits the provider returns.
#pragma once

#include <memory>

#include "domain/domain.h"

namespace fabric {

std::unique_ptr<Domain> open_libfabric_domain(const EngineConfig& config, size_t nic_index);

}  // namespace fabric
