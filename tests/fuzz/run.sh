#!/usr/bin/env bash
# Runs every fuzz target of <build dir> (built from tests/fuzz) for <runs> executions each, on a
# fresh copy of its seed corpus (tests/fuzz/corpus/<target> -> <build dir>/corpus/<target>, so the
# committed corpus stays as it is). Logs: <build dir>/logs/<target>.log; a crashing input is saved
# under <build dir>/artifacts/<target>/. Exits non-zero if any target crashed. [jobs]: targets run
# at once (1), each on one core.
#   tests/fuzz/run.sh build-fuzz 10000000 [jobs]
set -uo pipefail
build=${1:?usage: run.sh <build dir> <runs> [jobs]}
runs=${2:?usage: run.sh <build dir> <runs> [jobs]}
jobs=${3:-1}
src=$(cd "$(dirname "$0")" && pwd)
mapfile -t targets < "$build/targets.txt"
mkdir -p "$build/logs" "$build/corpus"
# fuzz_one <target>: runs it; its summary line goes to <build>/logs/<target>.summary, and what to
# show of a crash to <build>/logs/<target>.failure.
fuzz_one() {
  local t=$1
  rm -f "$build/logs/$t.summary" "$build/logs/$t.failure"
  rm -rf "$build/corpus/$t" "$build/artifacts/$t"
  cp -r "$src/corpus/$t" "$build/corpus/$t"
  mkdir -p "$build/artifacts/$t"
  local log=$build/logs/$t.log start wall rc last done_runs cov ft corp eps
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
    { echo "fuzz $t FAILED (exit $rc); end of $log:"; tail -40 "$log"; } > "$build/logs/$t.failure"
    echo "fuzz $t runs=${done_runs:-?} CRASH artifacts=$(ls "$build/artifacts/$t" | tr '\n' ' ')" > "$build/logs/$t.summary"
  else
    echo "fuzz $t runs=$done_runs ok wall_s=$(printf %.1f "$wall") exec_per_s=$eps cov=$cov ft=$ft corpus=$corp" \
      > "$build/logs/$t.summary"
  fi
}

running=0
for t in "${targets[@]}"; do
  [ -n "$t" ] || continue
  if [ "$running" -ge "$jobs" ]; then wait -n; running=$((running - 1)); fi
  fuzz_one "$t" &
  running=$((running + 1))
done
wait
crashes=0
summary=()
for t in "${targets[@]}"; do
  [ -n "$t" ] || continue
  [ -f "$build/logs/$t.failure" ] && { cat "$build/logs/$t.failure"; crashes=$((crashes + 1)); }
  summary+=("$(cat "$build/logs/$t.summary" 2>/dev/null || echo "fuzz $t: no result")")
  [ -f "$build/logs/$t.summary" ] || crashes=$((crashes + 1))
done
printf '%s\n' "${summary[@]}"
echo "fuzz targets=${#summary[@]} runs_each=$runs crashes=$crashes"
[ "$crashes" -eq 0 ]
