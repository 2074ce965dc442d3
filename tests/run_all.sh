#!/bin/bash
# make test: every suite CI runs, phase by phase, each phase's time printed as
# `test: phase <name> took <N> s` and all of them again at the end (docs/testing.md has the table).
#
#   tests/run_all.sh <release build dir>        (make test builds it first)
#
# On 2 cores: ctest runs TEST_JOBS tests at once (default 2), pytest PY_TEST_JOBS workers, the
# fuzz targets FUZZ_JOBS at once. The release build's churn test (minutes, mostly waiting on
# 2 s write timeouts to killed peers) runs by itself in the background from the start, beside
# the other release tests, the Python build and the Python suite; its output goes to
# <build>/test-logs/churn.log and is printed when it ends. The first failing phase stops the run
# (after the background phase has ended and been printed).
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:?usage: run_all.sh <release build dir>}
MAKE=${MAKE:-make}
export TEST_JOBS=${TEST_JOBS:-2}
LOGS=$BUILD/test-logs
mkdir -p "$LOGS"
T0=$SECONDS
times=()

# phase <name> <command...>: runs it, prints its time; returns its status.
phase() {
  local name=$1 t=$SECONDS rc=0
  shift
  echo "== test: phase $name: $*"
  "$@" || rc=$?
  local line="test: phase $name took $((SECONDS - t)) s"
  [ $rc = 0 ] || line="$line: FAILED (exit $rc)"
  echo "$line"
  times+=("$line")
  return $rc
}

bg_pid=""
bg_name=""
# bg_phase <name> <command...>: the phase in the background, output to $LOGS/<name>.log.
bg_phase() {
  bg_name=$1
  echo "== test: phase $1 in the background (log $LOGS/$1.log): ${*:2}"
  (phase "$@") >"$LOGS/$1.log" 2>&1 &
  bg_pid=$!
}
# bg_wait: waits for the background phase, prints its log; returns its status.
bg_wait() {
  [ -n "$bg_pid" ] || return 0
  local rc=0
  wait "$bg_pid" || rc=$?
  bg_pid=""
  echo "== test: background phase $bg_name ended; its log:"
  cat "$LOGS/$bg_name.log"
  times+=("$(grep '^test: phase ' "$LOGS/$bg_name.log" | tail -1) (background)")
  return $rc
}

finish() {
  local rc=$1
  bg_wait || rc=1
  echo "== test: phase times"
  printf '  %s\n' "${times[@]}"
  echo "test: total $((SECONDS - T0)) s after the build: $([ "$rc" = 0 ] && echo PASS || echo FAIL)"
  exit "$rc"
}
run() { phase "$@" || finish 1; }

# The churn test straight from its binary, with ctest's timeout for it (tests/CMakeLists.txt):
# a second ctest on this build directory would share its Testing/ logs with the first.
# Its environment is ctest's for it (FABRIC_TEST_ENV in tests/CMakeLists.txt: smaller rxm pools).
bg_phase churn env FI_OFI_RXM_MSG_RX_SIZE=64 timeout 900 "$BUILD/tests/churn_test"
run ctest-release ctest --test-dir "$BUILD" --output-on-failure --timeout 600 -j"$TEST_JOBS" -E '^PeerChurn\.'
run python "$MAKE" --no-print-directory test-python
bg_wait || finish 1
run rxe "$MAKE" --no-print-directory test-rxe BUILD="$BUILD"
run netem "$MAKE" --no-print-directory test-netem BUILD="$BUILD"
run soak "$MAKE" --no-print-directory soak BUILD="$BUILD" SOAK_MINUTES=1
run fuzz "$MAKE" --no-print-directory fuzz FUZZ_RUNS=200000
run sanitize-asan tests/sanitize/run.sh asan
run sanitize-tsan tests/sanitize/run.sh tsan
finish 0
