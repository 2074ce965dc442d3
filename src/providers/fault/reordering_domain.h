// Fault-injecting wrapper around any Domain, for tests: holds completions and immediates back for a
// random number of polls and releases them in random order (seeded, reproducible). The loopback
// providers deliver in order; this proves that nothing above the Domain depends on order.
#pragma once

#include <memory>

#include "domain/domain.h"

namespace fabric {

std::unique_ptr<Domain> wrap_reordering(std::unique_ptr<Domain> inner, const ReorderConfig& config,
                                        size_t nic_index);

}  // namespace fabric
