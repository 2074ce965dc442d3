#!/usr/bin/env bash
# Copies, here (with network), DeepEP's own low-latency test and the two helper modules it imports
# (deep_ep/utils/math.py, testing.py) at a pinned commit into .gpudeps/deepep/, for
# tests/gpu/deep_ep_upstream/run.sh to run on the GPU machine against fabric_lib's deep_ep shim:
# carry .gpudeps with the device call. Nothing of DeepEP is committed here.
set -euo pipefail
cd "$(dirname "$0")/../.."
COMMIT=${DEEPEP_COMMIT:-dd758caf}
SRC=${DEEPEP_SRC:-}
dst=.gpudeps/deepep
mkdir -p "$dst"
if [ -z "$SRC" ]; then
  SRC=$(mktemp -d)
  git clone --quiet https://github.com/deepseek-ai/DeepEP "$SRC"
fi
for f in tests/legacy/test_low_latency.py deep_ep/utils/math.py deep_ep/utils/testing.py; do
  git -C "$SRC" show "$COMMIT:$f" > "$dst/$(basename "$f")"
done
echo "$COMMIT" > "$dst/COMMIT"
ls -l "$dst"
