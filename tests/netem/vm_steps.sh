# binaries: tools/fabric-bench/fabric-bench netem/scenarios.sh netem/veth.ko netem/sch_netem.ko netem/sch_tbf.ko
# Guest steps for tests/netem/run.sh when the host kernel has no netem: sourced by the /init of the
# tests/rxe VM (Debian's kernel, which ships veth, sch_netem and sch_tbf as modules). Format: tests/rxe/README.md.
for v in TIMEOUT_MS KILL_S BOUND_S ONLY FLAP_RATE; do
  eval "[ -n \"\${FABRIC_NETEM_$v:-}\" ] && export NETEM_$v=\"\$FABRIC_NETEM_$v\""
done
step netem-modules 60 bash -c 'for m in veth sch_netem sch_tbf; do insmod /opt/fabric/$m.ko || exit 1; done'
step netem 900 bash /opt/fabric/scenarios.sh /opt/fabric/fabric-bench
