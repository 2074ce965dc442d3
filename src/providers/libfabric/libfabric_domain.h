// libfabric provider: one Domain is one fi_domain + RDM endpoint + CQ + AV (one NIC).
// Works with any provider offering FI_EP_RDM, FI_RMA | FI_MSG and remote CQ data: efa in
// production, tcp;ofi_rxm on loopback (shm has a Domain of its own on the same libfabric objects,
// shm_domain.h). Codes for the mr_mode bits the provider returns; WRITEs longer than the
// provider's max_msg_size are split into several operations.
#pragma once

#include <memory>

#include "domain/domain.h"

struct fid_fabric;
struct fid_domain;
struct fi_info;

namespace fabric {

struct ProviderAttrs;

// What a shim below the domain's fi_* calls changes (efa-sim, a test provider: the factory passes
// efa_sim::libfabric_hook(), so this provider knows no test provider). Null: plain libfabric.
struct LibfabricHook {
  const char* name;        // the provider the domain reports (caps, logs, errors)
  const char* underlying;  // the libfabric provider fi_getinfo is asked for
  const char* hmem_note;   // logged when `underlying` offers no FI_HMEM
  // Rewrites the attributes fi_getinfo returned; the domain runs on the result.
  void (*present)(ProviderAttrs& attrs, bool hmem_wanted);
  // Replaces fi_domain (same contract).
  int (*open_domain)(fid_fabric* fabric, fi_info* info, fid_domain** domain);
};

std::unique_ptr<Domain> open_libfabric_domain(const EngineConfig& config, size_t nic_index,
                                              const LibfabricHook* hook = nullptr);

}  // namespace fabric
