#!/usr/bin/env bash
# Posting cost, engine against a raw libfabric loop in the same run: `fabric-bench local --busy
# --only post` (submit call to the first and to the last WRITE handed to the provider) with one
# peer and with 64 peer engines, then raw-post-loop posting the same 64-byte WRITEs to as many
# peer endpoints (first call to last return). Prints a `post <provider> ...` line per provider with
# the p50s and the engine/raw ratios (the target for 64 peers: <= 1.3).
# Usage: bench/post_vs_raw.sh [BUILD_DIR]
set -euo pipefail
build=${1:-build}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
p50() {  # p50 <json> <test name>
  python3 -c 'import json,sys; r=[x for x in json.load(open(sys.argv[1]))["results"] if x["test"]==sys.argv[2]]; print(r[0]["p50_us"])' "$1" "$2"
}
raw_p50() {  # raw_p50 <raw output> <"first post"|"all posted">
  sed -n "s/^raw post .* $2 p50 \([0-9.]*\) us.*/\1/p" "$1"
}
for p in shm "tcp;ofi_rxm"; do
  name=${p%%;*}
  "$build/tools/fabric-bench/fabric-bench" local --provider "$p" --busy --peers 1 --only post --json "$tmp/one.json"
  "$build/tools/fabric-bench/fabric-bench" local --provider "$p" --busy --peers 64 --peer-idle-us 2000 \
    --peer-buffer-mib 1 --buffer-mib 8 --only post --json "$tmp/many.json"
  "$build/bench/raw-post-loop" --provider "$p" --peers 1 | tee "$tmp/raw1.txt"
  "$build/bench/raw-post-loop" --provider "$p" --peers 64 | tee "$tmp/raw64.txt"
  e1=$(p50 "$tmp/one.json" "post single 64B first post")
  ef=$(p50 "$tmp/many.json" "post scatter 64x64B first post")
  ea=$(p50 "$tmp/many.json" "post scatter 64x64B all posted")
  r1=$(raw_p50 "$tmp/raw1.txt" "all posted")
  ra=$(raw_p50 "$tmp/raw64.txt" "all posted")
  awk -v n="$name" -v e1="$e1" -v ef="$ef" -v ea="$ea" -v r1="$r1" -v ra="$ra" 'BEGIN {
    printf "post %s single_first_us=%.2f raw_single_us=%.2f scatter64_first_us=%.2f scatter64_all_us=%.2f raw64_all_us=%.2f scatter64_all/raw=%.2f\n",
      n, e1, r1, ef, ea, ra, ea / ra }'
done
