#!/usr/bin/env bash
# fabric-kv-bench against the same KV-cache workload through NVIDIA NIXL (bench/kv_nixl.py), side by
# side, at --tokens 4096 and 16384, the same --compute-us for both.
#
# Transports, so that each row compares like with like:
#   tcp: ours on "tcp;ofi_rxm" over 127.0.0.1, NIXL with UCX_TLS=tcp UCX_NET_DEVICES=lo (without
#        UCX_NET_DEVICES, UCX splits the puts across lo and eth0, two sockets to this same host);
#   shm: NIXL with UCX's defaults, where UCX picks cma (process_vm_writev, a kernel copy between
#        the processes' memory) for the puts and tcp/lo for the notifications (its shared-memory
#        transports lack the peer failure detection that NIXL's default error mode asks for); so
#        ours runs on "shm" for that row. kv_nixl.py's header says what UCX chose; it is shown.
# Polling: ours as fabric-kv-bench defaults (adaptive workers; FABRIC_ARGS=--busy for busy ones);
# NIXL as kv_nixl.py defaults: no progress thread, the prefill thread polls both agents all through
# each layer's compute wait (its best case here; NIXL_ARGS="--prog-thread 1" or "--poll layer").
# "tt+" is what TTFT pays: from the first layer's compute to everything landed, less layers x
# compute. NIXL's exposed time alone flatters it: UCX copies the data inside transfer() over cma,
# and over tcp writes to the socket there and inside check_xfer_state, all on the prefill thread,
# which stretches the compute itself (a poll can run well past a layer's deadline); kv_nixl.py
# measures tt+. Ours posts in microseconds and its application thread only spins, so its tt+ is
# exposed + layers x post. Every run verifies every byte; a failed run reads "failed", exit 1.
# Ends with, per T (ratios ours/NIXL: below 1 is ours lower):
#   kv-vs-nixl tokens=<T> exposed_ratio=<fabric/nixl> post_ratio=<fabric/nixl>       (tcp row)
#   kv-vs-nixl-shm tokens=<T> exposed_ratio=<fabric/nixl> post_ratio=<fabric/nixl>   (shm row)
# Usage: bench/kv_compare.sh BUILD_DIR [COMPUTE_US]   (env: TRIALS=1, medians of that many runs;
#        SEND_AT; PYTHON=python3; FABRIC_ARGS, NIXL_ARGS: extra arguments for one side)
set -euo pipefail
build=${1:?usage: bench/kv_compare.sh BUILD_DIR [COMPUTE_US]}
compute=${2:-1000}
trials=${TRIALS:-1}
py=${PYTHON:-python3}
kv=$build/bench/fabric-kv-bench
[[ -x $kv ]] || { echo "kv_compare: no $kv (build the fabric-kv-bench target)" >&2; exit 1; }
kv=$(cd "$(dirname "$kv")" && pwd)/fabric-kv-bench
cd "$(dirname "$0")/.."  # the repository root, for bench/kv_nixl.py

# NIXL from PyPI when missing. --no-deps: nixl-cu13 requires torch, which host memory never
# touches (nixl_cu13 imports it only if the caller already has); numpy is all kv_nixl.py needs.
# 1.5.1 is the version kv_nixl.py was written against (NIXL_PIP to change it).
if ! "$py" -c 'import nixl_cu13, numpy' 2>/dev/null; then
  echo "kv_compare: installing ${NIXL_PIP:-nixl-cu13==1.5.1} with pip" >&2
  "$py" -m pip install --quiet --disable-pip-version-check numpy
  "$py" -m pip install --quiet --disable-pip-version-check --no-deps "${NIXL_PIP:-nixl-cu13==1.5.1}"
  "$py" -c 'import nixl_cu13' || { echo "kv_compare: nixl_cu13 still does not import" >&2; exit 1; }
fi

# Where a layer's K and V go out: fabric-kv-bench's --send-at (0.5 by default: after attention,
# the MLP follows), exposed timed from the end of the compute; kv_nixl.py does the same. SEND_AT
# sets it for both. A fabric-kv-bench from before --send-at sends at the end of each layer and
# times exposed from the last post: NIXL then runs --send-at 1 (timed from the end of the compute,
# after its last post returned, which post times of a millisecond or two make a little kinder).
ours_send=() nixl_send=()
if "$kv" --help 2>&1 | grep -q -- --send-at; then
  if [[ -n ${SEND_AT:-} ]]; then ours_send=(--send-at "$SEND_AT") nixl_send=(--send-at "$SEND_AT"); fi
  send_note="K and V sent at ${SEND_AT:-0.5} of each layer's compute, exposed from the end of the compute (both)"
else
  nixl_send=(--send-at 1)
  send_note="this fabric-kv-bench has no --send-at (sends after each layer, exposed from its last post); NIXL runs --send-at 1"
fi

