#!/usr/bin/env bash
# DeepEP's own low-latency test (tests/legacy/test_low_latency.py, fetched by
# tests/gpu/fetch_deep_ep.sh) against fabric_lib.moe.deep_ep, with only its import changed: a
# package `deep_ep` made here re-exports the shim, DeepEP's own utils/math.py and utils/testing.py,
# and envs.py (this folder: gloo ranks on GPU 0, LOCAL_WORLD_SIZE ranks per node). Prints a
# `moe-deepep-test ranks=.. node_size=.. result=pass|fail` line per configuration.
# Args: "ranks node_size [extra test args]" entries separated by ';'.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
src=${DEEPEP_UPSTREAM:-$here/../../../.gpudeps/deepep}
[ -f "$src/test_low_latency.py" ] || { echo "moe-deepep-test result=skipped (no $src/test_low_latency.py: run tests/gpu/fetch_deep_ep.sh)"; exit 0; }
pkg=$(mktemp -d)
mkdir -p "$pkg/deep_ep/utils"
echo "from fabric_lib.moe.deep_ep import Buffer, EventOverlap, topk_idx_t  # noqa: F401" > "$pkg/deep_ep/__init__.py"
: > "$pkg/deep_ep/utils/__init__.py"
cp "$src/math.py" "$src/testing.py" "$pkg/deep_ep/utils/"
cp "$here/envs.py" "$pkg/deep_ep/utils/envs.py"
status=0
IFS=';' read -ra runs <<< "${1:-2 2;4 2;8 4}"
for run in "${runs[@]}"; do
  read -r ranks node extra <<< "$run"
  log=$(mktemp)
  # DeepEP's bench_kineto profiles the kernels by name: one profile row holding "dispatch", one
  # holding "combine" (ours are one kernel each, launched per phase, as DeepEP's). Its switch
  # EP_USE_NVIDIA_TOOLS=1 that skips the profiling cannot be used: the test then indexes the ints
  # bench_kineto returns (DeepEP dd758ca, test_low_latency.py:248).
  ( cd "$pkg" && PYTHONPATH="$pkg" LOCAL_WORLD_SIZE=$node MASTER_PORT=$((20000 + RANDOM % 20000)) \
      timeout "${DEEPEP_TIMEOUT:-300}" python3 "$src/test_low_latency.py" --num-processes "$ranks" ${extra:-} ) > "$log" 2>&1
  rc=$?
  grep -E "^\[rank 0\]|Error|error|assert" "$log" | head -8
  if [ $rc = 0 ]; then result=pass; else result=fail; status=1; tail -25 "$log"; fi
  echo "moe-deepep-test ranks=$ranks node_size=$node args='${extra:-}' result=$result rc=$rc"
done
exit $status
