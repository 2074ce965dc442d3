#!/usr/bin/env bash
# The GPU run, in one call on the lent GPU machine (it has CUDA and cmake but no libfabric headers
# and no network): unpack the Debian packages that tests/gpu/fetch_deps.sh put in .gpudeps/, build
# with CUDA for Hopper, run the GPU tests, the cuda_ipc benchmark, the posting benchmark against a
# raw libfabric loop (bench/post_vs_raw.sh), the KV-cache benchmark on the GPU, the Python package's
# GPU tests (built there with pip, no network) and the RL weight-update example, then the CPU suite. Results go to $OUT (or
# ./gpu-results; at most 8 files). Exits non-zero on any failure.
# FABRIC_GPU_RECORD_SYSFS=1: also record this machine's sysfs as a topology fixture.
# FABRIC_GPU_SKIP="topo-pass cuda-ipc post cpu": leave those steps out (a short device budget).
# FABRIC_GPU_WEIGHTS_ONLY=1: build, then only the Python GPU tests and the RL weight-update figures.
# FABRIC_GPU_MOE_ONLY=1: build, then only the Python package, the MoE GPU tests and the MoE bench.
# FABRIC_GPU_ONLY="deep-ep-upstream weights-bench weights-model kv-model moe-model python-install python-gpu python-watcher moe-gpu moe-tests moe-bench
# moe-deepep cuda-ipc post gpu-tests": build, then only those steps (the RL weight updates at 300 MiB and 2 GiB per step,
# tests/gpu/weights_bench.sh, with the Python package; the RL weight updates of a real transformers
# Qwen3-MoE-shaped model, BF16 and FP8, `weights-model ...` lines, with the Python package; KV-cache
# transfer between prefill and decode processes running a real transformers Qwen3-8B-shaped model,
# `kv-model ...` lines, with the Python package; a real transformers Qwen3-MoE's MoE blocks expert-parallel
# over 8 rank processes sharing the GPU, `moe-model ...` lines, with the Python package; the Python package alone; the Python GPU
# tests; the Python watcher's round trips beside the C++ watcher's, measured in the same run; the
# MoE GPU tests and bench, or either alone; DeepEP's own low-latency test against the shim
# (tests/gpu/deep_ep_upstream/run.sh, DEEPEP_RUNS "ranks node_size;..."); the MoE latency of
# deep_ep.Buffer timed as DeepEP times it, `moe-deepep ...` lines, with the Python package; the
# cuda_ipc benchmark; the posting benchmarks; the C++ GPU tests).
# FABRIC_GPU_QUICK=1: build only the library and the test programs, run the GPU tests and the CPU
# unit tests (the cuda_ipc namespace cases need root, which the lent machine gives), no loopback
# suite and no benchmark: for a short lease.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu-results}
mkdir -p "$OUT"
if [ -d .gpudeps ] && ls .gpudeps/*.deb >/dev/null 2>&1; then
  P=/tmp/gpudeps
  mkdir -p $P
  for f in .gpudeps/*.deb; do dpkg -x "$f" $P; done
  export PKG_CONFIG_PATH=$P/usr/lib/x86_64-linux-gnu/pkgconfig PKG_CONFIG_SYSROOT_DIR=$P
  export CMAKE_PREFIX_PATH=$P/usr LD_LIBRARY_PATH=$P/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
fi
nvidia-smi --query-gpu=index,name,driver_version --format=csv | tee "$OUT/gpus.txt"
BUILD=build-gpu
# Verbs off: the machine's own libibverbs.pc does not survive the sysroot above, and it has no RDMA
# NIC (the verbs code with CUDA is compiled in every CUDA build elsewhere).
cmake -S . -B $BUILD -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFABRIC_BUILD_TESTS=ON -DFABRIC_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90 -DFABRIC_VERBS=OFF > /tmp/configure.log 2>&1 ||
  { tail -30 /tmp/configure.log; exit 1; }
QUICK=${FABRIC_GPU_QUICK:-}
# FABRIC_GPU_NO_BUILD=1: steps that use only the Python package (it builds its own) skip this build.
if [ -z "${FABRIC_GPU_NO_BUILD:-}" ]; then
  cmake --build $BUILD -j "$(nproc)" ${QUICK:+--target fabric gpu_tests cuda_ipc_batch_tests unit_tests} > "$OUT/build.log" 2>&1 ||
    { grep -E "error|FAILED" -A5 "$OUT/build.log" | head -60; exit 1; }
fi
status=0
# The Python package built as a user builds it (no network here: no build isolation), then its GPU
# tests: watchers and counters from Python, KV layers triggered by torch kernels, weight updates
# between GPU processes. Then the RL weight-update figures: the example's per-step table (4 training
# -> 2 inference processes sharing GPU 0 through cuda_ipc, and over shm with host arenas), and the
# Kimi-K2 plan with the posting cost of its busiest rank on this machine's cores.
python_install() {
  python3 -m pip install --quiet --no-build-isolation -C cmake.define.CMAKE_CUDA_ARCHITECTURES=90 \
    -C cmake.define.FABRIC_VERBS=OFF -C build-dir=/tmp/pybuild .
}
python_steps() {
  { python_install &&
    python3 -m pytest -s -v tests/gpu/test_python_gpu.py tests/gpu/test_weights_gpu.py; } > "$OUT/python_gpu.txt" 2>&1 || status=1
  grep -E "python-watcher|weights-gpu|passed|failed|error" "$OUT/python_gpu.txt" | tail -6 || true
  { python3 examples/rl_weights/run.py --gpu && python3 examples/rl_weights/run.py --provider shm &&
    $BUILD/bench/fabric-weights-plan && $BUILD/bench/fabric-weights-plan --busy; } > "$OUT/weights.txt" 2>&1 || status=1
  grep -E "^weights |^plan |^ +[0-9]+ " "$OUT/weights.txt" | tail -30 || true
  # At the sizes users run: >= 300 MiB and >= 2 GiB per step, under MPS (`weights-gpu ...` lines).
  tests/gpu/weights_bench.sh || status=1
  weights_model_runs
}
# RL weight updates of a real transformers model (examples/rl_weights/weights_model.py): a
# Qwen3-MoE-shaped config of 0.81 B parameters (Qwen3-30B-A3B's widths and vocab, 2 layers of 16
# experts; about 1.5 GiB per BF16 update), 4 training processes taking 2 AdamW steps (eager
# attention: deterministic, backward included) -> 2 inference processes (TP 2, EP 2), all on GPU 0
# under MPS where it starts, BF16 and then FP8 linear layers; every step the inference logits equal
# the trainer's (the script fails otherwise). Each run is bounded at 150 s (estimated well under
# 2 minutes); every rank prints `weights-model progress` lines (build, each step, each update), so
# one cut short shows where it was. Ends in `weights-model ...` lines. The package installed.
weights_model_runs() {
  local mps=0 fp8
  if command -v nvidia-cuda-mps-control >/dev/null && nvidia-cuda-mps-control -d; then mps=1; sleep 1; fi
  : > "$OUT/weights_model.txt"
  # WEIGHTS_MODEL_DTYPES: "bf16 fp8" (a short lease runs one).
  for fp8 in ${WEIGHTS_MODEL_DTYPES:-bf16 fp8}; do
    [ "$fp8" = fp8 ] && fp8=--fp8 || fp8=""
    # shellcheck disable=SC2086
    timeout "${WEIGHTS_MODEL_TIMEOUT:-150}" python3 examples/rl_weights/weights_model.py --device cuda --size gpu \
      --model qwen3_moe --trainers 4 --inference 2 --steps 2 --timeout-s 100 $fp8 >> "$OUT/weights_model.txt" 2>&1 ||
      { status=1; echo "weights-model ${fp8:-bf16}: FAILED" >> "$OUT/weights_model.txt"; }
  done
  if [ $mps = 1 ]; then echo quit | nvidia-cuda-mps-control; sleep 1; fi
  echo "weights-model mps=$mps"
  grep -E "^weights-model model=|FAILED|Error" "$OUT/weights_model.txt" | tail -8 || true
  grep -E "^weights-model progress" "$OUT/weights_model.txt" | tail -4 || true  # where the last run was
}
# Disaggregated prefill/decode of a real transformers model (examples/kv_transfer/kv_model.py): a
# Qwen3-8B-shaped config in BF16 (random weights), 8 prompts of 2048 tokens, each layer's K/V sent
# by cuda_ipc into the decode processes' vLLM-layout paged cache as the layer ends, all processes on
# GPU 0 (no MPS); decode generates 32 tokens from the received cache and the script fails unless
# they, the logits and the received cache equal generate()'s in one process bit for bit (every
# process runs FlashAttention only, deterministic algorithms, the position ids generate() makes; a
# failure says whether the cache, the prefill's logits or a decode step differed). TP 1 -> 1 with
# all 36 layers (about 55 GB on the GPU);
# 2 -> 1 and 1 -> 2 with 18 (a third process on the GPU: at 36 layers 2 -> 1 would need ~80 GB, three
# copies of the model and their caches), in vLLM's default NHD
# pages (one WRITE per token where the heads split) and 2 -> 1 again in its HND pages (one per
# block). Ends in `kv-model ...` lines. The package installed.
kv_model_runs() {
  local args
  : > "$OUT/kv_model.txt"
  local runs
  # KV_MODEL_RUNS: argument sets separated by ';' (a short lease runs fewer).
  IFS=';' read -ra runs <<< "${KV_MODEL_RUNS:---tp 1to1;--tp 2to1 --layers 18;--tp 1to2 --layers 18;--tp 2to1 --layers 18 --kv-layout HND}"
  for args in "${runs[@]}"; do
    # shellcheck disable=SC2086
    timeout 600 python3 examples/kv_transfer/kv_model.py --device cuda $args >> "$OUT/kv_model.txt" 2>&1 ||
      { status=1; echo "kv-model $args: FAILED" >> "$OUT/kv_model.txt"; }
  done
  grep -E "^kv-model |NOT EXACT|FAILED|Error" "$OUT/kv_model.txt" | tail -8 || true
}
# The MoE blocks of a real transformers model expert-parallel (examples/moe/moe_model.py): a
# Qwen3-MoE-shaped config in BF16 (Qwen3-30B-A3B's widths and vocab, 4 layers of 64 experts, top-8,
# random weights) in 8 rank processes sharing GPU 0 under MPS where it starts (no SM partition),
# each holding 8 experts of every layer and decoding 4 prompts, through AllToAll and then through
# deep_ep.Buffer, BF16 and FP8 dispatch, against one process running the unmodified model; the
# script fails unless the blocks are within their bounds and the BF16 decode's tokens are the
# model's. Ends in `moe-model ...` lines. The package installed.
moe_model_runs() {
  local mps=0 mode
  if command -v nvidia-cuda-mps-control >/dev/null && nvidia-cuda-mps-control -d; then mps=1; sleep 1; fi
  : > "$OUT/moe_model.txt"
  # MOE_MODEL_MODES: "all_to_all deep_ep" (a short lease runs one).
  for mode in ${MOE_MODEL_MODES:-all_to_all deep_ep}; do
    timeout "${MOE_MODEL_TIMEOUT:-300}" python3 examples/moe/moe_model.py --device cuda --mode "$mode" \
      >> "$OUT/moe_model.txt" 2>&1 || { status=1; echo "moe-model $mode: FAILED" >> "$OUT/moe_model.txt"; }
  done
  if [ $mps = 1 ]; then echo quit | nvidia-cuda-mps-control; sleep 1; fi
  echo "moe-model mps=$mps"
  grep -E "^moe-model |FAILED|Error" "$OUT/moe_model.txt" | tail -8 || true
}
# MoE dispatch/combine: 2 and 4 rank processes sharing GPU 0 (under MPS where it starts), NVLink
# only and as 2 "nodes" over shm through host-pinned buffers, checked DeepEP-style and replayed
# in a CUDA graph; then the benchmark at 128 tokens, hidden 7168, top-8 (both latency definitions).
moe_steps() {
  moe_gpu_tests
  moe_bench_steps
}
moe_gpu_tests() {
  { python_install && python3 -m pytest -s -v tests/gpu/test_moe_gpu.py; } > "$OUT/moe_gpu.txt" 2>&1 || status=1
  grep -E "moe-gpu|mps|passed|failed|error" "$OUT/moe_gpu.txt" | tail -16 || true
}
# The ranks share one GPU under MPS (when it starts) with no SM partition: their kernels run at
# once, as on separate GPUs (test_moe_gpu.py says why that is safe). Each path at 2, 4 and 8
# ranks (NVLink only, and 2 nodes over shm through host-pinned buffers), the DeepEP shim beside
# the native calls, and the grid cap (num_sms) at 2 ranks.
moe_bench_steps() {
  local mps=0
  if command -v nvidia-cuda-mps-control >/dev/null && nvidia-cuda-mps-control -d; then mps=1; fi
  echo "moe-bench mps=$mps sm_partition=none" > "$OUT/moe_bench.txt"
  # MOE_BENCH_TIMEOUT: seconds per run (240). MOE_BENCH_RUNS: "ranks node_size provider api num_sms [q|-] [host|device] [busy|-] [blocking|-]" entries separated by
  # ';' (q: BF16 x, quantized by the send half inside the timed dispatch, as the DeepEP shim does; device: the
  # regions between nodes in GPU memory, written through the engine's cuda_ipc domain; busy: the
  # proxies and the engines' threads spin, three cores per rank, as in production; at 4 ranks that
  # is more spinning threads than a 16-core machine has, and dispatch collapses to ms; blocking: each
  # rank's host thread sleeps in CUDA's waits instead of spinning). Every SM
  # per half (num_sms 132) is left out: at 2 ranks on one GPU it can deadlock until the timeout.
  local runs=${MOE_BENCH_RUNS:-"2 2 tcp native 0;4 4 tcp native 0;8 8 tcp native 0;2 1 shm native 0;4 2 shm native 0;8 4 shm native 0;2 2 tcp native 0 q;2 2 tcp deep_ep 0;8 8 tcp native 0 q;8 8 tcp deep_ep 0;2 2 tcp native 32;4 4 tcp native 32;8 8 tcp native 32;2 1 shm native 0 - device;4 2 shm native 0 - device;8 4 shm native 0 - device;2 1 shm native 0 - device busy"}
  local run
  IFS=';' read -ra run_list <<< "$runs"
  for run in "${run_list[@]}"; do
    read -r ranks node provider api sms quant rdma poll sync <<< "$run"
    [ "$quant" = - ] && quant=""
    [ "$poll" = busy ] || poll=""
    [ "$sync" = blocking ] || sync=""
    timeout "${MOE_BENCH_TIMEOUT:-240}" python3 bench/moe_bench.py --device cuda --tokens 128 --hidden 7168 --topk 8 --experts 256 \
      --ranks "$ranks" --node-size "$node" --provider "$provider" --api "$api" --num-sms "$sms" --steps 30 \
      ${quant:+--quantize} --rdma-buffers "${rdma:-host}" ${poll:+--busy-poll} ${sync:+--blocking-sync}
  done >> "$OUT/moe_bench.txt" 2>&1 || status=1
  if [ $mps = 1 ]; then echo quit | nvidia-cuda-mps-control; fi
  grep -E "^moe-bench" "$OUT/moe_bench.txt" || true
}
# MoE latency as DeepEP measures it (bench/deep_ep_bench.py; issue 42, item 6): deep_ep.Buffer with
# its defaults (its own engine, cuda_ipc, regions between nodes in GPU memory), rank processes
# sharing GPU 0 under MPS (where it starts) with no SM partition, 128 tokens, hidden 7168, top-8 of
# 256 experts, FP8 dispatch + BF16 combine: 2 ranks NVLink only, 2 ranks as 2 nodes, 8 ranks as 2
# nodes of 4. Each with the Buffer's host_wait="auto" (blocking-sync where the ranks' busy threads
# outnumber the host's cores: 8 ranks on 16 cores; else CUDA's spin); then 8 ranks again spinning
# and with blocking-sync set before the context exists (what auto sets on the running context,
# compared): the host waiting mode of item 5, measured in one run. The package installed.
# MOE_DEEPEP_RUNS: "ranks node_size host_wait [more bench args]" entries separated by ';'.
moe_deepep_runs() {
  local mps=0 run ranks node wait extra runs
  if command -v nvidia-cuda-mps-control >/dev/null && nvidia-cuda-mps-control -d; then mps=1; sleep 1; fi
  echo "moe-deepep-run mps=$mps sm_partition=none" | tee "$OUT/moe_deepep.txt"
  IFS=';' read -ra runs <<< "${MOE_DEEPEP_RUNS:-2 2 auto;2 1 auto;8 4 auto;8 4 spin;8 4 blocking-sync-early}"
  for run in "${runs[@]}"; do
    read -r ranks node wait extra <<< "$run"
    # shellcheck disable=SC2086
    timeout "${MOE_DEEPEP_TIMEOUT:-240}" python3 bench/deep_ep_bench.py --device cuda --ranks "$ranks" --node-size "$node" \
      --host-wait "$wait" ${extra:-} >> "$OUT/moe_deepep.txt" 2>&1 ||
      { status=1; echo "moe-deepep ranks=$ranks node_size=$node polling=$wait ${extra:-}: FAILED" >> "$OUT/moe_deepep.txt"; }
  done
  if [ $mps = 1 ]; then echo quit | nvidia-cuda-mps-control; sleep 1; fi
  grep -E "^moe-deepep " "$OUT/moe_deepep.txt" || true
}
weights_bench_steps() {
  python_install > "$OUT/python_install.txt" 2>&1 || { status=1; tail -20 "$OUT/python_install.txt"; return; }
  tests/gpu/weights_bench.sh || status=1
}
post_steps() {
  # Posting cost against a raw libfabric loop, busy polling, on this machine's cores.
  bench/post_vs_raw.sh $BUILD > "$OUT/post.txt" 2>&1 || status=1
  grep -E "^post [a-z]+ |^raw post" "$OUT/post.txt" || true
  # A worker of a two-worker engine against the only worker of a one-worker engine, both busy,
  # then the same lanes on bare libfabric (raw-ratio: what the provider loses by itself).
  for p in shm "tcp;ofi_rxm"; do $BUILD/bench/multi-worker-post --provider "$p" --workers 2; done \
    >> "$OUT/post.txt" 2>&1 || status=1
  grep -E "^workers=|^ratio workers|^raw lanes|^raw-ratio" "$OUT/post.txt" || true
}
cuda_ipc_steps() {
  $BUILD/tests/cuda_ipc_bench --json /tmp/cuda_ipc_bench.json 2>&1 | tee "$OUT/cuda_ipc_bench.txt" || status=1
}
if [ -n "${FABRIC_GPU_ONLY:-}" ]; then
  for step in $FABRIC_GPU_ONLY; do
    case $step in
      weights-bench) weights_bench_steps ;;
      weights-model)  # the real-model RL weight updates (installs the Python package first)
        python_install > "$OUT/python_install.txt" 2>&1 || { status=1; tail -20 "$OUT/python_install.txt"; continue; }
        weights_model_runs ;;
      kv-model)  # the real-model KV-cache transfer (installs the Python package first)
        python_install > "$OUT/python_install.txt" 2>&1 || { status=1; tail -20 "$OUT/python_install.txt"; continue; }
        kv_model_runs ;;
      moe-model)  # the real-model MoE blocks expert-parallel (installs the Python package first)
        python_install > "$OUT/python_install.txt" 2>&1 || { status=1; tail -20 "$OUT/python_install.txt"; continue; }
        moe_model_runs ;;
      python-install) python_install > "$OUT/python_install.txt" 2>&1 || { status=1; tail -20 "$OUT/python_install.txt"; } ;;
      post) post_steps ;;
      cuda-ipc) cuda_ipc_steps ;;
      gpu-tests)  # the C++ GPU tests (cuda_ipc batches among them)
        ctest --test-dir $BUILD -L gpu --timeout 300 > "$OUT/gpu_tests.log" 2>&1 || status=1
        grep -E "tests passed|Failed|\*\*\*" "$OUT/gpu_tests.log" || true ;;
      python-gpu)  # the Python GPU tests (the package must be installed: weights-bench first)
        python3 -m pytest -s -v tests/gpu/test_python_gpu.py tests/gpu/test_weights_gpu.py > "$OUT/python_gpu.txt" 2>&1 || status=1
        grep -E "weights-gpu|passed|failed|error" "$OUT/python_gpu.txt" | tail -4 || true ;;
      python-watcher)  # Python signal round trips beside the C++ watcher's (the package installed)
        timeout 300 python3 bench/python_watcher.py --cxx-bench $BUILD/tests/cuda_ipc_bench > "$OUT/python_watcher.txt" 2>&1 || status=1
        grep -E "python-watcher" "$OUT/python_watcher.txt" || tail -5 "$OUT/python_watcher.txt" ;;
      moe-gpu) moe_steps ;;
      deep-ep-upstream)  # DeepEP's own low-latency test against the shim (.gpudeps/deepep: fetch_deep_ep.sh)
        python_install > "$OUT/python_install.txt" 2>&1 || { status=1; tail -20 "$OUT/python_install.txt"; continue; }
        mps=0
        if command -v nvidia-cuda-mps-control >/dev/null && nvidia-cuda-mps-control -d; then mps=1; fi
        tests/gpu/deep_ep_upstream/run.sh "${DEEPEP_RUNS:-2 2;4 2;8 4}" > "$OUT/deep_ep_upstream.txt" 2>&1 || status=1
        if [ $mps = 1 ]; then echo quit | nvidia-cuda-mps-control; fi
        grep -E "^moe-deepep-test|^\[rank 0\]" "$OUT/deep_ep_upstream.txt" || tail -20 "$OUT/deep_ep_upstream.txt" ;;
      moe-tests) moe_gpu_tests ;;
      moe-bench) moe_bench_steps ;;
      moe-deepep)  # MoE latency timed as DeepEP times it (installs the Python package first)
        python_install > "$OUT/python_install.txt" 2>&1 || { status=1; tail -20 "$OUT/python_install.txt"; continue; }
        moe_deepep_runs ;;
      *) echo "unknown step $step"; status=1 ;;
    esac
  done
  exit $status
fi
# FABRIC_GPU_MOE_ONLY=1: only the Python package and the MoE steps (a short lease).
if [ -n "${FABRIC_GPU_MOE_ONLY:-}" ]; then
  moe_steps
  exit $status
fi
# FABRIC_GPU_WEIGHTS_ONLY=1: only the Python package and the weight-update steps (a short lease).
if [ -n "${FABRIC_GPU_WEIGHTS_ONLY:-}" ]; then
  python_steps
  exit $status
fi
skip() { [[ " ${FABRIC_GPU_SKIP:-} " == *" $1 "* ]]; }
if [ -n "$QUICK" ]; then
  # Each test in its own process (a process that used CUDA must not fork CUDA users), with its own
  # time limit (ctest's --timeout cannot shorten gtest_discover_tests' TIMEOUT property).
  for prog in gpu_tests cuda_ipc_batch_tests; do
    for t in $($BUILD/tests/$prog --gtest_list_tests | awk '/^[^ ]/{s=$1} /^  /{print s $1}'); do
      timeout "${FABRIC_GPU_TEST_TIMEOUT:-300}" $BUILD/tests/$prog --gtest_filter="$t" >> "$OUT/gpu_tests.log" 2>&1 ||
        { status=1; echo "FAILED or timed out: $t" | tee -a "$OUT/gpu_tests.log"; }
    done
  done
  grep -E "^\[ +(OK|FAILED|SKIPPED) +\]|remove_peer:|dead peer:|dereg_mr mid|device 0:|flush_remote|batch across|owner:" "$OUT/gpu_tests.log" | grep -v "tests, listed" || true
  $BUILD/tests/unit_tests > "$OUT/unit_tests.log" 2>&1 || status=1
  grep -E "PASSED|FAILED|seqlock:|holds:" "$OUT/unit_tests.log" || true
  exit $status
fi
# This machine's topology: the table, and its sysfs recorded as a fixture (tests/topology/fixtures).
{ $BUILD/tools/fabric-bench/fabric-bench topo; nproc; } > "$OUT/topo.txt" 2>&1 || status=1
if [ -n "${FABRIC_GPU_RECORD_SYSFS:-}" ]; then
  python3 tests/topology/record_sysfs.py -o "$OUT/lent-h200.sysfs" --machine lent-h200 \
    --note "recorded on the lent nvidia-h200 machine by tests/gpu/run.sh" >> "$OUT/topo.txt" 2>&1 || status=1
fi
cat "$OUT/topo.txt"
ctest --test-dir $BUILD -L gpu -V --timeout 300 > /tmp/gpu_tests.log 2>&1 || status=1
grep -E "tests passed|Failed|\*\*\*|remove_peer:|batch across|owner:" /tmp/gpu_tests.log || true
grep -E -A12 "Failure$|^\[  FAILED  \] [A-Z]" /tmp/gpu_tests.log | head -80 || true
# The same GPU tests on a one-GPU engine built from the detected topology (gpu_support.h).
if ! skip topo-pass; then
  FABRIC_GPU_FROM_TOPOLOGY=1 ctest --test-dir $BUILD -L gpu --timeout 300 > /tmp/gpu_tests_topo.log 2>&1 || status=1
  echo "from the topology:"; grep -E "tests passed|Failed|\*\*\*" /tmp/gpu_tests_topo.log || true
fi
if ! skip cuda-ipc; then cuda_ipc_steps; fi
if ! skip post; then post_steps; fi
# KV-cache transfer with both caches on the GPU (cuda_ipc): the Qwen3-235B-like shard at 4K and
# 16K tokens, with the reference's ~9.9 ms of compute per layer at 16K and a short 1 ms.
for args in "--tokens 4096 --compute-us 1000" "--tokens 16384 --compute-us 9900" "--tokens 16384 --compute-us 1000" \
            "--tokens 16384 --compute-us 1000 --busy"; do
  # shellcheck disable=SC2086
  $BUILD/bench/fabric-kv-bench --cuda-device 0 $args
done > "$OUT/kv.txt" 2>&1 || status=1
grep -E "^fabric-kv-bench|^kv " "$OUT/kv.txt" || true
python_steps
kv_model_runs
moe_steps
moe_model_runs
moe_deepep_runs
# The CPU suite last, bounded, so that a slow run cannot cost the figures above.
if ! skip cpu; then
  timeout "${FABRIC_GPU_CPU_SUITE_S:-300}" ctest --test-dir $BUILD -LE gpu -j 8 --timeout 300 > "$OUT/cpu_tests.log" 2>&1 || status=1
  grep -E "tests passed|Failed|\*\*\*" "$OUT/cpu_tests.log" || true
fi
exit $status
