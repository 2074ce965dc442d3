# The README's two commands are `make demo` and `make test`; both install what they need first.
BUILD ?= build
DEB_PACKAGES := cmake ninja-build g++ pkg-config libfabric-dev libfabric-bin libfmt-dev \
                libcli11-dev libgtest-dev googletest libibverbs-dev ibverbs-providers ccache
# Every build goes through ccache, so the library that `pip install .` compiles again (same sources,
# same flags: pyproject.toml builds RelWithDebInfo like $(BUILD)) comes out of the cache.
# CCACHE_NOHASHDIR: the two builds run in different directories. Read when a build dir is configured.
export CMAKE_CXX_COMPILER_LAUNCHER ?= ccache
export CMAKE_CUDA_COMPILER_LAUNCHER ?= ccache
export CCACHE_NOHASHDIR ?= 1
# ccache keys on the compiler's name too: scikit-build-core hands CMake Python's CXX (g++ here), so
# every build names the compiler as Python does (a CXX of yours wins).
ifeq ($(origin CXX),default)
CXX := $(shell python3 -c 'import sysconfig; print((sysconfig.get_config_var("CXX") or "g++").split()[0])' 2>/dev/null || echo g++)
endif
export CXX
# Only the Python tests need these (tests/python/conftest.py's etcd_endpoint fixture runs etcd, its
# prometheus fixture a Prometheus server that test_prometheus.py queries).
PY_TEST_PACKAGES := etcd-server prometheus
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: deps build demo test test-python clean format

deps:
	@dpkg -s $(DEB_PACKAGES) >/dev/null 2>&1 || { \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $(DEB_PACKAGES); }

BUILD_START := $(shell date +%s)
build: deps
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFABRIC_BUILD_TESTS=ON
	cmake --build $(BUILD)

demo: build
	$(BUILD)/tools/demo/fabric-demo

# Everything CI runs: the C++ suites, the Python suite, verbs on Soft-RoCE, network faults, a
# 1-minute soak, a short run of every fuzz target, and the suites under sanitizers, in phases that
# print their times (tests/run_all.sh; docs/testing.md). TEST_JOBS: tests ctest runs at once.
TEST_JOBS ?= 2
export TEST_JOBS
test: build
	@echo "test: phase deps and build took $$(( $$(date +%s) - $(BUILD_START) )) s"
	tests/run_all.sh $(BUILD)

# Verbs tests in a qemu VM with Soft-RoCE: this host has no RDMA NIC. See tests/rxe/README.md.
.PHONY: test-rxe
test-rxe: build
	tests/rxe/run.sh $(BUILD)

# Network faults (tc netem: loss, delay, reordering, duplication, corruption; link down/up) between
# two network namespaces over tcp;ofi_rxm; in the qemu VM when this kernel has no netem. About 1.5 min
# (up to 3 on a loaded host).
# See tests/netem/README.md.
.PHONY: test-netem
test-netem: build
	tests/netem/run.sh $(BUILD)

# The C++ suites under ASan+UBSan and under TSan (own Debug builds: build-asan, build-tsan).
.PHONY: test-sanitize
test-sanitize: deps
	tests/sanitize/run.sh

# Mixed traffic to 4 peers with injected faults and a peer restart, every byte checked; ends with
# `soak transfers=... bytes=... faults=... lost=0 leaked_kib=...`.
SOAK_MINUTES ?= 10
.PHONY: soak
soak: build
	$(BUILD)/tools/soak/fabric-soak --minutes $(SOAK_MINUTES)

# Engine against ib_write_bw on Soft-RoCE, same VM, same run; ends with a `ratio ...` line.
.PHONY: bench-rxe
bench-rxe: build
	tests/rxe/run.sh $(BUILD) tests/rxe/bench_steps.sh
	tests/rxe/compare.sh $(BUILD)/rxe

