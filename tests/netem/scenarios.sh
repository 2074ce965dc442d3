#!/bin/bash
# Network-fault scenarios for fabric-bench over `tcp;ofi_rxm`, run in the current kernel (as root,
# which must have veth and sch_netem). tests/netem/run.sh calls it on the host, or inside a qemu VM
# when the host kernel has no netem. Two namespaces joined by a veth pair: the client in A
# (10.77.0.1), the server in B (10.77.0.2); one fresh server per scenario.
#
#   tests/netem/scenarios.sh <fabric-bench binary>
#
# Prints `netem <scenario> result=<ok|clean-failure|HANG|CORRUPT|UNCLEAN> secs=<t> <detail>` per
# scenario (UNCLEAN: the client or the server crashed, or failed without an error message) and a
# final `netem scenarios=<n> ok=<a> clean_failures=<b> hangs=<h> corrupt=<c>`.
# Exit 1 if any scenario hung, corrupted data, failed uncleanly, or (for those that must pass)
# did not pass.
# Env: NETEM_TIMEOUT_MS (engine transfer timeout, 5000), NETEM_KILL_S (per-client `timeout`, 60),
#      NETEM_BOUND_S (a failure must end this long after the link went down, 20),
#      NETEM_FLAP_RATE (tbf rate of the link scenarios, 20mbit; none: no tbf),
#      NETEM_ONLY (space-separated scenario names), NETEM_KEEP_LOGS (directory to copy logs to).
set -uo pipefail

BENCH=$(realpath "${1:?usage: $0 <fabric-bench>}")
TMO_MS=${NETEM_TIMEOUT_MS:-5000}
KILL_S=${NETEM_KILL_S:-60}
BOUND_S=${NETEM_BOUND_S:-20}
FLAP_RATE=${NETEM_FLAP_RATE:-20mbit}
A=netem_a_$$ B=netem_b_$$
WORK=$(mktemp -d /tmp/netem.XXXXXX)
server_pid=
client_pid=

