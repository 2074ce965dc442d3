#!/usr/bin/env bash
# make bench-compare: the engine against a raw libfabric loop (same provider, same endpoint setup,
# same WRITEs, same number in flight) on tcp;ofi_rxm and shm, and against UCX's ucx_perftest
# (UCX_TLS=tcp, the engine under NIXL) on loopback; alternating trials, medians, ratios.
# Ends with: ratio paged64k=<engine/raw> single16m=<engine/raw> ucx=<engine/ucx>  (tcp;ofi_rxm)
# Usage: bench/compare.sh [BUILD_DIR] [TRIALS] [JSON_OUT]  (JSON: the medians, for bench/plot.py)
set -euo pipefail
build=${1:-build}
trials=${2:-5}
json=${3:-}
points=()
demo=$build/tools/demo/fabric-demo
raw=$build/bench/raw-paged-loop

# One trial; prints GB/s. A failed or unverified run aborts with its output.
gbps() {
  local out
  if ! out=$("$@" 2>&1) || ! grep -q 'bytes: OK$' <<<"$out"; then
    printf '%s\nFAILED: %s\n' "$out" "$*" >&2
    exit 1
  fi
  sed -n 's/^moved .* \([0-9.]*\) GB\/s, .*/\1/p' <<<"$out"
}
median() { printf '%s\n' "$@" | sort -g | sed -n "$(((${#} + 1) / 2))p"; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", a / b }'; }

# ucx_perftest put bandwidth, one-sided like our WRITEs; prints GB/s ("overall" MB/s / 1000).
ucx_gbps() {
  local size=$1 iters=$2 port=$((20000 + RANDOM % 20000)) out
  UCX_TLS=tcp UCX_NET_DEVICES=lo timeout 120 ucx_perftest -p "$port" >/dev/null 2>&1 &
  local server=$!
  sleep 1
  out=$(UCX_TLS=tcp UCX_NET_DEVICES=lo timeout 120 ucx_perftest 127.0.0.1 -p "$port" -t ucp_put_bw \
        -s "$size" -n "$iters" -w 4 2>&1) || { echo "$out" >&2; kill $server 2>/dev/null; exit 1; }
  wait $server || true
  awk '/^Final:/ { printf "%.3f", $7 / 1000 }' <<<"$out"
}

# Workloads: name, demo/raw arguments. single16m: one 16 MiB WRITE per round.
declare -A args=([paged64k]="--page-kib 64 --pages 512 --rounds 128"
                 [single16m]="--page-kib 16384 --pages 1 --rounds 128")
declare -A result
printf '%-12s %-10s %-34s %-34s %s\n' provider workload "engine GB/s (median: trials)" \
  "raw GB/s (median: trials)" engine/raw
for provider in "tcp;ofi_rxm" shm; do
  for w in paged64k single16m; do
    e=() r=()
    for ((i = 0; i < trials; i++)); do  # alternate so drift in the machine hits both alike
      # shellcheck disable=SC2086
      e+=("$(gbps "$demo" --provider "$provider" --busy ${args[$w]})")
      # shellcheck disable=SC2086
      r+=("$(gbps "$raw" --provider "$provider" ${args[$w]})")
    done
    em=$(median "${e[@]}") rm=$(median "${r[@]}")
    result[$provider.$w]=$em
    bytes=$([[ $w == paged64k ]] && echo 65536 || echo 16777216)
    points+=("{\"what\": \"engine $w\", \"provider\": \"$provider\", \"bytes\": $bytes, \"gbps\": $(awk -v g="$em" 'BEGIN { print g * 8 }'), \"marker\": \"^\"}")
    points+=("{\"what\": \"raw libfabric $w\", \"provider\": \"$provider\", \"bytes\": $bytes, \"gbps\": $(awk -v g="$rm" 'BEGIN { print g * 8 }'), \"marker\": \"s\"}")
    result[$provider.$w.ratio]=$(ratio "$em" "$rm")
    printf '%-12s %-10s %-34s %-34s %s\n' "$provider" "$w" "$em (${e[*]})" "$rm (${r[*]})" \
      "${result[$provider.$w.ratio]}"
  done
done

u=()
for ((i = 0; i < trials; i++)); do u+=("$(ucx_gbps 65536 20000)"); done
um=$(median "${u[@]}")
u16=$(ucx_gbps 16777216 128)
printf 'ucx_perftest ucp_put_bw (UCX_TLS=tcp): 64 KiB %s GB/s (%s), 16 MiB %s GB/s\n' "$um" "${u[*]}" "$u16"
printf 'engine/ucx on tcp: paged64k %s, single16m %s\n' "$(ratio "${result[tcp;ofi_rxm.paged64k]}" "$um")" \
  "$(ratio "${result[tcp;ofi_rxm.single16m]}" "$u16")"
points+=("{\"what\": \"ucx_perftest put\", \"provider\": \"ucx tcp\", \"bytes\": 65536, \"gbps\": $(awk -v g="$um" 'BEGIN { print g * 8 }'), \"marker\": \"D\"}")
points+=("{\"what\": \"ucx_perftest put\", \"provider\": \"ucx tcp\", \"bytes\": 16777216, \"gbps\": $(awk -v g="$u16" 'BEGIN { print g * 8 }'), \"marker\": \"D\"}")
if [[ -n $json ]]; then
  (IFS=,; echo "{\"points\": [${points[*]}]}") >"$json"
fi
echo "shm: paged64k=${result[shm.paged64k.ratio]} single16m=${result[shm.single16m.ratio]}"
echo "ratio paged64k=${result[tcp;ofi_rxm.paged64k.ratio]} single16m=${result[tcp;ofi_rxm.single16m.ratio]}" \
  "ucx=$(ratio "${result[tcp;ofi_rxm.paged64k]}" "$um")"
