// ResolvedTarget: one worker's route to a destination region, per domain. Workers write it (they
// alone may resolve a peer's addresses); the engine's RemoteTable holds one per worker and slot.
#pragma once

#include <array>
#include <cstdint>

#include "domain/domain.h"

namespace fabric {

// Where one destination region is reached through each NIC (rail-aligned: NIC k to NIC k), or,
// when `local`, through the local (cuda_ipc) domain at the worker's local index.
struct ResolvedTarget {
  std::array<PeerId, kMaxDomains> peer{};
  std::array<RemoteKey, kMaxDomains> key{};
  uint32_t record = UINT32_MAX;  // the worker's peer record (its state says whether it is usable)
  bool local = false;
  uint32_t imm_base = 0;  // the region's immediate range (MrDesc::imms): WRITEs carry imm_base + imm
};

}  // namespace fabric
