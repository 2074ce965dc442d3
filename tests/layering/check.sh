#!/bin/bash
# The layers include only downward (docs/architecture.md, "Layer map" and "Build targets"):
# for each folder, the quoted includes it may not use; then the folder-level include graph,
# computed from every #include "..." line under src/ and include/, must have no cycle. Prints
# every violation and every cycle, and exits 1 if there is one.
set -euo pipefail
cd "$(dirname "$0")/../.."

APPS='"(kv|weights|moe)/|"fabric/(kv|weights|moe)/'
CORE_INTERNALS='"(engine|worker|shared_state|domain|providers|imm)/'
fail=0
# check <what> <extended regex of forbidden include targets> <files...>; includes matching the
# regex in $allow (set on the call, e.g. `allow='...' check ...`) are let through.
check() {
  local what=$1 forbidden=$2; shift 2
  local hits
  hits=$(grep -HnE "^#include \"" "$@" 2>/dev/null | grep -E "#include ($forbidden)" |
         { if [ -n "${allow:-}" ]; then grep -vE "#include ($allow)"; else cat; fi; } || true)
  if [ -n "$hits" ]; then
    echo "layering: $what includes a layer above it (or beside it):"
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
# The metrics writer and endpoint (in fabric_base): the public types and util/ only.
check "src/metrics" "$APPS|$CORE_INTERNALS|\"(cuda|topology)/" $(src src/metrics)
# fabric_core: no application, no topology internals.
check "fabric_core" "$APPS|\"topology/" $(src src/engine src/worker src/shared_state src/domain src/providers src/cuda src/imm)
# fabric_topology: the base and its own files.
check "fabric_topology" "$APPS|$CORE_INTERNALS|\"cuda/" $(src src/topology)
# The applications: the public API, the base's helpers, cuda_check.h, their own files.
check "fabric_kv" "$CORE_INTERNALS|\"(weights|moe|topology)/|\"fabric/(weights|moe)/" $(src src/kv)
check "fabric_weights" "$CORE_INTERNALS|\"(kv|moe|topology)/|\"fabric/(kv|moe)/" $(src src/weights)
check "fabric_moe" "$CORE_INTERNALS|\"(kv|weights|topology)/|\"fabric/(kv|weights)/" $(src src/moe)

# Inside fabric_core, top to bottom: engine > worker > shared_state > domain (the contract) >
# nothing of the core; the providers implement the contract and sit beside the layers above it,
# reached only through the factory (providers/open_domain.h). imm/ and cuda/ are leaves.
check "src/engine" '"providers/' $(src src/engine)  # not even the factory: workers open domains
allow='"providers/open_domain\.h"' check "src/worker" '"engine/|"providers/' $(src src/worker)
check "src/shared_state" '"(engine|worker|providers|imm|cuda)/' $(src src/shared_state)
check "src/domain (the contract)" '"(engine|worker|shared_state|providers|imm|cuda)/' $(src src/domain)
check "src/imm" '"(engine|worker|shared_state|domain|providers|cuda)/' $(src src/imm)
check "src/cuda" '"(engine|worker|shared_state|domain|providers|imm)/' $(src src/cuda)
# The factory (the files directly in src/providers/) may include every provider, nothing above.
check "src/providers (factory)" '"(engine|worker|shared_state|imm)/' $(find src/providers -maxdepth 1 -type f)
# Each provider: the contract, cuda/, util/, its own folder; never another provider, except these
# shared helpers (each a one-way include, so no cycle):
#   cuda_ipc, host_ipc -> ipc/: the shared-memory endpoint and local-domain glue both local domains
#     are built on (ipc/ is a helper folder, not a provider: the factory opens nothing from it).
#   efa_sim -> libfabric/{libfabric_domain,fi_compat,provider_attrs}.h: efa_sim is a test shim
#     below the libfabric domain's fi_* calls, handed to it by the factory as a LibfabricHook; it
#     rewrites the ProviderAttrs that domain runs on and needs the same libfabric-version shims.
#     The libfabric provider never includes efa_sim.
declare -A SHARED_HELPERS=(
  [cuda_ipc]='"providers/ipc/'
  [host_ipc]='"providers/ipc/'
  [efa_sim]='"providers/libfabric/(libfabric_domain|fi_compat|provider_attrs)\.h"'
)
for dir in src/providers/*/; do
  p=$(basename "$dir")
  ok="\"providers/$p/"
  if [ -n "${SHARED_HELPERS[$p]:-}" ]; then ok="$ok|${SHARED_HELPERS[$p]}"; fi
  allow="$ok" check "src/providers/$p" '"(engine|worker|shared_state|imm)/|"providers/' $(src "$dir")
done

# Folder cycles. One node per folder of src/ and include/ (each src/providers/<name> its own
# node, the factory files directly in src/providers/ another; include/fabric and each of its
# application folders one each); an edge per #include "folder/..." line between two nodes (a
# bare "file.h" stays in its folder). Each cycle found is printed as a path.
cycles=$(
  { find src include -type f \( -name '*.h' -o -name '*.cpp' -o -name '*.cu' -o -name '*.cuh' \) -print0 |
      xargs -0 grep -HE '^[[:space:]]*#[[:space:]]*include[[:space:]]*"' || true; } |
    awk '
      function node_of(path,   n, p) {  # a path below src/ or include/, without that prefix
        n = split(path, p, "/")
        if (n < 2) return ""
        if (p[1] == "providers" || p[1] == "fabric") return (n > 2 ? p[1] "/" p[2] : p[1])
        return p[1]
      }
      {
        file = $0; sub(/:.*/, "", file)
        target = $0; sub(/^[^"]*"/, "", target); sub(/".*/, "", target)
        sub(/^(src|include)\//, "", file)
        from = node_of(file)
        to = (index(target, "/") ? node_of(target) : from)
        if (from == "" || to == "" || from == to) next
        if (!((from, to) in edge)) { edge[from, to] = 1; out[from] = out[from] " " to }
        nodes[from] = 1; nodes[to] = 1
      }
      function dfs(u,   i, n, succ, v, k, cycle) {  # a back edge to a node on the stack: a cycle
        color[u] = 1; stack[++depth] = u
        n = split(out[u], succ, " ")
        for (i = 1; i <= n; i++) {
          v = succ[i]
          if (color[v] == 1) {
            cycle = v
            for (k = depth; k >= 1 && stack[k] != v; k--) cycle = cycle " <- " stack[k]
            print cycle " <- " v
          } else if (color[v] == 0) dfs(v)
        }
        depth--; color[u] = 2
      }
      END { for (u in nodes) if (color[u] == 0) dfs(u) }')
if [ -n "$cycles" ]; then
  echo "layering: folder-level include cycles (a <- b: b includes a):"
  echo "$cycles"
  fail=1
fi

if [ "$fail" = 0 ]; then echo "layering: every include goes downward and no folder include cycle"; fi
exit "$fail"
