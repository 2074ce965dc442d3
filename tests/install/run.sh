#!/bin/bash
# Installs the build in $1 into a scratch prefix, then configures, builds and runs tests/install's
# consumer project against it (find_package(fabric_lib)): the whole library and one application alone.
set -euo pipefail
build=$(cd "$1" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
prefix=$build/install-test
rm -rf "$prefix" "$build/consumer"
cmake --install "$build" --prefix "$prefix" >/dev/null
cmake -S "$here" -B "$build/consumer" -G Ninja -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
cmake --build "$build/consumer" >/dev/null
FABRIC_PROVIDER="tcp;ofi_rxm" "$build/consumer/whole"
FABRIC_PROVIDER="tcp;ofi_rxm" "$build/consumer/kv_only"
if nm -C "$build/consumer/kv_only" | grep -q "fabric::moe::AllToAll"; then
  echo "kv_only holds MoE code"; exit 1
fi
echo "install: a consumer links fabric::fabric and fabric::fabric_kv alone"
