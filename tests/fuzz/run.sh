#!/usr/bin/env bash
# Runs every fuzz target of <build dir> (built from tests/fuzz) for <runs> executions each, on a
# fresh copy of its seed corpus (tests/fuzz/corpus/<target> -> <build dir>/corpus/<target>, so the
# committed corpus stays as it is). Logs: <build dir>/logs/<target>.log; a crashing input is saved
# under <build dir>/artifacts/<target>/. Exits non-zero if any target crashed.
#   tests/fuzz/run.sh build-fuzz 10000000
set -uo pipefail
build=${1:?usage: run.sh <build dir> <runs>}
runs=${2:?usage: run.sh <build dir> <runs>}
src=$(cd "$(dirname "$0")" && pwd)
mapfile -t targets < "$build/targets.txt"
mkdir -p "$build/logs" "$build/corpus"
crashes=0
summary=()
for t in "${targets[@]}"; do
  [ -n "$t" ] || continue
  rm -rf "$build/corpus/$t" "$build/artifacts/$t"
  cp -r "$src/corpus/$t" "$build/corpus/$t"
  mkdir -p "$build/artifacts/$t"
  log=$build/logs/$t.log
  echo "fuzz $t: $runs runs (log $log)"
  start=$(date +%s.%N)
  "$build/$t" -runs="$runs" -max_len=512 -timeout=10 -print_final_stats=1 \
    -artifact_prefix="$build/artifacts/$t/" "$build/corpus/$t" >"$log" 2>&1
  rc=$?
  wall=$(echo "$(date +%s.%N) - $start" | bc)
  # The last status line: "#10000000 DONE cov: 123 ft: 456 corp: 78/9kb lim: 512 exec/s: 123456 ..."
  last=$(grep -E "^#[0-9]+[[:space:]]+DONE" "$log" | tail -1)
  done_runs=$(sed -nE 's/^Done ([0-9]+) runs in.*/\1/p' "$log" | tail -1)
  cov=$(sed -nE 's/.* cov: ([0-9]+).*/\1/p' <<<"$last")
  ft=$(sed -nE 's/.* ft: ([0-9]+).*/\1/p' <<<"$last")
  corp=$(sed -nE 's/.* corp: ([0-9]+)\/.*/\1/p' <<<"$last")
  eps=$(echo "${done_runs:-0} / $wall" | bc)
  if [ "$rc" -ne 0 ] || [ "${done_runs:-0}" -ne "$runs" ]; then
    crashes=$((crashes + 1))
    echo "fuzz $t FAILED (exit $rc); end of $log:"
    tail -40 "$log"
    summary+=("fuzz $t runs=${done_runs:-?} CRASH artifacts=$(ls "$build/artifacts/$t" | tr '\n' ' ')")
  else
    summary+=("fuzz $t runs=$done_runs ok wall_s=$(printf %.1f "$wall") exec_per_s=$eps cov=$cov ft=$ft corpus=$corp")
  fi
done
printf '%s\n' "${summary[@]}"
echo "fuzz targets=${#summary[@]} runs_each=$runs crashes=$crashes"
[ "$crashes" -eq 0 ]
