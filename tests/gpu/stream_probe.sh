#!/usr/bin/env bash
# tests/gpu/stream_probe.cu in the configurations the MoE device-memory boundary runs in: alone
# and under MPS (no SM partition) with 1, 2 and 8 processes at once, CUDA_DEVICE_MAX_CONNECTIONS
# unset, 32 and 1 (1 aliases every stream onto one queue: the control that must block).
set -uo pipefail
cd "$(dirname "$0")/../.."
P=/tmp/stream_probe
nvcc -O2 -arch=sm_90 -o $P tests/gpu/stream_probe.cu || exit 1
at_once() {  # at_once N args...: N probes at once
  local n=$1; shift
  for _ in $(seq "$n"); do $P "$@" & done
  wait
}
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
