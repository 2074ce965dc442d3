// The one place where providers are chosen (providers/open_domain.h). Adding a NIC type means
// adding a line here.
#include "providers/open_domain.h"

#include "providers/fault/fault_domain.h"
#include "providers/libfabric/libfabric_domain.h"
#include "providers/libfabric/shm_domain.h"
#ifdef FABRIC_TEST_PROVIDERS
#include "providers/efa_sim/efa_sim.h"
#include "providers/fault/reordering_domain.h"
#endif
#ifdef FABRIC_WITH_VERBS
#include "providers/verbs/verbs_domain.h"
#endif
#include "providers/host_ipc/host_ipc_domain.h"
#ifdef FABRIC_WITH_CUDA
#include "providers/cuda_ipc/cuda_ipc_domain.h"
#endif

namespace fabric {
namespace {

// The test wrappers a configuration asks for, around domain `index`.
std::unique_ptr<Domain> wrap_for_tests(std::unique_ptr<Domain> domain, const EngineConfig& config,
                                       size_t index) {
#ifdef FABRIC_TEST_PROVIDERS
  if (config.faults.enabled) domain = wrap_faults(std::move(domain), config.faults, index);
  if (config.reorder.enabled) domain = wrap_reordering(std::move(domain), config.reorder, index);
#else
  if (config.faults.enabled || config.reorder.enabled)
    throw Error(ErrorCode::kUnsupported,
                std::string("EngineConfig::") + (config.faults.enabled ? "faults" : "reorder") +
                    ": the test wrappers are left out of this build (configure with "
                    "-DFABRIC_TEST_PROVIDERS=ON, as the test builds are)");
  (void)index;
#endif
  return domain;
}

}  // namespace

#ifndef FABRIC_TEST_PROVIDERS
InjectedFaults injected_faults(const Domain&) { return {}; }  // no fault wrapper in this build
#endif

std::unique_ptr<Domain> open_domain(const EngineConfig& config, size_t nic_index) {
  std::unique_ptr<Domain> domain;
  if (config.provider == "verbs") {
#ifdef FABRIC_WITH_VERBS
    domain = open_verbs_domain(config, nic_index);
#else
    throw Error(ErrorCode::kUnsupported,
                "provider 'verbs': this fabric-lib was built without libibverbs (install "
                "libibverbs-dev and reconfigure)");
#endif
  } else if (config.provider == "efa-sim") {
#ifdef FABRIC_TEST_PROVIDERS
    // EFA's attributes over tcp, for tests: the libfabric domain with efa-sim's shim under it.
    domain = open_libfabric_domain(config, nic_index, &efa_sim::libfabric_hook());
#else
    throw Error(ErrorCode::kUnsupported,
                "provider 'efa-sim' is a test provider, left out of this build (configure with "
                "-DFABRIC_TEST_PROVIDERS=ON, as the test builds are)");
#endif
  } else if (config.provider == "shm") {
    domain = open_shm_domain(config, nic_index);
  } else {
    domain = open_libfabric_domain(config, nic_index);
  }
  return wrap_for_tests(std::move(domain), config, nic_index);
}

std::unique_ptr<Domain> open_local_domain(const EngineConfig& config) {
  if (config.host_ipc && config.cuda_ipc)
    throw Error(ErrorCode::kInvalidArgument,
                "EngineConfig: cuda_ipc and host_ipc together (a worker has one local domain: with cuda_ipc, "
                "host memory goes through the NICs)");
  if (config.host_ipc) return wrap_for_tests(open_host_ipc_domain(config), config, kMaxNics);
  if (!config.cuda_device)
    throw Error(ErrorCode::kInvalidArgument,
                "EngineConfig::cuda_ipc needs EngineConfig::cuda_device (the GPU this engine serves)");
#ifdef FABRIC_WITH_CUDA
  return wrap_for_tests(open_cuda_ipc_domain(config), config, kMaxNics);
#else
  throw Error(ErrorCode::kUnsupported,
              "EngineConfig::cuda_ipc: this fabric-lib was built without CUDA (nvcc not found at "
              "configure time); rebuild with the CUDA toolkit installed");
#endif
}

}  // namespace fabric
