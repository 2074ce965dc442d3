#!/usr/bin/env bash
# make bench-multinic: two network namespaces ("hosts") joined by 1, 2 and 4 veth pairs ("NICs"),
# each pair rate-limited with tc (tbf, RATE_MBIT each way), the engine with one libfabric domain per
# veth on each side. Reports single (sharded) and paged WRITE rates (GB/s, 1e9 bytes/s) against the
# sum of the limits (RATE_MBIT is megabits per second, as tc takes it; shown converted to GB/s).
# Ends with: aggregate nics=2 ratio=<x> nics=4 ratio=<y>  (the lower of single and paged)
# Usage: bench/multinic.sh [BUILD_DIR]; env RATE_MBIT (default 1000), TARGET_MIB (default 256).
set -euo pipefail
build=$(realpath "${1:-build}")
bench=$build/tools/fabric-bench/fabric-bench
rate=${RATE_MBIT:-1000}
target=${TARGET_MIB:-256}
work=$(mktemp -d)
A=fbench_a_$$ B=fbench_b_$$

cleanup() {
  [[ -n ${server_pid:-} ]] && kill "$server_pid" 2>/dev/null || true
  ip netns del "$A" 2>/dev/null || true
  ip netns del "$B" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

setup() {  # $1 = number of veth pairs
  local n=$1
  ip netns del "$A" 2>/dev/null || true
  ip netns del "$B" 2>/dev/null || true
  ip netns add "$A"
  ip netns add "$B"
  ip -n "$A" link set lo up
  ip -n "$B" link set lo up
  for ((k = 1; k <= n; k++)); do
    ip link add "va$k" netns "$A" type veth peer name "vb$k" netns "$B"
    ip -n "$A" addr add "10.77.$k.1/24" dev "va$k"
    ip -n "$B" addr add "10.77.$k.2/24" dev "vb$k"
    ip -n "$A" link set "va$k" up
    ip -n "$B" link set "vb$k" up
    ip netns exec "$A" tc qdisc add dev "va$k" root tbf rate "${rate}mbit" burst 256kb latency 100ms
    ip netns exec "$B" tc qdisc add dev "vb$k" root tbf rate "${rate}mbit" burst 256kb latency 100ms
  done
}

# Runs the client against a fresh server over $1 NICs; prints "single_gb_per_s paged_gb_per_s"
# (fabric-bench's GB/s column; --link-gbps takes the limit in Gbit/s, as NICs report link speed).
measure() {
  local n=$1 a_nics=() b_nics=()
  for ((k = 1; k <= n; k++)); do a_nics+=("10.77.$k.1"); b_nics+=("10.77.$k.2"); done
  ip netns exec "$B" "$bench" server --nics "${b_nics[@]}" --peers 1 --buffer-mib 128 \
    >"$work/server.log" 2>&1 &
  server_pid=$!
  for _ in $(seq 100); do grep -q 'ready:' "$work/server.log" && break; sleep 0.1; done
  local addr
  addr=$(sed -n 's/^fabric-bench server ready: //p' "$work/server.log")
  [[ -n $addr ]] || { cat "$work/server.log" >&2; exit 1; }
  ip netns exec "$A" "$bench" client "$addr" --nics "${a_nics[@]}" --only single paged \
    --single-sizes 67108864 --page-sizes 65536 --page-counts 1000 --target-mib "$target" \
    --warmup 1 --verify --link-gbps "$(awk -v r="$rate" -v n="$n" 'BEGIN { print r * n / 1000 }')" \
    --json "$work/nics$n.json" >"$work/client$n.log" 2>&1 || { cat "$work/client$n.log" >&2; exit 1; }
  wait "$server_pid" || true
  server_pid=
  cat "$work/client$n.log" >&2
  awk '$1 == "single" { s = $8 } $1 == "paged" { p = $10 } END { print s, p }' "$work/client$n.log"
}

printf '%-5s %-12s %-12s %-12s %-10s %-10s\n' nics "limit GB/s" "single GB/s" "paged GB/s" \
  "single/lim" "paged/lim" >"$work/table"
summary=aggregate
for n in 1 2 4; do
  setup "$n"
  read -r s p < <(measure "$n")
  limit=$(awk -v r="$rate" -v n="$n" 'BEGIN { printf "%.4f", r * n / 8000 }')  # Mbit/s -> GB/s
  rs=$(awk -v a="$s" -v b="$limit" 'BEGIN { printf "%.2f", a / b }')
  rp=$(awk -v a="$p" -v b="$limit" 'BEGIN { printf "%.2f", a / b }')
  printf '%-5s %-12s %-12s %-12s %-10s %-10s\n' "$n" "$limit" "$s" "$p" "$rs" "$rp" >>"$work/table"
  [[ $n -gt 1 ]] && summary+=" nics=$n ratio=$(awk -v a="$rs" -v b="$rp" 'BEGIN { print (a < b ? a : b) }')"
done
cat "$work/table"
echo "$summary"
