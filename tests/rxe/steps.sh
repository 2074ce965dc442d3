# binaries: tests/loopback_tests tests/unit_tests tools/fabric-bench/fabric-bench
# Default guest steps for tests/rxe/run.sh, sourced by the VM's /init (bash). Format: README.md.

# Under TCG rxe moves 20-40 MB/s, so 2000 x 64 KiB takes a few seconds.
echo "@@ BENCH_BEGIN ib_write_bw"
pair ib_write_bw 300 ib_write_bw -d rxe0 -x 1 -F -s 65536 -n 2000
echo "@@ BENCH_END"

# rxe1 and rxe2 on the two ends of a veth pair, for the test that cuts the link with netem
# (Verbs.TransientLoss*); every other test stays on rxe0.
echo "@@ STEP rxe-link-pair"; t0=$(up); rxe_link_pair; result $? "$t0" rxe-link-pair
export FABRIC_VERBS_DEVICE=rxe0

step loopback_tests_verbs 600 /opt/fabric/loopback_tests --gtest_filter='*verbs*:*Verbs*'
