#!/bin/bash
# Network faults between two network namespaces (a veth pair, `tc netem` / `tbf` on both ends) for
# fabric-bench over `tcp;ofi_rxm`: data must arrive intact or the transfer fail cleanly within a
# bound; never silent corruption, never a hang. The scenarios are in scenarios.sh (README.md).
#
#   tests/netem/run.sh <build-dir>          (or: make test-netem)
#
# Runs them in this kernel if it has veth and sch_netem; otherwise (this project's CI and dev hosts:
# their kernel is built without CONFIG_NET_SCH_NETEM) in the tests/rxe qemu VM, whose Debian kernel
# has both as modules. NETEM_MODE=host|vm forces one. Other knobs: see scenarios.sh (NETEM_*).
set -euo pipefail

[ $# -ge 1 ] || { echo "usage: $0 <build-dir>" >&2; exit 2; }
if [ "$(id -u)" != 0 ]; then
  exec sudo --preserve-env=NETEM_MODE,NETEM_TIMEOUT_MS,NETEM_KILL_S,NETEM_BOUND_S,NETEM_ONLY,NETEM_FLAP_RATE,FABRIC_RXE_CACHE,HOME \
    "$0" "$@"
fi
HERE=$(cd "$(dirname "$0")" && pwd)
BUILD=$(cd "$1" && pwd)
BENCH=$BUILD/tools/fabric-bench/fabric-bench
[ -x "$BENCH" ] || { echo "$BENCH not built" >&2; exit 2; }
export DEBIAN_FRONTEND=noninteractive
T0=$EPOCHREALTIME
since() { awk -v a="$T0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }'; }

if ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
  apt-get update -qq && apt-get install -y -qq --no-install-recommends iproute2 >/dev/null
fi

# Does this kernel have veth and netem? Probe in a namespace of our own.
host_has_netem() {
  local p=netem_probe_$$ ok=1
  ip netns add "$p" 2>/dev/null || return 1
  ip -n "$p" link add pa type veth peer name pb 2>/dev/null &&
    ip netns exec "$p" tc qdisc add dev pa root netem delay 1ms 2>/dev/null && ok=0
  ip netns del "$p" 2>/dev/null
  return $ok
}

mode=${NETEM_MODE:-auto}
if [ "$mode" = auto ]; then
  if host_has_netem; then mode=host; else
    mode=vm
    echo "netem: this kernel ($(uname -r)) has no sch_netem (or veth): running the scenarios in the qemu VM"
  fi
fi

if [ "$mode" = host ]; then
  rc=0
  "$HERE/scenarios.sh" "$BENCH" || rc=$?
  echo "netem: host run took $(since)s"
  exit $rc
fi

# --- VM: the tests/rxe VM with a payload of fabric-bench, scenarios.sh and the modules ---
CACHE=${FABRIC_RXE_CACHE:-$HOME/.cache/fabric-lib/rxe}
KPKG=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/ { print $2; exit }')
if [ -z "$KPKG" ]; then apt-get update -qq; KPKG=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-[0-9]/ { print $2; exit }'); fi
[ -n "$KPKG" ] || { echo "cannot resolve linux-image-amd64 from the apt lists" >&2; exit 1; }
KV=${KPKG#linux-image-}
MODS=$CACHE/netem-modules-$KV
KOS="net/sched/sch_netem net/sched/sch_tbf drivers/net/veth"
if ! (for k in $KOS; do [ -f "$MODS/${k##*/}.ko" ] || exit 1; done); then
  dl=$(mktemp -d)
  (cd "$dl" && apt-get download -q=2 -o APT::Sandbox::User=root "$KPKG")
  dpkg-deb --fsys-tarfile "$dl"/"$KPKG"_*.deb |
    tar -x -C "$dl" $(for k in $KOS; do echo "./lib/modules/$KV/kernel/$k.ko"; done)
  mkdir -p "$MODS.tmp"
  for k in $KOS; do cp "$dl/lib/modules/$KV/kernel/$k.ko" "$MODS.tmp/"; done
  rm -rf "$MODS" "$dl"; mv "$MODS.tmp" "$MODS"
fi

# tests/rxe/run.sh copies the steps file's "binaries" from a build dir: give it one of our own
# (it also keeps its work files there, so parallel runs do not clash).
STAGE=$(mktemp -d "$BUILD/netem-vm.XXXXXX")
trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$STAGE/tools/fabric-bench" "$STAGE/netem"
cp "$BENCH" "$STAGE/tools/fabric-bench/"
cp "$HERE/scenarios.sh" "$MODS"/*.ko "$STAGE/netem/"
chmod +x "$STAGE"/netem/*
for v in TIMEOUT_MS KILL_S BOUND_S ONLY FLAP_RATE; do
  n=NETEM_$v; [ -n "${!n:-}" ] && export "FABRIC_NETEM_$v=${!n}"
done
mkdir -p "$BUILD/netem"
LOG=$BUILD/netem/vm.log
rc=0
VM_TIMEOUT=${VM_TIMEOUT:-900} "$HERE/../rxe/run.sh" "$STAGE" "$HERE/vm_steps.sh" >"$LOG" 2>&1 || rc=$?
cp "$STAGE/rxe/vm.log" "$BUILD/netem/console.log" 2>/dev/null || true
if [ $rc = 0 ] && grep -aq '^netem scenarios=' "$LOG"; then
  grep -a '^netem ' "$LOG"
else
  # The scenarios' whole output (with the logs of failed ones), or the end of the VM log.
  if grep -aq '@@ STEP netem$' "$LOG"; then
    sed -n '/@@ STEP netem$/,/@@ RESULT .*: netem$/p' "$LOG"
  else
    tail -n 40 "$LOG"
  fi
  echo "netem: VM run failed (rc=$rc)"
  rc=1
fi
echo "netem: VM run took $(since)s (log: $LOG)"
exit $rc
