#!/bin/bash
# Runs project test binaries inside a qemu VM with Soft-RoCE (rdma_rxe), because this host has no RDMA
# NIC and its kernel has no RDMA support. The VM has no network card: RoCE traffic is rxe loopback on a
# dummy netdev inside the guest.
#
#   tests/rxe/run.sh <build-dir> [guest-steps-file]     (default steps: tests/rxe/steps.sh)
#
# Env: FABRIC_RXE_CACHE (kernel + rootfs cache), VM_TIMEOUT (s, 900), MEM (2G), SMP (2).
#      Every FABRIC_* variable is exported inside the guest as well.
# See tests/rxe/README.md for the steps file format.
set -euo pipefail

[ $# -ge 1 ] || { echo "usage: $0 <build-dir> [guest-steps-file]" >&2; exit 2; }
HERE=$(cd "$(dirname "$0")" && pwd)
BUILD=$(cd "$1" && pwd)
STEPS=$(realpath "${2:-$HERE/steps.sh}")
CACHE=${FABRIC_RXE_CACHE:-$HOME/.cache/fabric-lib/rxe}
WORK=$BUILD/rxe
mkdir -p "$CACHE" "$WORK"
SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
export DEBIAN_FRONTEND=noninteractive

T0=$EPOCHREALTIME
since() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }'; }
log() { echo "== [$(since "$T0")s] $*"; }

# --- 1. host tools --------------------------------------------------------------------------------
# xz-utils unpacks the kernel image (step 2); it is nearly always present already.
missing=""
for p in qemu-system-x86 mmdebstrap kmod cpio xz-utils; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing="$missing $p"
done
apt_updated=0
if [ -n "$missing" ]; then
  log "installing host packages:$missing"
  $SUDO apt-get update -qq && apt_updated=1
  $SUDO apt-get install -y -qq --no-install-recommends $missing >/dev/null
fi