# The Python package, built and installed the way a user does it (pip install .), then pytest with
# PY_TEST_JOBS workers (pytest-xdist; every test starts its own processes, ports and etcd).
PY_TEST_JOBS ?= 2
test-python: deps
	@dpkg -s $(PY_TEST_PACKAGES) >/dev/null 2>&1 || { \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $(PY_TEST_PACKAGES); }
	python3 -m pip install --quiet ".[test]"
	python3 -m pytest -v -n $(PY_TEST_JOBS) --durations=15 tests/python

.PHONY: bench-python
bench-python: build
	python3 -m pip install --quiet .
	python3 bench/python_submit_overhead.py $(BUILD)

# Where the bench targets write what they keep (tables, JSON, plots): an untracked folder in the
# build dir, so that no bench run changes the tree. The copies committed in docs/bench/ are
# refreshed on purpose, by naming that folder:
#   make bench-compare bench-sweep bench-plot BENCH_OUT=docs/bench
# Every figure they print is in GB/s (1e9 bytes per second); link speeds are in Gbit/s, as NICs
# report them.
BENCH_OUT ?= $(BUILD)/bench-out
# The recipes below that pipe into tee fail when the command before the pipe does.
bench-compare bench-sweep: private SHELL := /bin/bash
bench-compare bench-sweep: private .SHELLFLAGS := -o pipefail -c

# Ends with the `ratio ...` line; the table goes to $(BENCH_OUT)/compare.txt, the medians (for
# bench-plot) to $(BENCH_OUT)/compare.json.
.PHONY: bench-compare
bench-compare: build
	@dpkg -s ucx-utils python3-venv >/dev/null 2>&1 || DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq ucx-utils python3-venv
	mkdir -p $(BENCH_OUT)
	bench/compare.sh $(BUILD) 5 $(BENCH_OUT)/compare.json | tee $(BENCH_OUT)/compare.txt

.PHONY: bench-sweep bench-plot bench-post
# Full fabric-bench sweeps on both loopback providers; JSON and tables go to $(BENCH_OUT).
bench-sweep: build
	mkdir -p $(BENCH_OUT)
	for p in tcp shm; do \
	  $(BUILD)/tools/fabric-bench/fabric-bench local --provider $$p --verify \
	    --json $(BENCH_OUT)/fabric-bench-$$p.json | tee $(BENCH_OUT)/fabric-bench-$$p.txt || exit 1; done

# Plots the sweeps of $(BENCH_OUT) (and bench-compare's medians there, if any) into $(BENCH_OUT).
bench-plot:
	@for p in tcp shm; do [ -f $(BENCH_OUT)/fabric-bench-$$p.json ] || \
	  { echo "bench-plot: no $(BENCH_OUT)/fabric-bench-$$p.json: run make bench-sweep first (same BENCH_OUT)"; exit 1; }; done
	python3 -m pip install --quiet matplotlib
	python3 bench/plot.py $(BENCH_OUT) $(BENCH_OUT)/fabric-bench-tcp.json $(BENCH_OUT)/fabric-bench-shm.json \
	  $(if $(wildcard $(BENCH_OUT)/compare.json),--compare $(BENCH_OUT)/compare.json)

# Posting cost: wall-clock submit-to-post on both providers against a raw libfabric loop (`post ...`
# lines), then callgrind instructions per WRITE
# (group scatter, list scatter, and last the single write: `engine instructions per posted WRITE: N`).
bench-post: build
	@command -v valgrind >/dev/null || DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq valgrind
	bench/post_vs_raw.sh $(BUILD)
	bench/callgrind_post.sh $(BUILD)

# KV-cache transfer, layer by layer against after prefill (one prefill and one decode rank, tcp and
# shm on loopback); the last line of each run is `kv layers=... exposed_ms=... post_us_per_layer=...`.
.PHONY: bench-kv
bench-kv: build
	for p in "tcp;ofi_rxm" shm; do $(BUILD)/bench/fabric-kv-bench --provider "$$p" --tokens 4096; done

# The same KV workload through NIXL (nixl-cu13 from PyPI, UCX, host memory) side by side at 4K and
# 16K tokens; ends with `kv-vs-nixl tokens=... exposed_ratio=... post_ratio=...` lines.
.PHONY: bench-kv-compare
bench-kv-compare: build
	bench/kv_compare.sh $(BUILD)

