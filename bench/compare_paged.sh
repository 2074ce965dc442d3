#!/usr/bin/env bash
# Paged 64 KiB WRITEs side by side: the engine demo against the raw libfabric loop, per provider,
# median GB/s of alternating trials and the ratio engine/raw. Usage: compare_paged.sh [BUILD_DIR]
set -euo pipefail
build=${1:-build}
demo=$build/tools/demo/fabric-demo
raw=$build/bench/raw-paged-loop
trials=5

# Runs one trial and prints its GB/s; a failed or unverified run aborts the script with its output.
gbps() {
  local out
  if ! out=$("$@" 2>&1) || ! grep -q 'bytes: OK$' <<<"$out"; then
    printf '%s\nFAILED: %s\n' "$out" "$*" >&2
    exit 1
  fi
  sed -n 's/^moved .* \([0-9.]*\) GB\/s, .*/\1/p' <<<"$out"
}
median() { printf '%s\n' "$@" | sort -g | sed -n "$(((${#} + 1) / 2))p"; }

printf '%-12s %-22s %-22s %s\n' provider "engine GB/s (median)" "raw GB/s (median)" engine/raw
summary="ratio paged64k"
for provider in "tcp;ofi_rxm" shm; do
  engine=() base=()
  for ((i = 0; i < trials; i++)); do  # alternate so drift in the machine hits both alike
    engine+=("$(gbps "$demo" --provider "$provider" --busy --rounds 128)")
    base+=("$(gbps "$raw" --provider "$provider" --rounds 128)")
  done
  e=$(median "${engine[@]}") r=$(median "${base[@]}")
  ratio=$(awk -v e="$e" -v r="$r" 'BEGIN { printf "%.2f", e / r }')
  printf '%-12s %-22s %-22s %s\n' "$provider" "$e (${engine[*]})" "$r (${base[*]})" "$ratio"
  summary+=" ${provider%%;*}=$ratio"
done
echo "$summary"
