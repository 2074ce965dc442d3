// The one place where providers are chosen. Adding a NIC type means adding a line here.
#include "domain/domain.h"
#include "providers/fault/reordering_domain.h"
#include "providers/libfabric/libfabric_domain.h"

namespace fabric {

std::unique_ptr<Domain> open_domain(const EngineConfig& config, size_t nic_index) {
  std::unique_ptr<Domain> domain = open_libfabric_domain(config, nic_index);
  if (config.reorder.enabled) domain = wrap_reordering(std::move(domain), config.reorder, nic_index);
  return domain;
}

}  // namespace fabric