# The RL weight-update plan for Kimi-K2 at full scale (256 BF16 training GPUs to 128 FP8 inference
# GPUs), built and checked here, with the posting cost of the busiest rank's WRITEs on this
# machine's engine; ends with `plan params=... src=256 dst=128 wrs_per_rank_max=...
# nic_bytes_max_over_mean=... lower_bound_ms=... predicted_ms=... post_ms_per_rank=...`. About 30 s.
.PHONY: bench-weights
bench-weights: build
	$(BUILD)/bench/fabric-weights-plan

# A prefill and a decode process that find each other in etcd (started on loopback) and move KV
# pages layer by layer; prints each request's per-layer timeline and checks every byte.
.PHONY: example-kv
example-kv: deps
	@dpkg -s $(PY_TEST_PACKAGES) >/dev/null 2>&1 || { \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $(PY_TEST_PACKAGES); }
	python3 -m pip install --quiet .
	python3 examples/kv_transfer/run.py

# Four training processes write a small MoE transformer into two inference processes (FSDP2 shards
# to fused, FP8 block-quantized TP/EP buffers), 20 steps, every byte checked; ends with a
# `weights steps=... update_ms_p50=... gb_per_s=... exact=yes` line (the slowest training rank's
# update per step, p50 over the steps; GB/s).
.PHONY: example-weights
example-weights: deps
	python3 -m pip install --quiet ".[test]"
	python3 examples/rl_weights/run.py

# Four rank processes (2 nodes of 2, tcp between them) run 20 decode steps of a toy MoE layer
# through fabric_lib.moe's dispatch/combine on the CPU, every combined value checked against the
# oracle; prints a per-step table and ends with a
# `moe steps=20 ranks=4 dispatch_us_p50_slowest=... combine_us_p50_slowest=... exact=yes` line
# (the p50 over the steps of the table's columns: each step's slowest rank).
.PHONY: example-moe
example-moe: deps
	python3 -m pip install --quiet ".[test]"
	python3 examples/moe/run.py

# examples/cpp/quickstart.cpp (the README's C++ snippet as a whole program: two engines, paged
# WRITEs with an immediate, every byte checked), built against an install of $(BUILD) the way an
# application builds it (find_package(fabric_lib), fabric::fabric); ends with `quickstart: ... OK`.
.PHONY: example-cpp
example-cpp: build
	cmake --install $(BUILD) --prefix $(abspath $(BUILD))/example-cpp-prefix >/dev/null
	cmake -S examples/cpp -B $(BUILD)/example-cpp -G Ninja -DCMAKE_PREFIX_PATH=$(abspath $(BUILD))/example-cpp-prefix
	cmake --build $(BUILD)/example-cpp
	$(BUILD)/example-cpp/quickstart

.PHONY: bench-multinic
bench-multinic: build
	bench/multinic.sh $(BUILD)

format:
	clang-format -i $$(git ls-files '*.h' '*.cpp')

clean:
	rm -rf $(BUILD)

# libFuzzer targets for every parser of outside bytes (tests/fuzz, a standalone clang build of the
# wire-format sources only), each run FUZZ_RUNS times on a copy of its seed corpus; fails on a crash.
FUZZ_BUILD ?= build-fuzz
FUZZ_RUNS ?= 10000000
FUZZ_JOBS ?= 2
.PHONY: fuzz
fuzz:
	@dpkg -s clang libclang-rt-14-dev libfmt-dev cmake ninja-build >/dev/null 2>&1 || { \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq clang libclang-rt-14-dev libfmt-dev cmake ninja-build; }
	cmake -S tests/fuzz -B $(FUZZ_BUILD) -G Ninja -DCMAKE_CXX_COMPILER=clang++
	cmake --build $(FUZZ_BUILD)
	tests/fuzz/run.sh $(FUZZ_BUILD) $(FUZZ_RUNS) $(FUZZ_JOBS)
