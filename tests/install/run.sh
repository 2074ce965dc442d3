#!/bin/bash
# Installs the build in $1 into a scratch prefix, then configures, builds and runs tests/install's
# consumer project against it (find_package(fabric_lib)): the whole library and one application
# alone; then the C++ examples (examples/cpp) the same way, each run to its verdict, and checks that
# the README's C++ snippet is examples/cpp/quickstart.cpp's block between its README markers.
set -euo pipefail
build=$(cd "$1" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
prefix=$build/install-test
rm -rf "$prefix" "$build/consumer" "$build/example-cpp-test"
cmake --install "$build" --prefix "$prefix" >/dev/null
cmake -S "$here" -B "$build/consumer" -G Ninja -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
cmake --build "$build/consumer" >/dev/null
FABRIC_PROVIDER="tcp;ofi_rxm" "$build/consumer/whole"
FABRIC_PROVIDER="tcp;ofi_rxm" "$build/consumer/kv_only"
if nm -C "$build/consumer/kv_only" | grep -q "fabric::moe::AllToAll"; then
  echo "kv_only holds MoE code"; exit 1
fi
echo "install: a consumer links fabric::fabric and fabric::fabric_kv alone"

# examples/cpp against the same install, as its CMakeLists.txt says a user builds it.
cmake -S "$root/examples/cpp" -B "$build/example-cpp-test" -G Ninja -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
cmake --build "$build/example-cpp-test" >/dev/null
out=$(timeout 120 "$build/example-cpp-test/quickstart") || { echo "$out"; echo "install: quickstart FAILED"; exit 1; }
echo "$out"
[[ $out == *": OK" ]] || { echo "install: quickstart printed no OK verdict"; exit 1; }

# The README's C++ snippet ("## Using it", after its #include lines) is the example's block between
# "// [README: Using it]" and "// [/README]", dedented: what the README shows is what make test runs.
python3 - "$root/README.md" "$root/examples/cpp/quickstart.cpp" <<'PY'
import re, sys, textwrap
readme, example = (open(p).read() for p in sys.argv[1:])
m = re.search(r"^## Using it\n.*?^```cpp\n(.*?)^```", readme, re.S | re.M)
if not m:
    sys.exit("install: README.md has no ```cpp block under '## Using it'")
shown = [l for l in m.group(1).splitlines() if not l.startswith("#include")]
while shown and not shown[0].strip():
    shown.pop(0)
e = re.search(r"^[ \t]*// \[README: Using it\]\n(.*?)^[ \t]*// \[/README\]", example, re.S | re.M)
if not e:
    sys.exit("install: examples/cpp/quickstart.cpp has no README markers")
block = textwrap.dedent(e.group(1)).splitlines()
if shown != block:
    import difflib
    print("\n".join(difflib.unified_diff(block, shown, "quickstart.cpp (between the markers)", "README.md", lineterm="")))
    sys.exit("install: the README's C++ snippet differs from examples/cpp/quickstart.cpp: copy the block over")
print(f"install: the README's C++ snippet is quickstart.cpp's, {len(block)} lines")
PY