cleanup() {
  [ -n "$client_pid" ] && kill "$client_pid" 2>/dev/null
  [ -n "$server_pid" ] && kill "$server_pid" 2>/dev/null
  ip netns del "$A" 2>/dev/null
  ip netns del "$B" 2>/dev/null
  if [ -n "${NETEM_KEEP_LOGS:-}" ]; then mkdir -p "$NETEM_KEEP_LOGS" && cp "$WORK"/* "$NETEM_KEEP_LOGS"/ 2>/dev/null; fi
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

now() { echo "$EPOCHREALTIME"; }
elapsed() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }

ip netns add "$A" && ip netns add "$B" || exit 1
ip link add va netns "$A" type veth peer name vb netns "$B" || exit 1
ip -n "$A" addr add 10.77.0.1/24 dev va
ip -n "$B" addr add 10.77.0.2/24 dev vb
for ns in "$A" "$B"; do ip -n "$ns" link set lo up; done
ip -n "$A" link set va up
ip -n "$B" link set vb up

# qdisc <spec...>: the same root qdisc on both ends (each end shapes what it sends); none: removed.
qdisc() {
  ip netns exec "$A" tc qdisc del dev va root 2>/dev/null
  ip netns exec "$B" tc qdisc del dev vb root 2>/dev/null
  [ "$1" = none ] && return 0
  ip netns exec "$A" tc qdisc add dev va root "$@" && ip netns exec "$B" tc qdisc add dev vb root "$@"
}

COMMON=(--provider 'tcp;ofi_rxm' --timeout-ms "$TMO_MS" --peers 1 --buffer-mib 4)
# Two families, 16 KiB per transfer: each moves 200 x 16 KiB in its latency pass and
# 2 MiB in its bandwidth pass, then the server checks every byte of what landed.
CLIENT_ARGS=(--only single paged --single-sizes 16384 --page-sizes 4096 --page-counts 4
             --target-mib 2 --warmup 1 --verify)
# The link scenarios: smaller transfers, longer bandwidth passes (8 MiB at 20 Mbit/s: ~3.5 s).
FLAP_ARGS=(--only single paged --single-sizes 4096 --page-sizes 1024 --page-counts 4
           --target-mib 8 --warmup 1 --verify)
ROWS_EXPECTED=2

start_server() {
  : >"$WORK/$1.server"
  ip netns exec "$B" timeout -k 5 $((KILL_S + 30)) "$BENCH" server "${COMMON[@]}" --nics 10.77.0.2 \
    >"$WORK/$1.server" 2>&1 &
  server_pid=$!
  local i
  for i in $(seq 200); do grep -q 'ready:' "$WORK/$1.server" && break; sleep 0.05; done
  addr=$(sed -n 's/^fabric-bench server ready: //p' "$WORK/$1.server")
  [ -n "$addr" ]
}

# The server ends by itself (0) when the client says "bye"; after a failed client it waits and is
# stopped here (SIGTERM: 143), or ends on an error of its own (1: e.g. a reply to the dead client
# failed once the link came back), noted in server_info. A crash (134, 139, ...) sets server_crash.
server_crash= server_info=
stop_server() {
  server_crash= server_info=
  [ -n "$server_pid" ] || return 0
  local i rc=0 msg
  for i in $(seq 20); do kill -0 "$server_pid" 2>/dev/null || break; sleep 0.1; done
  kill "$server_pid" 2>/dev/null
  wait "$server_pid" 2>/dev/null || rc=$?
  server_pid=
  msg=$(grep -m1 '^fabric-bench: ' "$WORK/$1.server" | cut -c1-160)
  if [ "$rc" -ge 128 ] && [ "$rc" != 143 ]; then
    server_crash="server crashed (rc=$rc)${msg:+: $msg}"
  elif [ "$rc" != 0 ] && [ "$rc" != 143 ]; then
    server_info="server rc=$rc${msg:+: ${msg#fabric-bench: }}"
  fi
}

# What the kernel saw, summed over both namespaces: "<packets sent> <qdisc drops> <TCP segments
# retransmitted> <TCP checksum errors> <out-of-order segments queued>" (cumulative: take deltas).
counters() {
  local ns dev pk=0 dr=0 r=0 c=0 o=0
  for ns in "$A:va" "$B:vb"; do
    dev=${ns#*:} ns=${ns%%:*}
    # No process substitution: the VM's /dev has no /dev/fd.
    set -- $(ip netns exec "$ns" tc -s qdisc show dev "$dev" |
      awk '/Sent/ { p += $4; gsub(/[,(]/, " "); for (i = 1; i <= NF; i++) if ($i == "dropped") d += $(i + 1) }
           END { print p + 0, d + 0 }')
    pk=$((pk + $1)) dr=$((dr + $2))
    set -- $(ip netns exec "$ns" cat /proc/net/snmp /proc/net/netstat | awk '
      /^(Tcp|TcpExt):/ { if (!h[$1]) { for (i = 2; i <= NF; i++) k[$1, i] = $i; h[$1] = 1 }
                         else for (i = 2; i <= NF; i++) v[k[$1, i]] = $i }
      END { print v["RetransSegs"] + 0, v["InCsumErrors"] + 0, v["TCPOFOQueue"] + 0 }')
    r=$((r + $1)) c=$((c + $2)) o=$((o + $3))
  done
  echo "$pk $dr $r $c $o"
}
# delta <before> <after>: the counters of one scenario (its qdiscs are fresh: their counts start at 0).
delta() {
  local b=($1) a=($2)
  echo "qdisc pkts=$((a[0] - b[0])) drops=$((a[1] - b[1])), tcp retrans=$((a[2] - b[2])) csum_errors=$((a[3] - b[3])) ofo_queued=$((a[4] - b[4]))"
}

n=0 n_ok=0 n_clean=0 n_hang=0 n_corrupt=0 n_unclean=0 n_required_failed=0

# report <name> <required: 1|0> <rc> <secs> <log> [extra detail]  (after stop_server: server_crash, server_info)
report() {
  local name=$1 required=$2 rc=$3 secs=$4 log=$5 extra=${6:-} result detail rows bad err
  rows=$(awk '$NF == "ok" && $1 != "test"' "$log" | wc -l)
  bad=$(awk '$NF == "BAD"' "$log" | wc -l)
  err=$(grep -m1 '^fabric-bench: ' "$log" | cut -c1-160)
  if [ "$bad" -gt 0 ]; then
    result=CORRUPT detail="verify BAD in $bad row(s): $(awk '$NF == "BAD" { print $1, $2 }' "$log" | paste -sd, -)"
  elif [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    result=HANG detail="rc=$rc (killed by timeout ${KILL_S}s, or over the bound)"
  elif [ "$rc" = 0 ] && [ "$rows" -ge "$ROWS_EXPECTED" ]; then
    result=ok detail="verify ok in $rows rows"
  elif [ "$rc" != 0 ] && [ "$rc" -lt 128 ] && [ -n "$err" ]; then
    result=clean-failure detail="rc=$rc: ${err#fabric-bench: }"
  else
    result=UNCLEAN detail="rc=$rc rows_ok=$rows${err:+ ${err}}"
  fi
  # A crashed server is no clean outcome either (unless the data was already found bad).
  if [ -n "$server_crash" ] && [ "$result" != CORRUPT ] && [ "$result" != HANG ]; then
    result=UNCLEAN detail="$server_crash; client: $detail"
  fi
  [ -n "$server_info" ] && detail="$detail; $server_info"
  [ -n "$extra" ] && detail="$detail; $extra"
  echo "netem $name result=$result secs=$secs $detail"
  n=$((n + 1))
  case $result in
    ok) n_ok=$((n_ok + 1));;
    clean-failure) n_clean=$((n_clean + 1));;
    HANG) n_hang=$((n_hang + 1));;
    CORRUPT) n_corrupt=$((n_corrupt + 1));;
    UNCLEAN) n_unclean=$((n_unclean + 1));;
  esac
  [ "$required" = 1 ] && [ "$result" != ok ] && n_required_failed=$((n_required_failed + 1))
  if { [ "$required" = 1 ] && [ "$result" != ok ]; } || [[ $result == [A-Z]* ]]; then
    echo "--- $name: client log"; tail -n 20 "$log"
    echo "--- $name: server log"; tail -n 10 "$WORK/$name.server"
  fi
}

wanted() { [ -z "${NETEM_ONLY:-}" ] || [[ " $NETEM_ONLY " == *" $1 "* ]]; }

# steady <name> <qdisc spec...|none>: a fault for the whole run; the run must pass with verify ok.
steady() {
  local name=$1 t0 rc; shift
  wanted "$name" || return 0
  qdisc "$@" || { echo "netem $name: tc qdisc add $* failed" >&2; n_required_failed=$((n_required_failed + 1)); return; }
  if ! start_server "$name"; then
    stop_server "$name"; report "$name" 1 1 0 "$WORK/$name.server" "server did not start"; return
  fi
  local c0; c0=$(counters)
  t0=$(now)
  ip netns exec "$A" timeout -k 5 "$KILL_S" "$BENCH" client "$addr" "${COMMON[@]}" --nics 10.77.0.1 \
    "${CLIENT_ARGS[@]}" >"$WORK/$name.client" 2>&1
  rc=$?
  local secs; secs=$(elapsed "$t0" "$(now)")
  local kernel; kernel=$(delta "$c0" "$(counters)")
  stop_server "$name"
  report "$name" 1 "$rc" "$secs" "$WORK/$name.client" "qdisc: $*; $kernel"
  qdisc none
}

# flap <name> <wait_s> <down_s|forever>: the server's end of the veth goes down wait_s seconds after
# the client has finished its first family (so the second one is in flight: 0 s hits its latency
# pass, 1 s its bandwidth pass), and up again after down_s seconds. Both ends are rate-limited
# (tbf) so that the second family lasts a few seconds. Passing or a clean failure are both fine;
# a failure must end within BOUND_S of the link going down.
flap() {
  local name=$1 wait_s=$2 down=$3 t0 td rc i extra="" up_at=""
  wanted "$name" || return 0
  if [ "$FLAP_RATE" = none ]; then qdisc none; else qdisc tbf rate "$FLAP_RATE" burst 32kb latency 200ms; fi
  if ! start_server "$name"; then
    stop_server "$name"; report "$name" 0 1 0 "$WORK/$name.server" "server did not start"; return
  fi
  local log=$WORK/$name.client
  t0=$(now)
  ip netns exec "$A" timeout -k 5 "$KILL_S" "$BENCH" client "$addr" "${COMMON[@]}" --nics 10.77.0.1 \
    "${FLAP_ARGS[@]}" >"$log" 2>&1 &
  client_pid=$!
  # Down once the first row is out (the first family verified), while the client still runs.
  while kill -0 "$client_pid" 2>/dev/null && ! awk '$1 == "single"' "$log" | grep -q .; do sleep 0.02; done
  sleep "$wait_s"
  td=$(now)
  ip -n "$B" link set vb down
  if [ "$down" != forever ]; then
    while kill -0 "$client_pid" 2>/dev/null &&
      awk -v a="$td" -v b="$(now)" -v d="$down" 'BEGIN { exit !(b - a < d) }'; do sleep 0.05; done
    ip -n "$B" link set vb up
    up_at=" up after $(elapsed "$td" "$(now)")s"
  fi
  wait "$client_pid"; rc=$?
  client_pid=
  local t_end; t_end=$(now)
  local after; after=$(elapsed "$td" "$t_end")
  extra="link down at $(elapsed "$t0" "$td")s,$up_at ended ${after}s after down"
  if awk -v a="$after" -v b="$BOUND_S" 'BEGIN { exit !(a > b) }' && [ "$rc" != 0 ]; then
    # Over the bound: a failure that took too long is a hang for this test.
    extra="$extra, over the ${BOUND_S}s bound"
    rc=124
  fi
  [ "$down" = forever ] && [ "$rc" = 0 ] && extra="$extra (passed: the link went down after the last transfer?)"
  ip -n "$B" link set vb up
  stop_server "$name"
  report "$name" 0 "$rc" "$(elapsed "$t0" "$t_end")" "$log" "$extra"
  qdisc none
}

steady baseline none
steady loss netem loss 2%
steady delay netem delay 5ms 2ms
steady reorder netem delay 5ms reorder 25% 50%
steady duplicate netem duplicate 1%
steady corrupt netem corrupt 0.5%
flap link-flap 0 3
flap link-down 0 forever
flap link-down-bw 1 forever

echo "netem scenarios=$n ok=$n_ok clean_failures=$n_clean hangs=$n_hang corrupt=$n_corrupt$([ $n_unclean -gt 0 ] && echo " unclean=$n_unclean")"
[ $n_hang = 0 ] && [ $n_corrupt = 0 ] && [ $n_unclean = 0 ] && [ $n_required_failed = 0 ]
