#!/usr/bin/env bash
# The engine's own instruction count per posted WRITE, under callgrind: deterministic, so usable as
# a regression figure. Counts the submit call (application thread), the worker's intake and
# posting of the request, and its handling of the completion; the provider's fi_writedata is
# excluded. Toggles flip collection: on in the engine entry points (submit, request intake, pending
# posts, completion), off again inside the provider calls (post_write, insert_peer). Batches of 32
# stay under the 64-in-flight limit, so WRITEs rarely wait in the pending list; the empty
# post_pending() of idle worker rounds adds a few instructions whose count depends on timing
# (measured: under 1% between runs). LD_BIND_NOW keeps the
# dynamic linker's first-call symbol resolution out of the count.
# Usage: bench/callgrind_post.sh [BUILD_DIR]
set -euo pipefail
build=${1:-build}
# With scatters (64 regions of the same engine, 64 bytes each): the same count per WRITE for a
# GroupScatter (the group's prebuilt WRITE templates) and for a plain Scatter (a route per slice).
out=$(mktemp)
trap 'rm -f "$out"' EXIT
count() {  # count <what> <entry point> <WRITEs per call> <batches> <batch> [submit-overhead args]
  local what=$1 entry=$2 per=$3 batches=$4 batch=$5
  shift 5
  rm -f "$out"
  LD_BIND_NOW=1 valgrind --tool=callgrind --callgrind-out-file="$out" --collect-atstart=no \
    --toggle-collect="$entry" \
    --toggle-collect='fabric::Worker::handle(fabric::TransferRequest&&)' \
    --toggle-collect='fabric::Worker::on_completion(*' \
    --toggle-collect='fabric::Worker::post_pending()' \
    --toggle-collect='fabric::(anonymous namespace)::LibfabricDomain::post_write(*' \
    --toggle-collect='fabric::(anonymous namespace)::LibfabricDomain::insert_peer(*' \
    "$build/bench/submit-overhead" --batches "$batches" --batch "$batch" "$@" >/dev/null 2>&1 || true
  [[ -s $out ]] || { echo "callgrind produced no profile" >&2; exit 1; }
  local total writes
  total=$(sed -n 's/^totals: *\([0-9]*\).*/\1/p' "$out" | tail -1)
  writes=$((batches * batch * per))  # the warm-up batch included: it is deterministic too
  awk -v t="$total" -v w="$writes" -v what="$what" \
    'BEGIN { printf "engine instructions per posted WRITE%s: %.0f (%d WRITEs, callgrind)\n", what, t / w, w }'
}
count ", group scatter to 64" 'fabric::TransferEngine::submit(fabric::GroupScatter const&*' 64 11 8 --scatter 64
count ", list scatter to 64" 'fabric::TransferEngine::submit(fabric::Scatter const&*' 64 11 8 --scatter 64 --list
# Last: the figure other tools read.
count "" 'fabric::TransferEngine::submit(fabric::SingleWrite const&*' 1 101 32
