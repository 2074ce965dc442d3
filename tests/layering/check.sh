#!/bin/bash
# The layers include only downward (docs/architecture.md, "Layers and targets"): for each folder,
# the quoted includes it may not use. Prints every violation and exits 1 if there is one.
set -euo pipefail
cd "$(dirname "$0")/../.."

APPS='"(kv|weights|moe)/|"fabric/(kv|weights|moe)/'
CORE_INTERNALS='"(engine|worker|shared_state|domain|providers|imm)/'
fail=0
check() {  # check <what> <extended regex of forbidden include targets> <files...>
  local what=$1 forbidden=$2; shift 2
  local hits
  hits=$(grep -HnE "^#include \"" "$@" 2>/dev/null | grep -E "#include ($forbidden)" || true)
  if [ -n "$hits" ]; then
    echo "layering: $what includes a layer above it:"
    echo "$hits"
    fail=1
  fi
}
src() { find "$@" -type f \( -name '*.h' -o -name '*.cpp' -o -name '*.cu' \) 2>/dev/null; }

# Public headers: core at the top level, each application in its folder, on core only.
check "include/fabric (core)" '"fabric/(kv|weights|moe)/' $(find include/fabric -maxdepth 1 -name '*.h')
check "include/fabric/kv" '"fabric/(weights|moe)/' $(src include/fabric/kv)
check "include/fabric/weights" '"fabric/(kv|moe)/' $(src include/fabric/weights)
check "include/fabric/moe" '"fabric/(kv|weights)/' $(src include/fabric/moe)
# fabric_base: value types, errors, logging.
check "src/util" "$APPS|$CORE_INTERNALS|\"(cuda|topology)/" $(src src/util) src/engine/types.cpp
# fabric_core: no application, no topology internals.
check "fabric_core" "$APPS|\"topology/" $(src src/engine src/worker src/shared_state src/domain src/providers src/cuda src/imm)
# fabric_topology: the base and its own files.
check "fabric_topology" "$APPS|$CORE_INTERNALS|\"cuda/" $(src src/topology)
# The applications: the public API, the base's helpers, cuda_check.h, their own files.
check "fabric_kv" "$CORE_INTERNALS|\"(weights|moe|topology)/|\"fabric/(weights|moe)/" $(src src/kv)
check "fabric_weights" "$CORE_INTERNALS|\"(kv|moe|topology)/|\"fabric/(kv|moe)/" $(src src/weights)
check "fabric_moe" "$CORE_INTERNALS|\"(kv|weights|topology)/|\"fabric/(kv|weights)/" $(src src/moe)
if [ "$fail" = 0 ]; then echo "layering: every include goes downward"; fi
exit "$fail"
