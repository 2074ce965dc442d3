// efa-sim: an EFA-like test provider (as UCX's ibmock is for verbs), so that the libfabric
// domain's EFA branches run in CI where there is no EFA device.
//
// EngineConfig::provider = "efa-sim" opens tcp;ofi_rxm underneath, but the libfabric domain sees
// EFA's attributes (present_as_efa) and runs its ordinary code on them: FI_MR_LOCAL descriptors,
// FI_MR_VIRT_ADDR remote addresses, FI_MR_PROV_KEY keys, 4-byte CQ data, a small max_msg_size
// (so that long WRITEs are split), EFA's inject size, and the EFA endpoint options. What tcp lacks
// is emulated here, below the domain's own fi_* calls: open_domain() wraps the tcp domain so that
// every object opened from it (endpoint, CQ, memory regions) is a shim object whose operation
// tables check and translate before calling tcp's:
//
// - FI_MR_PROV_KEY: the shim picks each region's key (requested_key is ignored, as on EFA).
// - FI_MR_LOCAL: every send, receive and WRITE (zero-byte ones included) must carry a descriptor
//   of a live region of this domain that covers the buffer; anything else fails with -FI_EINVAL,
//   is logged as an error and counted (violations(), last_violation()).
// - FI_MR_VIRT_ADDR: remote addresses are virtual addresses; the key carries the region's base so
//   that the initiator translates them to tcp's offsets.
// - 4-byte CQ data: remote CQ data wider than 32 bits is refused at the sender; on arrival the
//   upper 32 bits of tcp's 8 are filled with garbage, so a receiver that does not mask fails.
// - max_msg_size and inject size: longer operations are refused (the domain must split them).
// - FI_OPT_SHARED_MEMORY_PERMITTED / FI_OPT_CUDA_API_PERMITTED: accepted (and counted) when set to
//   false before the endpoint is enabled, as EFA wants; set later, they are violations.
// Unordered completions are not emulated here: turn on the reordering wrapper
// (EngineConfig::reorder), which works on every provider.
#pragma once

#include <rdma/fabric.h>
#include <rdma/fi_domain.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include "providers/libfabric/libfabric_domain.h"
#include "providers/libfabric/provider_attrs.h"

namespace fabric::efa_sim {

inline constexpr const char* kName = "efa-sim";
inline constexpr const char* kUnderlying = "tcp;ofi_rxm";
// Small on purpose (EFA's is about 1 GiB on efa-direct, unlimited on its RDM path): WRITEs of
// more than 64 KiB are split by the domain, so the splitting code runs in every test.
inline constexpr size_t kMaxMsgSize = 64 << 10;
// EFA RDM's inject size with shm enabled (the figure fi_info shows on p5 hosts).
inline constexpr size_t kInjectSize = 4096;
inline constexpr size_t kCqDataSize = 4;

// Rewrites what tcp's fi_getinfo returned into what EFA's would: prov_name "efa", mr_mode
// FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_HMEM, 4-byte CQ data,
// kMaxMsgSize, kInjectSize, manual data progress (the domain name and link speed stay tcp's, so
// Domain::caps() names the loopback NIC). Capabilities stay tcp's (no FI_HMEM: the shim moves host memory
// only), unless offer_hmem(true) and the domain asked for FI_HMEM (hmem_wanted): then FI_HMEM at
// API 1.20, as EFA on a GPU host, so that GPU memory takes the domain's dma-buf path; the shim
// checks and registers such regions but refuses to move them.
void present_as_efa(ProviderAttrs& attrs, bool hmem_wanted);

// fi_domain on the tcp fabric, wrapped (see above). Same contract as fi_domain.
int open_domain(fid_fabric* fabric, fi_info* info, fid_domain** domain);

// All of the above as the libfabric domain takes it: the factory opens provider "efa-sim" as
// open_libfabric_domain(config, nic, &efa_sim::libfabric_hook()).
const LibfabricHook& libfabric_hook();

// What the shim saw, process-wide (tests read them; they count from process start).
struct Stats {
  uint64_t domains = 0;
  uint64_t shared_memory_permitted_false = 0;  // accepted fi_setopt calls
  uint64_t cuda_api_permitted_false = 0;
  uint64_t regions = 0;          // registrations
  uint64_t requested_keys = 0;   // registrations that asked for a key (ignored under PROV_KEY)
  uint64_t writes = 0;           // WRITEs handed to tcp (each piece of a split WRITE counts)
  uint64_t writes_with_data = 0;
  uint64_t largest_write = 0;    // bytes
  uint64_t sends = 0, recvs = 0;
  uint64_t violations = 0;       // posts and calls refused (see above)
  uint64_t dmabuf_regions = 0;      // GPU regions registered as dma-bufs (FI_MR_DMABUF)
  uint64_t hmem_range_regions = 0;  // GPU regions registered as FI_HMEM_CUDA address ranges
};
Stats stats();
std::string last_violation();

// Process-wide, for GPU tests: offer FI_HMEM to domains that ask for it (see present_as_efa).
void offer_hmem(bool on);

// Test hooks, process-wide: the Nth WRITE handed to the shim from now on (1 = the next one) is
// refused with -FI_EIO at post time, or posted and completed with an FI_EREMOTEIO error (as a
// remote access error would be). 0: off.
void fail_write_post(uint64_t nth);
void fail_write_completion(uint64_t nth);

}  // namespace fabric::efa_sim
