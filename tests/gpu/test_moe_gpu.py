"""MoE dispatch/combine with CUDA kernels from Python (run by tests/gpu/run.sh on the GPU machine;
skipped where torch has no CUDA): 2, 4 and 8 rank processes sharing GPU 0, as one NVLink domain
(node_size = ranks: CUDA IPC only) and as 2 "nodes" (node_size = ranks / 2: the other node through
host-pinned buffers over the shm provider). Eager steps, then dispatch + experts + combine captured
in one CUDA graph and replayed 100 times with fresh routing, and steps with two batches in flight;
DeepEP-style checks (moe_gpu_roles.py) and the oracle bit for bit. Prints one `moe-gpu ...` line
per configuration (graph_step_us: one replay of dispatch + identity experts + combine, 20 back to
back, CUDA events, p50 over ranks). Then a rank that stalls before a dispatch or a combine: the
others' kernels give up after the timeout, their outputs are marked invalid and check() and the
next call raise.

Kernels of processes sharing a GPU run concurrently only under MPS; without it they time-slice
(slower, still correct: every wait is bounded). The module starts an MPS daemon where
nvidia-cuda-mps-control exists and a CUDA client then works under it, and says whether it did.
No SM partition is set (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE stays unset): the ranks' kernels run
at once as on separate GPUs, and each half's grid stays within num_sms blocks (default 16), so a
receive kernel waiting for its peers never takes the SMs their send kernels need."""

import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import uuid

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("torch sees no CUDA device", allow_module_level=True)

import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe_gpu_roles  # noqa: E402

from fabric_lib import moe as M  # noqa: E402

_PROBE = "import torch; x = torch.ones(8, device='cuda'); assert float((x * 2).sum()) == 16.0"


def _mps_control(*args, stdin=None):
    return subprocess.run(["nvidia-cuda-mps-control", *args], input=stdin, capture_output=True, text=True, timeout=30)


@pytest.fixture(scope="module")
def mps():
    """'on' (started here, stopped at the end), 'absent', 'off' (FABRIC_GPU_MPS=off: time-sliced,
    to tell a problem of MPS from one of the kernels) or 'failed: ...' (the test runs without)."""
    if os.environ.get("FABRIC_GPU_MPS") == "off":
        state = "off"
        started = False
    elif shutil.which("nvidia-cuda-mps-control") is None:
        state = "absent"
        started = False
    else:
        r = _mps_control("-d")
        started = r.returncode == 0
        state = "on" if started else f"failed: {(r.stderr or r.stdout).strip()[:200]}"
        if started:
            # A client must work under the daemon; if not, stop it and go on without.
            probe = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120)
            if probe.returncode != 0:
                _mps_control(stdin="quit\n")
                started = False
                state = f"failed: a CUDA client under MPS: {probe.stderr.strip()[-200:]}"
    print(f"\nmoe-gpu mps={state}")
    yield state
    if started:
        _mps_control(stdin="quit\n")


def _spawn(cfg: dict, ranks: int, target=moe_gpu_roles.rank_main, wait_ready: bool = True) -> list:
    ctx = mp.get_context("spawn")
    procs = []
    for r in range(ranks):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=target, args=(child, dict(cfg, rank=r)), daemon=True)
        p.start()
        procs.append((parent, p))
    for r, (conn, _) in enumerate(procs if wait_ready else []):
        assert conn.poll(240), f"rank {r} did not start"
        msg = conn.recv()
        assert msg == "ready", f"rank {r}: {msg}"
    return procs


def _join(procs: list) -> None:
    for _, p in procs:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()


def _result(conn, r: int, timeout: float = 540):
    assert conn.poll(timeout), f"rank {r}: no result"
    msg = conn.recv()
    assert not isinstance(msg, str), f"rank {r}: {msg}"
    return msg[1]


@pytest.mark.parametrize("ranks,node_size,dtype,rdma", [(2, 2, "fp8", "host"), (2, 1, "bf16", "host"), (4, 4, "bf16", "host"),
                                                        (4, 2, "fp8", "host"), (8, 8, "fp8", "host"), (8, 4, "bf16", "host"),
                                                        (2, 1, "fp8", "device"), (4, 2, "bf16", "device")],
                         ids=["2ranks-nvlink-fp8", "2ranks-2nodes-bf16", "4ranks-nvlink-bf16", "4ranks-2nodes-fp8",
                              "8ranks-nvlink-fp8", "8ranks-2nodes-bf16", "2ranks-2nodes-ipc-fp8", "4ranks-2nodes-ipc-bf16"])
