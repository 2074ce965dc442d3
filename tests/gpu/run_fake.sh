#!/usr/bin/env bash
# The GPU tests without a GPU: tests/gpu/gpu_engine_test.cpp linked against fake_cuda.cpp (a
# host-only stand-in for the CUDA runtime) and the libfabric.a of a CUDA build, each test in its
# own process. It checks the library's logic (routing, the cuda_ipc protocol, peer and region
# lifecycles, namespaces: run as root), not GPU behaviour; the H200 run is tests/gpu/run.sh.
# Usage: tests/gpu/run_fake.sh [build dir (default build)] [libfabric.a to use instead of its own]
set -uo pipefail
cd "$(dirname "$0")/../.."
BUILD=${1:-build}
LIB=${2:-$BUILD/libfabric.a}
CUDA_INC=${CUDA_INC:-/usr/local/cuda/include}
OUTDIR=$BUILD/fake-gpu
mkdir -p "$OUTDIR"
CXX="${CXX:-c++} -std=c++20 -O1 -g -Wall -Wextra -Isrc -Iinclude -Itools/common -Itests/gpu -I$CUDA_INC -DFMT_SHARED"
$CXX -c tests/gpu/gpu_engine_test.cpp -o "$OUTDIR/gpu_engine_test.o" &&
  $CXX -c tests/gpu/fake_cuda.cpp -o "$OUTDIR/fake_cuda.o" &&
  ${CXX%% *} "$OUTDIR/gpu_engine_test.o" "$OUTDIR/fake_cuda.o" "$LIB" -o "$OUTDIR/gpu_tests_fake" \
    $(pkg-config --libs libfabric) $(pkg-config --exists libibverbs && pkg-config --libs libibverbs) \
    -lfmt -lgtest -lgtest_main -lpthread -lrt || exit 2
status=0
for t in $("$OUTDIR/gpu_tests_fake" --gtest_list_tests | awk '/^[^ ]/{s=$1} /^  /{print s $1}'); do
  case $t in *FromACudaGraph) continue ;; esac  # no graphs in the stand-in
  out=$(timeout 200 "$OUTDIR/gpu_tests_fake" --gtest_filter="$t" 2>&1)
  rc=$?
  echo "$out" | grep -E "^\[ +(OK|FAILED|SKIPPED) +\] $t|remove_peer:|dead peer:|dereg_mr mid" | sed 's/^/  /'
  [ $rc -eq 0 ] || { status=1; echo "  exit $rc: $t"; }
done
exit $status
