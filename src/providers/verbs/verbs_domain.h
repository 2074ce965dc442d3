// The verbs provider (libibverbs: ConnectX and other RC NICs, Soft-RoCE). See verbs_domain.cpp.
#pragma once

#include <memory>

#include "domain/domain.h"

namespace fabric {

// NIC `nic_index` of `config` (NicConfig::domain names the device) as a Domain.
std::unique_ptr<Domain> open_verbs_domain(const EngineConfig& config, size_t nic_index);

}  // namespace fabric
