// Fault-injecting wrapper around any Domain, for tests and the soak (EngineConfig::faults):
// refused posts, error completions, completions that never come, duplicated and delayed
// immediates, drawn from a seeded generator so that a failing run can be replayed.
#pragma once

#include <memory>

#include "domain/domain.h"

namespace fabric {

std::unique_ptr<Domain> wrap_faults(std::unique_ptr<Domain> inner, const FaultConfig& config,
                                    size_t nic_index);

// For tests: calls into this process's fault domains (posts, polls, closing) after their wedge
// lifted (FaultConfig::wedge_for), the poll that was wedged not counted.
uint64_t fault_calls_after_wedge();

}  // namespace fabric
