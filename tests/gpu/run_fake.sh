#!/usr/bin/env bash
# The GPU tests without a GPU: tests/gpu/gpu_engine_test.cpp and tests/gpu/cuda_ipc_batch_test.cpp
# linked against fake_cuda.cpp (a host-only stand-in for the CUDA runtime) and the libfabric.a of a
# CUDA build, each test in its own process. It checks the library's logic (routing, the cuda_ipc
# protocol, batches, peer and region lifecycles, namespaces: run as root), not GPU behaviour; the
# H200 run is tests/gpu/run.sh.
# Usage: tests/gpu/run_fake.sh [build dir (default build)] [the library archives to link instead of its own]
# FABRIC_FAKE_TESTS: which test programs (default "gpu_engine_test cuda_ipc_batch_test").
set -uo pipefail
cd "$(dirname "$0")/../.."
BUILD=${1:-build}
# The layers the tests reach, without fabric_cuda_kernels: the stand-in runs the gather copy itself.
LIB=${2:-"$BUILD/libfabric_core.a $BUILD/libfabric_topology.a $BUILD/libfabric_base.a"}
CUDA_INC=${CUDA_INC:-/usr/local/cuda/include}
OUTDIR=$BUILD/fake-gpu
mkdir -p "$OUTDIR"
CXX="${CXX:-c++} -std=c++20 -O1 -g -Wall -Wextra -Isrc -Iinclude -Itools/common -Itests/gpu -I$CUDA_INC -DFMT_SHARED"
$CXX -c tests/gpu/fake_cuda.cpp -o "$OUTDIR/fake_cuda.o" || exit 2
status=0
for prog in ${FABRIC_FAKE_TESTS:-gpu_engine_test cuda_ipc_batch_test}; do
  bin="$OUTDIR/${prog}_fake"
  if ! { $CXX -c "tests/gpu/$prog.cpp" -o "$OUTDIR/$prog.o" &&
         # shellcheck disable=SC2086  # LIB is a list of archives
         ${CXX%% *} "$OUTDIR/$prog.o" "$OUTDIR/fake_cuda.o" $LIB -o "$bin" \
           $(pkg-config --libs libfabric) $(pkg-config --exists libibverbs && pkg-config --libs libibverbs) \
           -lfmt -lgtest -lgtest_main -lpthread -lrt; }; then
    echo "  build failed: $prog"
    status=2
    continue
  fi
  for t in $("$bin" --gtest_list_tests | awk '/^[^ ]/{s=$1} /^  /{print s $1}'); do
    case $t in *FromACudaGraph) continue ;; esac  # no graphs in the stand-in
    out=$(timeout 200 "$bin" --gtest_filter="$t" 2>&1)
    rc=$?
    echo "$out" | grep -E "^\[ +(OK|FAILED|SKIPPED) +\] $t|remove_peer:|dead peer:|dereg_mr mid|owner:" | sed 's/^/  /'
    [ $rc -eq 0 ] || { status=1; echo "  exit $rc: $t"; }
  done
done
exit $status
