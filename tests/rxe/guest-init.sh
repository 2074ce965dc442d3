#!/bin/bash
# /init of the rxe test VM (copied into the initramfs by run.sh). Brings up Soft-RoCE device rxe0 on a
# dummy netdev, runs the steps file, prints @@ markers that run.sh parses, then powers off.
export PATH=/usr/sbin:/usr/bin HOME=/root
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev; mount -t tmpfs tmp /tmp
cd /tmp

up() { cut -d' ' -f1 /proc/uptime; }
rc_all=0
result() {  # result <rc> <start-uptime> <name>
  echo "@@ RESULT rc=$1 t=$(awk -v a="$2" -v b="$(up)" 'BEGIN { printf "%.2f", b - a }')s: $3"
  [ "$1" = 0 ] || rc_all=1
}

# step <name> <timeout-secs> <command...>: output goes straight to the console.
step() {
  local name=$1 secs=$2 s rc; shift 2
  echo "@@ STEP $name"
  s=$(up); timeout -k 5 "$secs" "$@"; rc=$?
  result $rc "$s" "$name"
}

# pair <name> <timeout-secs> <command...>: a perftest-style server/client pair on rxe0. The server is
# the command as given, the client the same command plus 127.0.0.1; the client starts once the server
# listens on perftest's port 18515 (round trips are ~8 ms under TCG, so do not race it).
pair() {
  local name=$1 secs=$2 s rc sp i; shift 2
  echo "@@ STEP $name"
  timeout -k 5 "$secs" "$@" > /tmp/server.log 2>&1 & sp=$!
  for i in $(seq 200); do ss -ltn | grep -q ':18515 ' && break; sleep 0.1; done
  s=$(up); timeout -k 5 "$secs" "$@" 127.0.0.1; rc=$?
  if ! wait $sp; then echo "-- server of $name failed:"; cat /tmp/server.log; [ $rc != 0 ] || rc=1; fi
  result $rc "$s" "$name"
}

# rxe_link_pair: two more Soft-RoCE devices, rxe1 on fva (198.51.100.1) and rxe2 on fvb
# (198.51.100.2), the two ends of a veth pair, for tests that break the link between two devices
# (`tc qdisc add dev fva root netem loss 100%` drops rxe1 -> rxe2; fvb the other way). rxe0 on its
# dummy netdev only reaches itself (rxe hands a packet to its own device without any netdev), and
# two devices in one kernel do not reach each other by default either: the destination is a local
# address, so the route goes through lo, and rxe drops what arrives on a netdev it does not sit on.
# Policy routing sends each one's locally generated traffic out of its own veth end instead
# (tables 10 and 11, ahead of the local table), static neighbours save ARP, and accept_local lets
# the other end take packets whose source is a local address. Sets FABRIC_LINK_DEVICES.
rxe_link_pair() {
  modprobe -a veth sch_netem || return 1
  ip link add fva type veth peer name fvb || return 1
  local s
  for s in all.rp_filter=0 default.rp_filter=0 all.accept_local=1; do sysctl -qw net.ipv4.conf.$s; done
  for s in fva fvb; do sysctl -qw net.ipv4.conf.$s.rp_filter=0 net.ipv4.conf.$s.accept_local=1; done
  ip addr add 198.51.100.1/24 dev fva && ip addr add 198.51.100.2/24 dev fvb || return 1
  ip link set fva up && ip link set fvb up || return 1
  ip neigh replace 198.51.100.2 lladdr "$(cat /sys/class/net/fvb/address)" dev fva nud permanent
  ip neigh replace 198.51.100.1 lladdr "$(cat /sys/class/net/fva/address)" dev fvb nud permanent
  ip route add 198.51.100.2 dev fva src 198.51.100.1 table 10
  ip route add 198.51.100.1 dev fvb src 198.51.100.2 table 11
  ip rule add pref 10 iif lo to 198.51.100.2 lookup 10
  ip rule add pref 11 iif lo to 198.51.100.1 lookup 11
  ip rule add pref 100 lookup local && ip rule del pref 0 lookup local || return 1
  rdma link add rxe1 type rxe netdev fva && rdma link add rxe2 type rxe netdev fvb || return 1
  export FABRIC_LINK_DEVICES="rxe1:fva,rxe2:fvb"
}

echo "@@ INIT_START uptime=$(up)"
[ -f /opt/fabric/env.sh ] && . /opt/fabric/env.sh && sed 's/^export /env: /' /opt/fabric/env.sh

# crc32_generic first: rxe computes its ICRC with it and `rdma link add` fails without it.
step modprobe 60 modprobe -a crc32_generic rdma_rxe
step modprobe-dummy 60 modprobe dummy numdummies=0
ip link set lo up
ip link add rxenet0 type dummy && ip link set rxenet0 up
ip addr add 192.0.2.1/24 dev rxenet0   # TEST-NET-1: exists only inside this NIC-less VM
# One rxe device per VM: two rxe devices in one VM do not reach each other.
step rdma-link-add 60 rdma link add rxe0 type rxe netdev rxenet0
ibv_devinfo -v | grep -E 'hca_id|state:|active_mtu|GID\['

. /opt/fabric/steps.sh || { echo "@@ RESULT rc=1 t=0s: steps file"; rc_all=1; }

echo "@@ INIT_END rc_all=$rc_all uptime=$(up)"
echo o > /proc/sysrq-trigger
sleep 30