def test_dispatch_and_combine_on_gpu_eager_and_in_a_cuda_graph(mps, ranks, node_size, dtype, rdma):
    """rdma "device": the node boundary with its regions in GPU memory, written through the
    engine's cuda_ipc domain (the same proxy protocol, GPU copies instead of shm's host copies).
    Those copies run on the engine's streams while the rank's receive kernel waits with the rest
    of its step (and the timed replays) queued behind it: with CUDA's default 8 hardware queues a
    copy stream shared one with that work and every 4-rank run failed in the back-to-back
    replays; 16 queues per process, as docs/api.md asks of kDevice users, ran them exactly."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    cfg = dict(port=store.port, job=uuid.uuid4().hex[:16], ranks=ranks, node_size=node_size, dtype=dtype,
               experts=8 * ranks, topk=8, hidden=7168, max_tokens=64, private_rows=16, eager_steps=6, replays=100, timed_replays=20,
               timeout_s=60.0 if rdma == "host" else 20.0, overlap_steps=4, rdma_buffers=rdma,
               cuda_connections=16 if rdma == "device" else 0)
    procs = _spawn(cfg, ranks)
    try:
        results = [_result(conn, r) for r, (conn, _) in enumerate(procs)]
        for r, res in enumerate(results):
            assert res["bad"] == [], f"rank {r}: {res['bad']}"
            assert res["replays"] == cfg["replays"]
            if node_size < ranks:
                assert res["writes"] > 0, "no WRITEs between the nodes"
        med = lambda k: sorted(x[k] for x in results)[len(results) // 2]  # noqa: E731
        print(f"moe-gpu ranks={ranks} node_size={node_size} dtype={dtype} rdma_buffers={rdma} hidden={cfg['hidden']} "
              f"tokens={cfg['max_tokens']} experts={cfg['experts']} mps={mps.split(':')[0]} sm_partition=none "
              f"graph_step_us_p50={med('step_us'):.1f} replays={cfg['replays']} "
              f"max_calc_diff={max(x['max_diff'] for x in results):.2e} exact=yes wall_s={med('wall_s'):.1f}")
    finally:
        _join(procs)


@pytest.mark.parametrize("ranks,node_size,stall_at", [(2, 2, "dispatch"), (2, 2, "combine"), (4, 2, "dispatch")],
                         ids=["2ranks-nvlink-dispatch", "2ranks-nvlink-combine", "4ranks-2nodes-dispatch"])
def test_a_stalled_rank_fails_the_others_with_invalid_outputs_and_a_clear_error(mps, ranks, node_size, stall_at):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    timeout_s = 3.0
    cfg = dict(port=store.port, job=uuid.uuid4().hex[:16], ranks=ranks, node_size=node_size, dtype="fp8",
               experts=8 * ranks, topk=8, hidden=7168, max_tokens=64, private_rows=16, timeout_s=timeout_s,
               stall_at=stall_at, stall_rank=ranks - 1, buffers=1)
    procs = _spawn(cfg, ranks)
    try:
        stalled_conn = procs[-1][0]
        assert _result(stalled_conn, ranks - 1, 120) == {}
        for r, (conn, _) in enumerate(procs[:-1]):
            res = _result(conn, r, 120)
            assert res["seconds"] < timeout_s + 30, f"rank {r} took {res['seconds']:.1f} s to give up"
            if stall_at == "dispatch":
                assert set(res["counts"]) == {M.MOE_INVALID_COUNT}, f"rank {r}: counts {res['counts']}"
                assert set(res["runs"]) == {-1}, f"rank {r}: runs {res['runs']}"
            else:
                assert res["nan_fraction"] == 1.0, f"rank {r}: {res['nan_fraction']:.3f} of the combined values NaN"
            assert f"{stall_at} receive on rank {r}" in res["check"] and "missing" in res["check"], res["check"]
            assert "missing" in res["next dispatch"], res["next dispatch"]
            print(f"moe-gpu-stall ranks={ranks} node_size={node_size} at={stall_at} rank={r} gave_up_s={res['seconds']:.1f} "
                  f"error={res['check'][:120]!r}")
        stalled_conn.send("release")
        assert _result(stalled_conn, ranks - 1, 60)["stalled"]
    finally:
        _join(procs)


@pytest.mark.parametrize("ranks,node_size,provider", [(2, 2, "tcp;ofi_rxm"), (4, 2, "shm")], ids=["2ranks-nvlink", "4ranks-2nodes"])
def test_the_deep_ep_shim_on_gpu_matches_the_oracle(mps, ranks, node_size, provider):
    """fabric_lib.moe.deep_ep.Buffer with CUDA tensors (tests/python/moe_roles.deep_ep_rank_main):
    DeepEP's shapes and layouts, two batches in flight, UE8M0 scales, every value exact."""
    import moe_roles as R

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    cfg = dict(provider=provider, ranks=ranks, node_size=node_size, experts=8 * ranks, topk=8, hidden=7168,
               max_tokens=32, dtype="fp8", steps=4, port=store.port, device="cuda:0")
    procs = _spawn(cfg, ranks, target=R.deep_ep_rank_main, wait_ready=False)
    try:
        R.deep_ep_results(procs, timeout=300)
        print(f"moe-gpu-deep-ep ranks={ranks} node_size={node_size} steps={cfg['steps']} exact=yes")
    finally:
        _join(procs)
