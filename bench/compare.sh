#!/usr/bin/env bash
# make bench-compare: the engine against a raw libfabric loop (same provider, same endpoint setup,
# same WRITEs, same number in flight) on tcp;ofi_rxm and shm, and against UCX's ucx_perftest
# (UCX_TLS=tcp, the engine under NIXL) on loopback; alternating trials, medians, ratios.
# And the peers (bench/peers/, installed into BUILD_DIR/peers-venv on first use): the same two
# workloads through NIXL (UCX backend, UCX_TLS=tcp on loopback and UCX_TLS=sm) and Mooncake Transfer
# Engine (tcp), their trials alternating with the engine's (tcp;ofi_rxm for *_tcp, shm for sm).
# The engine busy-polls on tcp and polls adaptively on shm (engine_poll below says why). On shm it
# also runs with EngineConfig::host_ipc (fabric-demo --host-ipc, adaptive polling).
# Every buffer, ours, the raw loop's and the peers' (numpy), is advised for huge pages alike.
# UCCL's P2P engine is not among the peers: it needs a CUDA driver and an RDMA NIC, and this machine
# has neither (docs/benchmarks.md, "tcp against Mooncake", says what was tried).
# Ends with: ratio paged64k=<engine/raw> single16m=<engine/raw> ucx=<engine/ucx>  (tcp;ofi_rxm)
#            peers paged64k nixl_tcp=<ours/theirs> nixl_sm=<ours/theirs> mooncake_tcp=<ours/theirs>
#            peers single16m nixl_tcp=... nixl_sm=... mooncake_tcp=...   ("failed" where a peer failed)
#            host_ipc: paged64k nixl_sm=<ours/theirs> single16m nixl_sm=<ours/theirs> (...)
# Every figure is GB/s (1e9 bytes per second), in the tables and in the JSON (`gb_per_s`).
# Usage: bench/compare.sh [BUILD_DIR] [TRIALS] [JSON_OUT]  (JSON: the medians, for bench/plot.py)
set -euo pipefail
build=${1:-build}
trials=${2:-5}
json=${3:-}
points=()
demo=$build/tools/demo/fabric-demo
raw=$build/bench/raw-paged-loop