# --- 2. kernel ------------------------------------------------------------------------------------
# Debian's generic kernel ships rdma_rxe (the -cloud flavour does not). Follow the meta-package, so a
# kernel update in the archive changes KV and with it every cache key below. apt-cache reads the local
# package lists; refresh them only when they cannot answer.
kernel_pkg() { apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/ { print $2; exit }'; }
KPKG=$(kernel_pkg)
if [ -z "$KPKG" ] && [ $apt_updated = 0 ]; then $SUDO apt-get update -qq; KPKG=$(kernel_pkg); fi
[ -n "$KPKG" ] || { echo "cannot resolve linux-image-amd64 from the apt lists" >&2; exit 1; }
KV=${KPKG#linux-image-}
VMLINUX=$CACHE/vmlinux-$KV
MODDIR=$CACHE/modules-$KV
# Only what rxe needs: crc32_generic provides the ICRC hash (without it `rdma link add` fails with
# "No such file or directory"), dummy is the netdev rxe sits on; veth and sch_netem carry the
# two-device link that the network-fault tests break (guest-init.sh, rxe_link_pair).
MODS="drivers/infiniband/sw/rxe/rdma_rxe drivers/infiniband/core/ib_core drivers/infiniband/core/ib_uverbs
      net/ipv4/udp_tunnel net/ipv6/ip6_udp_tunnel drivers/net/dummy crypto/crc32_generic
      drivers/net/veth net/sched/sch_netem"
have_mods() { for m in $MODS; do [ -f "$MODDIR/kernel/$m.ko" ] || return 1; done; }
if [ ! -f "$VMLINUX" ] || [ ! -d "$MODDIR" ] || ! have_mods; then
  log "fetching $KPKG"
  kx=$WORK/kernel; rm -rf "$kx"; mkdir -p "$kx/root"
  # As root apt would drop to user _apt, who cannot write here: stay root rather than warn.
  (cd "$kx" && apt-get download -q=2 $([ "$(id -u)" = 0 ] && echo -o APT::Sandbox::User=root) "$KPKG")
  dpkg-deb --fsys-tarfile "$kx"/"$KPKG"_*.deb | tar -x -C "$kx/root" "./boot/vmlinuz-$KV" \
    $(for m in $MODS; do echo "./lib/modules/$KV/kernel/$m.ko"; done) --wildcards "./lib/modules/$KV/modules.*"
  rm -rf "$MODDIR.tmp"; cp -a "$kx/root/lib/modules/$KV" "$MODDIR.tmp"
  # qemu boots an ELF vmlinux directly (PVH entry), which skips the BIOS and the in-guest
  # decompression: several seconds under TCG. The vmlinux is the xz stream inside the bzImage.
  off=$(LC_ALL=C grep -obUaP '\xfd7zXZ\x00' "$kx/root/boot/vmlinuz-$KV" | awk -F: 'NR == 1 { print $1 }')
  # xz stops at the end of the stream; tail may then die of SIGPIPE, which is fine.
  { tail -c +$((off + 1)) "$kx/root/boot/vmlinuz-$KV" || true; } | xz -dc --single-stream > "$VMLINUX.tmp"
  rm -rf "$MODDIR"; mv "$MODDIR.tmp" "$MODDIR"; mv "$VMLINUX.tmp" "$VMLINUX"
  rm -rf "$kx"
fi
log "kernel $KV ready"

# --- 3. guest rootfs ------------------------------------------------------------------------------
# An initramfs cpio made by mmdebstrap's 'extract' variant: it only unpacks the packages and their
# dependencies, runs no maintainer scripts (about twice as fast as 'essential'); our /init does the rest.
# The key covers the kernel and its module list (the modules are inside), the package list and this
# recipe's revision.
PKGS=dash,bash,coreutils,util-linux,mount,grep,sed,mawk,kmod,iproute2,procps,libibverbs1,ibverbs-providers
PKGS=$PKGS,ibverbs-utils,perftest,libstdc++6,libfabric1,libfmt9
RECIPE=1
KEY=$(echo "$RECIPE $KV $PKGS" $MODS | md5sum | cut -c1-10)
ROOTCPIO=$CACHE/rootfs-$KEY.cpio
ROOTLIST=$CACHE/rootfs-$KEY.files   # the rootfs paths, to tell which host libraries the guest lacks
if [ ! -f "$ROOTCPIO" ] || [ ! -f "$ROOTLIST" ]; then
  log "building rootfs $KEY"
  rfs=$WORK/rootfs; rm -rf "$rfs"
  mmdebstrap --quiet --variant=extract --include=$PKGS \
    --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/info/*' \
    bookworm "$rfs" /etc/apt/sources.list.d/debian.sources
  ln -sf mawk "$rfs/usr/bin/awk"   # mawk's postinst would make this link via update-alternatives
  mkdir -p "$rfs/usr/lib/modules"; cp -a "$MODDIR" "$rfs/usr/lib/modules/$KV"; depmod -b "$rfs" "$KV"
  (cd "$rfs" && find . | cpio -o -H newc -R 0:0 --quiet) > "$ROOTCPIO.tmp"
  (cd "$rfs" && find . | sed 's/^\.//') > "$ROOTLIST"
  mv "$ROOTCPIO.tmp" "$ROOTCPIO"
  rm -rf "$rfs"
fi
log "rootfs ready ($(du -m "$ROOTCPIO" | cut -f1) MB)"

# --- 4. payload: binaries, the libraries the rootfs lacks, steps, FABRIC_* env, /init --------------
ov=$WORK/payload; rm -rf "$ov"; mkdir -p "$ov/opt/fabric"
bins=$(sed -n 's/^# binaries://p' "$STEPS" | head -1)
declare -A libs=()
for b in $bins; do
  if [ ! -x "$BUILD/$b" ]; then echo "warning: $BUILD/$b not built; skipped" >&2; continue; fi
  cp "$BUILD/$b" "$ov/opt/fabric/"
  # ldd lists the whole closure; keep what the guest lacks, at the path the loader will look up.
  # The rootfs is merged-usr, so /lib/... on the host is /usr/lib/... there.
  for l in $(ldd "$BUILD/$b" | awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// { print $1 }'); do
    g=$l; case $g in /lib/* | /lib64/* | /bin/* | /sbin/*) g=/usr$g;; esac
    grep -qxF "$g" "$ROOTLIST" || libs[$g]=$l
  done
done
for g in "${!libs[@]}"; do
  echo "payload: adding ${libs[$g]} (not in the rootfs) as $g"
  mkdir -p "$ov$(dirname "$g")"; cp -L "${libs[$g]}" "$ov$g"
done
cp "$STEPS" "$ov/opt/fabric/steps.sh"
# FABRIC_* variables travel as a sourced file; single quotes make any value literal.
compgen -e | { grep '^FABRIC_' || true; } | while read -r v; do
  printf "export %s='%s'\n" "$v" "$(printf '%s' "${!v}" | sed "s/'/'\\\\''/g")"
done > "$ov/opt/fabric/env.sh"
cp "$HERE/guest-init.sh" "$ov/init"; chmod +x "$ov/init"
# The kernel unpacks concatenated cpio archives in order, so the payload lands on top of the rootfs.
(cd "$ov" && find . | cpio -o -H newc -R 0:0 --quiet) | cat "$ROOTCPIO" - > "$WORK/initrd.cpio"
log "payload ready: $(ls "$ov/opt/fabric" | tr '\n' ' ')"

# --- 5. boot --------------------------------------------------------------------------------------
# TCG only: this host's /dev/kvm is PVM-only and a stock kernel hangs under it. tsc=reliable keeps the
# guest on the TSC clocksource (HPET reads trap into qemu and are slow under TCG).
LOG=$WORK/vm.log
TB=$EPOCHREALTIME
set +e
timeout "${VM_TIMEOUT:-900}" qemu-system-x86_64 -accel tcg -cpu max -m "${MEM:-2G}" -smp "${SMP:-2}" \
  -display none -monitor none -serial stdio -nic none -no-reboot \
  -kernel "$VMLINUX" -initrd "$WORK/initrd.cpio" \
  -append "console=ttyS0 loglevel=4 panic=-1 mitigations=off tsc=reliable" </dev/null 2>&1 |
  while IFS= read -r l; do
    l=${l%$'\r'}
    case $l in *@@*) printf '[%6ss] %s\n' "$(since "$TB")" "$l";; *) printf '%s\n' "$l";; esac
  done | tee "$LOG"
qrc=${PIPESTATUS[0]}
set -e
log "VM done in $(since "$TB")s (qemu rc=$qrc)"

# Benchmark output left between markers goes to <build>/rxe/<name>.txt.
awk -v dir="$WORK" '
  /@@ BENCH_END/ { if (f) close(f); f = ""; next }
  f { print > f }
  match($0, /@@ BENCH_BEGIN [^ ]+/) { f = dir "/" substr($0, RSTART + 15, RLENGTH - 15) ".txt"; printf "" > f }
' "$LOG"
for f in $(sed -n 's/.*@@ BENCH_BEGIN \([^ ]*\).*/\1/p' "$LOG"); do echo "bench output: $WORK/$f.txt"; done

if grep -q '@@ INIT_END rc_all=0' "$LOG"; then
  echo "RXE VM TESTS: PASS"
  grep '@@ RESULT' "$LOG" | sed 's/.*@@ RESULT rc=0 t=\([^ ]*\): /  \1  /'
  exit 0
fi
echo "RXE VM TESTS: FAIL"
grep -q '@@ INIT_END' "$LOG" || echo "  the guest did not finish (qemu rc=$qrc; 124 = VM_TIMEOUT ${VM_TIMEOUT:-900}s)"
grep '@@ RESULT' "$LOG" | grep -v '@@ RESULT rc=0 ' | sed 's/^/  /' || true
exit 1
