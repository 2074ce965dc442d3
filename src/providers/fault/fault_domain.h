// Fault-injecting wrapper around any Domain, for tests and the soak (EngineConfig::faults):
// refused posts, error completions, completions that never come, duplicated and delayed
// immediates, drawn from a seeded generator so that a failing run can be replayed.
#pragma once

#include <cstdint>
#include <memory>

#include "domain/domain.h"

namespace fabric {

std::unique_ptr<Domain> wrap_faults(std::unique_ptr<Domain> inner, const FaultConfig& config,
                                    size_t nic_index);

// What the fault wrapper injected into a domain so far; any thread. A test-only count that the
// Domain contract does not carry: the engine reports it in NicStats (injected_faults,
// duplicated_imms) so that a soak can reconcile its failures with the faults it asked for.
struct InjectedFaults {
  uint64_t total = 0;
  uint64_t duplicated_imms = 0;
};
// Looks through the test wrappers around `domain` for a fault wrapper; zeros where there is none
// (every production domain).
InjectedFaults injected_faults(const Domain& domain);

// For tests: calls into this process's fault domains (posts, polls, closing) after their wedge
// lifted (FaultConfig::wedge_for), the poll that was wedged not counted.
uint64_t fault_calls_after_wedge();

}  // namespace fabric
