// MrRequest: one region for TransferEngine::reg_mrs, which registers many in one call (one round
// trip to each worker instead of one per region) and either registers all of them or none.
#pragma once

#include <cstddef>

#include "fabric/types.h"

namespace fabric {

class ImmReservation;

struct MrRequest {
  void* ptr = nullptr;
  size_t len = 0;
  Device device = Device::host();
  // The reservation whose range this region's incoming immediates belong to (as reg_mr with an
  // ImmReservation); null: none. Read during the call only.
  const ImmReservation* imms = nullptr;
  // Host memory only: populate every page of the range writable before registering
  // (MADV_POPULATE_WRITE; contents unchanged), so the page faults of fresh memory are paid here
  // and not by the first WRITE that lands in it. Device memory ignores it.
  bool prefault = false;
};

}  // namespace fabric
