#!/usr/bin/env bash
# RL weight updates at the sizes users run, on the GPU machine (tests/gpu/run.sh calls it once the
# Python package is installed): 4 training -> 2 inference processes on GPU 0 over cuda_ipc, every
# byte checked every step, at >= 300 MiB and >= 2 GiB per step. The processes run under MPS with no
# SM share (they then run at once, as on separate GPUs); without MPS they time-slice the GPU.
# Each run ends with its `weights ...` and `weights-gpu ...` lines; the full output goes to
# $OUT/weights_gpu.txt.
#   WEIGHTS_RUNS="1:300m:auto 1:2g:auto"   which runs, each MPS:SIZE:HOOK[:WINDOW] (MPS 1: under MPS where
#                                          it starts, 0: time-sliced; SIZE 300m or 2g; HOOK auto, cuda or
#                                          torch; WINDOW staging slots, default 2)
#   WEIGHTS_EXTRA=""                       more arguments for examples/rl_weights/run.py (--trace, say)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu-results}
mkdir -p "$OUT"
log="$OUT/weights_gpu.txt"
# 306 MiB per step: hidden 1024 (the issue's model); 2.04 GiB: hidden 2048, 8 layers.
declare -A SIZE=(
  [300m]="--hidden 1024 --inter 1024 --vocab 16384 --layers 4 --q-rows 2048 --kv-rows 512 --steps 20"
  [2g]="--hidden 2048 --inter 2048 --vocab 32768 --layers 8 --q-rows 4096 --kv-rows 1024 --steps 10"
)
status=0
mps_up=0
start_mps() {
  if [ $mps_up = 0 ] && command -v nvidia-cuda-mps-control >/dev/null && nvidia-cuda-mps-control -d; then
    mps_up=1
    sleep 1
  fi
  [ $mps_up = 1 ]
}
stop_mps() {
  if [ $mps_up = 1 ]; then echo quit | nvidia-cuda-mps-control; mps_up=0; sleep 1; fi
}
for run in ${WEIGHTS_RUNS:-1:300m:auto 1:2g:auto}; do
  IFS=: read -r mps size hook window <<< "$run"
  window=${window:-2}
  if [ "$mps" = 1 ]; then start_mps || { echo "weights-gpu: MPS did not start" | tee -a "$log"; continue; }
  else stop_mps; fi
  echo "== size=$size mps=$mps hook=$hook window=$window" >> "$log"
  # shellcheck disable=SC2086
  timeout 300 python3 examples/rl_weights/run.py --gpu --hook "$hook" --window "$window" ${SIZE[$size]} --mps "$mps" \
    ${WEIGHTS_EXTRA:-} >> "$log" 2>&1 || { status=1; echo "weights-gpu size=$size mps=$mps hook=$hook: FAILED" >> "$log"; }
done
stop_mps
grep -E "^== |^weights|FAILED|Error|error" "$log" | tail -40
exit $status
