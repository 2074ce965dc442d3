#!/bin/bash
# Engine (fabric-bench, provider verbs) against ib_write_bw from the blocks that
# tests/rxe/bench_steps.sh left in <dir> (<build>/rxe). Prints a table and ends with one line:
#   ratio engine/ib_write_bw 64KiB=<r> 1MiB=<r>
# Each figure is the median over the rounds run, in GB/s (1e9 bytes/s): ib_write_bw's Gbit/s
# (--report_gbits) divided by 8, fabric-bench's GB/s column as it is.
set -euo pipefail
DIR=${1:?usage: compare.sh <build>/rxe}
median() { sort -g | awk '{ v[NR] = $1 } END { if (NR == 0) print "nan"; else if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
raw() {  # ib_write_bw --report_gbits: "#bytes #iterations BW peak BW average MsgRate" (Gbit/s)
  cat "$DIR"/ib_write_bw_"$1"_*.txt | awk -v s="$1" '$1 == s && NF >= 5 { print $4 / 8 }' | median
}
engine() {  # fabric-bench: "single <bytes> <writes> <iters> <avg> <p50> <p99> <GB/s> ..."
  cat "$DIR"/fabric_bench_*.txt | awk -v s="$1" '$1 == "single" && $2 == s { print $8 }' | median
}
line="ratio engine/ib_write_bw"
printf "%-8s %14s %14s %7s\n" size "ib_write_bw" "engine" ratio
for size in 65536 1048576; do
  r=$(raw $size); e=$(engine $size)
  ratio=$(awk -v e="$e" -v r="$r" 'BEGIN { printf (r > 0 ? "%.3f" : "nan"), (r > 0 ? e / r : 0) }')
  printf "%-8s %9s GB/s %9s GB/s %7s\n" $size "$r" "$e" "$ratio"
  label=$([ $size = 65536 ] && echo 64KiB || echo 1MiB)
  line="$line $label=$ratio"
done
echo "$line"