# One trial; prints GB/s. A failed or unverified run aborts with its output.
gb_per_s() {
  local out
  if ! out=$("$@" 2>&1) || ! grep -q 'bytes: OK$' <<<"$out"; then
    printf '%s\nFAILED: %s\n' "$out" "$*" >&2
    exit 1
  fi
  sed -n 's/^moved .* \([0-9.]*\) GB\/s, .*/\1/p' <<<"$out"
}
median() { printf '%s\n' "$@" | sort -g | sed -n "$(((${#} + 1) / 2))p"; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", a / b }'; }

# ucx_perftest put bandwidth, one-sided like our WRITEs; prints GB/s. Its "overall" column says MB/s
# but counts 2^20 bytes (perftest.c divides by 1024 * 1024): x 1048576 / 1e9.
ucx_gb_per_s() {
  local size=$1 iters=$2 port=$((20000 + RANDOM % 20000)) out
  UCX_TLS=tcp UCX_NET_DEVICES=lo timeout 120 ucx_perftest -p "$port" >/dev/null 2>&1 &
  local server=$!
  sleep 1
  out=$(UCX_TLS=tcp UCX_NET_DEVICES=lo timeout 120 ucx_perftest 127.0.0.1 -p "$port" -t ucp_put_bw \
        -s "$size" -n "$iters" -w 4 2>&1) || { echo "$out" >&2; kill $server 2>/dev/null; exit 1; }
  wait $server || true
  awk '/^Final:/ { printf "%.3f", $7 * 1048576 / 1e9 }' <<<"$out"
}

# The peers (bench/peers/*.py): each driver runs an initiator and a target process, moves the
# workload through the peer's own API, verifies every byte on the target and prints a `moved ...
# GB/s, bytes: OK` line for gb_per_s(). Their trials alternate with the engine's on the provider they
# are compared with (peer_ours). A peer that cannot be installed or fails prints why and reads
# "failed"; it never stops the comparison.
venv=$build/peers-venv py=$build/peers-venv/bin/python peers_ok=1
if ! bench/peers/setup.sh "$venv"; then
  echo "peers: NOT INSTALLED (bench/peers/setup.sh $venv failed, see above): every peer reads failed"
  peers_ok=0
fi
peer_log=$(mktemp)
trap 'rm -f "$peer_log"' EXIT
# name -> command; the driver takes the workload's fabric-demo arguments. NIXL runs without its
# progress thread, both processes polling (as nixlbench does by default, and as fabric-demo --busy
# polls): faster here than its progress thread. UCX_TLS=sm has no transport with peer failure
# detection, which NIXL's default UCX error mode ("peer") requires, so sm runs with mode "none".
declare -A peer_cmd=(
  [nixl_tcp]="env UCX_TLS=tcp UCX_NET_DEVICES=lo $py bench/peers/nixl_bench.py --prog-thread 0"
  [nixl_sm]="env UCX_TLS=sm $py bench/peers/nixl_bench.py --prog-thread 0 --param ucx_error_handling_mode=none"
  [mooncake_tcp]="$py bench/peers/mooncake_bench.py --protocol tcp")
declare -A peer_ours=([nixl_tcp]="tcp;ofi_rxm" [nixl_sm]=shm [mooncake_tcp]="tcp;ofi_rxm")
peers=(nixl_tcp nixl_sm mooncake_tcp)
declare -A pt  # peer.workload -> its trials
peer_trial() {  # name workload trial: prints GB/s, or "failed" (and why, on stderr)
  local v
  # shellcheck disable=SC2086  # the command and the workload arguments are word lists
  if ((peers_ok)) && v=$(gb_per_s timeout 600 ${peer_cmd[$1]} ${args[$2]} 2>"$peer_log"); then
    echo "$v"
  else
    ((peers_ok)) && { echo "peers: $1 $2 trial $3 FAILED:"; tail -n 4 "$peer_log" | sed 's/^/  /'; } >&2
    echo failed
  fi
}
# Workloads: name, demo/raw arguments. single16m: one 16 MiB WRITE per round.
declare -A args=([paged64k]="--page-kib 64 --pages 512 --rounds 128"
                 [single16m]="--page-kib 16384 --pages 1 --rounds 128")
declare -A result
# The engine's polling per provider, the faster on the 2-core VM (docs/benchmarks.md has both):
# on tcp busy workers (as NIXL's loops poll); on shm adaptive, since there the target's worker
# makes the copy (libfabric 1.17 pulls every WRITE with process_vm_readv) and busy workers and
# the callback thread, four threads, leave it less than a core (single 16 MiB: 10-12 GB/s busy
# against 21-24 adaptive).
declare -A engine_poll=(["tcp;ofi_rxm"]=--busy [shm]="")
echo "engine polling: tcp;ofi_rxm busy, shm adaptive, host_ipc adaptive; the raw loop and the peers busy"
printf '%-12s %-10s %-34s %-34s %s\n' provider workload "engine GB/s (median: trials)" \
  "raw GB/s (median: trials)" engine/raw
for provider in "tcp;ofi_rxm" shm; do
  for w in paged64k single16m; do
    e=() r=() h=()
    for ((i = 0; i < trials; i++)); do  # alternate so drift in the machine hits both alike
      # shellcheck disable=SC2086
      e+=("$(gb_per_s "$demo" --provider "$provider" ${engine_poll[$provider]} ${args[$w]})")
      # On shm, also the bytes through host_ipc (the initiator's process_vm_writev into the target's
      # pages). Adaptive polling: the target has no copy to make, and a spinning target would take
      # one of the two cores from the initiator's copies.
      # shellcheck disable=SC2086
      if [[ $provider == shm ]]; then h+=("$(gb_per_s "$demo" --provider shm --host-ipc ${args[$w]})"); fi
      # shellcheck disable=SC2086
      r+=("$(gb_per_s "$raw" --provider "$provider" ${args[$w]})")
      for p in "${peers[@]}"; do  # the peers compared with this provider, in the same rotation
        if [[ ${peer_ours[$p]} == "$provider" ]]; then pt[$p.$w]+="$(peer_trial "$p" "$w" "$i") "; fi
      done
    done
    em=$(median "${e[@]}") rm=$(median "${r[@]}")
    result[$provider.$w]=$em
    bytes=$([[ $w == paged64k ]] && echo 65536 || echo 16777216)
    points+=("{\"what\": \"engine $w\", \"provider\": \"$provider\", \"bytes\": $bytes, \"gb_per_s\": $(awk -v g="$em" 'BEGIN { print g + 0 }'), \"marker\": \"^\"}")
    points+=("{\"what\": \"raw libfabric $w\", \"provider\": \"$provider\", \"bytes\": $bytes, \"gb_per_s\": $(awk -v g="$rm" 'BEGIN { print g + 0 }'), \"marker\": \"s\"}")
    result[$provider.$w.ratio]=$(ratio "$em" "$rm")
    printf '%-12s %-10s %-34s %-34s %s\n' "$provider" "$w" "$em (${e[*]})" "$rm (${r[*]})" \
      "${result[$provider.$w.ratio]}"
    if ((${#h[@]})); then
      hm=$(median "${h[@]}")
      result[host_ipc.$w]=$hm
      points+=("{\"what\": \"engine host_ipc $w\", \"provider\": \"shm+host_ipc\", \"bytes\": $bytes, \"gb_per_s\": $(awk -v g="$hm" 'BEGIN { print g + 0 }'), \"marker\": \"P\"}")
      printf '%-12s %-10s %-34s %-34s %s\n' "host_ipc" "$w" "$hm (${h[*]})" "$rm (shm raw, above)" "$(ratio "$hm" "$rm")"
    fi
  done
done

u=()
for ((i = 0; i < trials; i++)); do u+=("$(ucx_gb_per_s 65536 20000)"); done
um=$(median "${u[@]}")
u16=$(ucx_gb_per_s 16777216 128)
printf 'ucx_perftest ucp_put_bw (UCX_TLS=tcp): 64 KiB %s GB/s (%s), 16 MiB %s GB/s\n' "$um" "${u[*]}" "$u16"
printf 'engine/ucx on tcp: paged64k %s, single16m %s\n' "$(ratio "${result[tcp;ofi_rxm.paged64k]}" "$um")" \
  "$(ratio "${result[tcp;ofi_rxm.single16m]}" "$u16")"
points+=("{\"what\": \"ucx_perftest put\", \"provider\": \"ucx tcp\", \"bytes\": 65536, \"gb_per_s\": $(awk -v g="$um" 'BEGIN { print g + 0 }'), \"marker\": \"D\"}")
points+=("{\"what\": \"ucx_perftest put\", \"provider\": \"ucx tcp\", \"bytes\": 16777216, \"gb_per_s\": $(awk -v g="$u16" 'BEGIN { print g + 0 }'), \"marker\": \"D\"}")

# NIXL's LIBFABRIC backend is not among the peers: say whether it starts here, and why not.
if ((peers_ok)); then
  lf=$("$py" bench/peers/nixl_bench.py --backend LIBFABRIC --probe 2>&1 | grep '^nixl LIBFABRIC' || true)
  lf=${lf:-"nixl LIBFABRIC backend: the probe gave no answer"}
else
  lf="nixl LIBFABRIC backend: not probed (NIXL is not installed)"
fi
echo "$lf; not measured"
printf '%-12s %-10s %-34s %-20s %s\n' peer workload "peer GB/s (median: trials)" "ours GB/s" ours/peer
declare -A peer_ratio
for w in paged64k single16m; do
  for p in "${peers[@]}"; do
    mapfile -t ok < <(tr ' ' '\n' <<<"${pt[$p.$w]}" | grep -E '^[0-9.]+$' || true)
    ours=${result[${peer_ours[$p]}.$w]}
    if ((${#ok[@]})); then
      pm=$(median "${ok[@]}") peer_ratio[$p.$w]=$(ratio "$ours" "$pm")
      bytes=$([[ $w == paged64k ]] && echo 65536 || echo 16777216)
      points+=("{\"what\": \"$p $w\", \"provider\": \"peer\", \"bytes\": $bytes, \"gb_per_s\": $(awk -v g="$pm" 'BEGIN { print g + 0 }'), \"marker\": \"v\"}")
    else
      pm=failed peer_ratio[$p.$w]=failed
    fi
    printf '%-12s %-10s %-34s %-20s %s\n' "$p" "$w" "$pm (${pt[$p.$w]% })" "$ours (${peer_ours[$p]})" \
      "${peer_ratio[$p.$w]}"
    if [[ $p == nixl_sm ]]; then  # the same peer against our host_ipc row
      peer_ratio[host_ipc.$w]=$([[ $pm == failed ]] && echo failed || ratio "${result[host_ipc.$w]}" "$pm")
      printf '%-12s %-10s %-34s %-20s %s\n' "$p" "$w" "$pm" "${result[host_ipc.$w]} (host_ipc)" "${peer_ratio[host_ipc.$w]}"
    fi
  done
done

if [[ -n $json ]]; then
  (IFS=,; echo "{\"points\": [${points[*]}]}") >"$json"
fi
echo "shm: paged64k=${result[shm.paged64k.ratio]} single16m=${result[shm.single16m.ratio]}"
echo "ratio paged64k=${result[tcp;ofi_rxm.paged64k.ratio]} single16m=${result[tcp;ofi_rxm.single16m.ratio]}" \
  "ucx=$(ratio "${result[tcp;ofi_rxm.paged64k]}" "$um")"
for w in paged64k single16m; do
  echo "peers $w nixl_tcp=${peer_ratio[nixl_tcp.$w]} nixl_sm=${peer_ratio[nixl_sm.$w]}" \
    "mooncake_tcp=${peer_ratio[mooncake_tcp.$w]}"
done
echo "host_ipc: paged64k nixl_sm=${peer_ratio[host_ipc.paged64k]} single16m nixl_sm=${peer_ratio[host_ipc.single16m]}" \
  "(ours through host_ipc, adaptive polling, / NIXL-UCX sm)"
