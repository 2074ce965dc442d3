// shm Domain: libfabric's shm provider for same-host peers, on the libfabric objects the NIC
// domain shares (libfabric_core.h), with what shm needs of its own: endpoint names carrying the
// pid (shm_names.h), a replaceable sending endpoint with dead-peer recovery (shm_senders.h,
// shm_dead_lock.h) and a board of live keys (shm_key_board.h).
#pragma once

#include <memory>

#include "domain/domain.h"

namespace fabric {

std::unique_ptr<Domain> open_shm_domain(const EngineConfig& config, size_t nic_index);

}  // namespace fabric
