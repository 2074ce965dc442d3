#!/usr/bin/env bash
# tests/gpu/stream_probe.cu in the configurations the MoE device-memory boundary runs in: alone
# and under MPS (no SM partition) with 1, 2 and 8 processes at once, CUDA_DEVICE_MAX_CONNECTIONS
# unset, 32 and 1 (1 aliases every stream onto one queue: the control that must block).
# `stream_probe.sh queued`: only the cases with kernels queued behind the spinning one (--queued),
# default and highest stream priority, alone and 4 processes under MPS.
set -uo pipefail
cd "$(dirname "$0")/../.."
P=/tmp/stream_probe
nvcc -O2 -arch=sm_90 -o $P tests/gpu/stream_probe.cu || exit 1
at_once() {  # at_once N args...: N probes at once
  local n=$1; shift
  for _ in $(seq "$n"); do $P "$@" & done
  wait
}
if [ "${1:-}" = queued ]; then
  for mps in 0 1; do
    [ $mps = 1 ] && { nvidia-cuda-mps-control -d || { echo "stream-probe: MPS did not start"; exit 1; }; }
    for conns in default 1; do
      for prio in "" --high-priority; do
        echo "stream-probe: queued=4, MPS=$mps ($((mps * 3 + 1)) processes), CUDA_DEVICE_MAX_CONNECTIONS=$conns ${prio:-default-priority}"
        if [ $conns = 1 ]; then export CUDA_DEVICE_MAX_CONNECTIONS=1; else unset CUDA_DEVICE_MAX_CONNECTIONS; fi
        at_once $((mps * 3 + 1)) --queued 4 --streams 8 $prio
      done
    done
    unset CUDA_DEVICE_MAX_CONNECTIONS
    [ $mps = 1 ] && { echo quit | nvidia-cuda-mps-control; }
  done
  exit 0
fi
echo "stream-probe: no MPS"
$P; $P --own-compute-stream; CUDA_DEVICE_MAX_CONNECTIONS=1 $P
if command -v nvidia-cuda-mps-control >/dev/null && nvidia-cuda-mps-control -d; then
  for conns in "" 32 1; do
    for n in 1 2 8; do
      echo "stream-probe: MPS, $n processes, CUDA_DEVICE_MAX_CONNECTIONS=${conns:-unset}"
      if [ -n "$conns" ]; then CUDA_DEVICE_MAX_CONNECTIONS=$conns at_once "$n"; else at_once "$n"; fi
    done
  done
  echo "stream-probe: MPS, 2 processes, own compute stream"
  at_once 2 --own-compute-stream
  for n in 2 8; do
    echo "stream-probe: MPS, $n processes, high-priority streams"
    at_once "$n" --high-priority
  done
  echo quit | nvidia-cuda-mps-control
else
  echo "stream-probe: MPS did not start"
fi