log=$(mktemp)
trap 'rm -f "$log"' EXIT
status=0
# One run: prints "exposed_ms end_of_prefill_ms post_us_per_layer ttft_extra_ms" from its output,
# or "failed" (with the run's output on stderr). ttft_extra: from the first layer's compute to
# everything landed, less layers x compute. kv_nixl.py measures it ("first compute to complete");
# for fabric-kv-bench it is exposed + layers x post (its application thread only spins and posts).
run() {
  local line extra
  if "$@" >"$log" 2>&1 && line=$(grep -E '^(kv|nixl) layers=' "$log" | tail -n 1) && [[ -n $line ]]; then
    extra=$(sed -n 's/.*first compute to complete \([0-9.-]*\) ms more than.*/\1/p' "$log" | head -n 1)
    sed -E 's/.* layers=([0-9]+) .* exposed_ms=([0-9.]+) end_of_prefill_ms=([0-9.]+) post_us_per_layer=([0-9.]+).*/\2 \3 \4 \1/' \
      <<<"$line" | awk -v x="$extra" '{ printf "%s %s %s %s\n", $1, $2, $3, x != "" ? x : sprintf("%.3f", $1 + $4 * $3 / 1000) }'
  else
    { echo "kv_compare: FAILED: $*"; tail -n 8 "$log"; } >&2
    echo failed
  fi
}
median() { printf '%s\n' "$@" | sort -g | sed -n "$(((${#} + 1) / 2))p"; }
# TRIALS runs of one command: prints the median of each field ("failed" if any run failed).
trial() {
  local e=() f=() p=() x=() r a b c d
  for ((i = 0; i < trials; i++)); do
    r=$(run "$@")
    [[ $r == failed ]] && { echo failed; return; }
    read -r a b c d <<<"$r"
    e+=("$a") f+=("$b") p+=("$c") x+=("$d")
  done
  echo "$(median "${e[@]}") $(median "${f[@]}") $(median "${p[@]}") $(median "${x[@]}")"
}
# a/b; exposed can be 0 (everything landed before the compute ended): 0/0 reads 1, x/0 inf.
ratio() {
  awk -v a="$1" -v b="$2" 'BEGIN { if (a == "failed" || b == "failed") print "failed"
                                   else if (b == 0) print (a == 0 ? "1.000" : "inf")
                                   else printf "%.3f", a / b }'
}

echo "kv_compare: fabric-kv-bench ($kv${FABRIC_ARGS:+ $FABRIC_ARGS}; adaptive polling unless that says --busy) against"
echo "  bench/kv_nixl.py (NIXL UCX backend, one process, two agents; ${NIXL_ARGS:-its defaults: no progress thread, polled during compute}),"
echo "  compute $compute us per layer, $trials trial(s) each (medians); ms unless marked us; $send_note"
fmt='%-6s %-4s %-30s %9s %9s %9s %9s %9s %9s %9s %9s %8s\n'
# shellcheck disable=SC2059  # the format is ours
printf "$fmt" tokens row "nixl transport (UCX's choice)" "ours exp" "nixl exp" "ours eop" "nixl eop" \
  "ours us" "nixl us" "ours tt+" "nixl tt+" "tt+ o/n"
summary=()
for T in 4096 16384; do
  for row in tcp shm; do
    if [[ $row == tcp ]]; then provider="tcp;ofi_rxm" env=(env UCX_TLS=tcp UCX_NET_DEVICES=lo)
    else provider=shm env=(env -u UCX_TLS -u UCX_NET_DEVICES); fi
    # shellcheck disable=SC2086  # the extra arguments are word lists
    ours=$(trial "$kv" --provider "$provider" --tokens "$T" --compute-us "$compute" "${ours_send[@]}" ${FABRIC_ARGS:-})
    # shellcheck disable=SC2086
    theirs=$(trial "${env[@]}" "$py" bench/kv_nixl.py --tokens "$T" --compute-us "$compute" "${nixl_send[@]}" \
             ${NIXL_ARGS:-})
    transport=$(sed -n 's/^nixl-kv-bench: NIXL [^ ]* UCX backend ([^:]*: \([^)]*\)).*/\1/p' "$log" | head -n 1 |
                sed 's/put over /put /; s/notifications over /notif /')
    [[ $ours == failed || $theirs == failed ]] && status=1
    read -r oe of op ox <<<"$ours"
    read -r ne nf np nx <<<"$theirs"
    [[ $ours == failed ]] && of=failed op=failed ox=failed
    [[ $theirs == failed ]] && nf=failed np=failed nx=failed
    # shellcheck disable=SC2059
    printf "$fmt" "$T" "$row" "${transport:-unknown}" "$oe" "$ne" "$of" "$nf" "$op" "$np" "$ox" "$nx" \
      "$(ratio "$ox" "$nx")"
    name="kv-vs-nixl"
    if [[ $row == shm ]]; then name="kv-vs-nixl-shm"; fi
    summary+=("$name tokens=$T exposed_ratio=$(ratio "$oe" "$ne") post_ratio=$(ratio "$op" "$np")")
  done
done
echo "rows: tcp = ours tcp;ofi_rxm (loopback TCP) vs NIXL UCX_TLS=tcp UCX_NET_DEVICES=lo;" \
  "shm = ours shm vs NIXL with UCX's default choice (transport column)"
echo "exp: exposed after the compute; eop: end of prefill (all sent after the last layer); us: post per layer;" \
  "tt+: what TTFT pays, first compute to all landed less layers x compute (ours: exp + layers x post); o/n: ours/NIXL"
printf '%s\n' "${summary[@]}"
exit $status
