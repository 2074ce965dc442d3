// libfabric provider: one Domain is one fi_domain + RDM endpoint + CQ + AV (one NIC).
// Works with any provider offering FI_EP_RDM, FI_RMA | FI_MSG and remote CQ data: efa in
// production, tcp;ofi_rxm and shm on loopback. Codes for the mr_mode bits the provider returns;
// WRITEs longer than the provider's max_msg_size are split into several operations.
#pragma once

#include <memory>

#include "domain/domain.h"

namespace fabric {

std::unique_ptr<Domain> open_libfabric_domain(const EngineConfig& config, size_t nic_index);
// The same domain on tcp;ofi_rxm made to behave as EFA (provider "efa-sim", for tests; see
// src/providers/efa_sim/efa_sim.h).
std::unique_ptr<Domain> open_efa_sim_domain(const EngineConfig& config, size_t nic_index);

}  // namespace fabric
