# binaries: tools/fabric-bench/fabric-bench
# Engine WRITE bandwidth against ib_write_bw (perftest, raw verbs) on rxe0, same VM, same sizes,
# 64 WRITEs in flight each, two alternating rounds (TCG speed drifts). tests/rxe/compare.sh
# turns the saved blocks into ratios (make bench-rxe).
for round in 1 2; do
  for size in 65536 1048576; do
    iters=$((size == 65536 ? 3000 : 200))
    echo "@@ BENCH_BEGIN ib_write_bw_${size}_$round"
    pair ib_write_bw_$size 300 ib_write_bw -d rxe0 -x 1 -F --report_gbits -t 64 -s $size -n $iters
    echo "@@ BENCH_END"
  done
  echo "@@ BENCH_BEGIN fabric_bench_$round"
  step fabric_bench_verbs 600 /opt/fabric/fabric-bench local --provider verbs --only single \
    --single-sizes 65536 1048576 --target-mib 192 --buffer-mib 64 --peers 1 --window 64 --verify
  echo "@@ BENCH_END"
done
