// Links fabric::fabric_kv alone: the KV endpoints and the engine under them, no other application.
#include <cstdio>

#include "fabric/kv/transfer.h"

int main() {
  fabric::TransferEngine engine;
  std::printf("kv_only: tag of request 5, layer 1 = %#x\n", fabric::kv::layer_imm(5, 1));
  return 0;
}
