// Links fabric::fabric: an engine, a reservation and the MoE header all resolve.
#include <cstdio>

#include "fabric/fabric.h"
#include "fabric/moe/all_to_all.h"
#include "fabric/weights/update.h"

int main() {
  fabric::TransferEngine engine;
  fabric::ImmReservation r = engine.reserve_imms({.holder = "consumer", .bits = fabric::weights::kUpdateImmBits});
  std::printf("whole: imms at %#x\n", r.range().base);
  return 0;
}
