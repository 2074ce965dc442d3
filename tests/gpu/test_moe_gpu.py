"""MoE dispatch/combine with CUDA kernels from Python (run by tests/gpu/run.sh on the GPU machine;
skipped where torch has no CUDA): 2 and 4 rank processes sharing GPU 0, as one NVLink domain
(node_size = ranks: CUDA IPC only) and as 2 "nodes" (node_size = ranks / 2: the other node through
host-pinned buffers over the shm provider). Eager steps, then dispatch + experts + combine captured
in one CUDA graph and replayed 100 times with fresh routing; DeepEP-style checks (moe_gpu_roles.py)
and the oracle bit for bit. Prints one `moe-gpu ...` line per configuration (graph_step_us: one
replay of dispatch + identity experts + combine, 20 back to back, CUDA events, p50 over ranks).

Kernels of processes sharing a GPU run concurrently only under MPS; without it they time-slice
(slower, still correct: every wait is bounded and the timeouts are generous). The module starts an
MPS daemon where nvidia-cuda-mps-control exists and a CUDA client then works under it, and says
whether it did. Under MPS each rank gets 100 / ranks percent of the SMs
(CUDA_MPS_ACTIVE_THREAD_PERCENTAGE): with the whole GPU each, one rank's receive kernel, spinning
on every SM, starves the other rank's send kernel it waits for (both time out) - a hazard of
ranks sharing a GPU only, where one GPU per rank has none."""

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

_PROBE = "import torch; x = torch.ones(8, device='cuda'); assert float((x * 2).sum()) == 16.0"


def _mps_control(*args, stdin=None):
    return subprocess.run(["nvidia-cuda-mps-control", *args], input=stdin, capture_output=True, text=True, timeout=30)


@pytest.fixture(scope="module")
def mps():
    """'on' (started here, stopped at the end), 'absent' or 'failed: ...' (the test runs without)."""
    if shutil.which("nvidia-cuda-mps-control") is None:
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


@pytest.mark.parametrize("ranks,node_size,dtype", [(2, 2, "fp8"), (2, 1, "bf16"), (4, 4, "bf16"), (4, 2, "fp8")],
                         ids=["2ranks-nvlink-fp8", "2ranks-2nodes-bf16", "4ranks-nvlink-bf16", "4ranks-2nodes-fp8"])
def test_dispatch_and_combine_on_gpu_eager_and_in_a_cuda_graph(mps, ranks, node_size, dtype):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    cfg = dict(port=store.port, job=uuid.uuid4().hex[:16], ranks=ranks, node_size=node_size, dtype=dtype,
               experts=8 * ranks, topk=8, hidden=7168, max_tokens=64, private_rows=16, eager_steps=6, replays=100, timed_replays=20,
               timeout_s=60.0, mps_share=100 // ranks if mps == "on" else 0)
    ctx = mp.get_context("spawn")
    procs = []
    for r in range(ranks):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=moe_gpu_roles.rank_main, args=(child, dict(cfg, rank=r)), daemon=True)
        p.start()
        procs.append((parent, p))
    try:
        for r, (conn, _) in enumerate(procs):
            assert conn.poll(240), f"rank {r} did not start"
            msg = conn.recv()
            assert msg == "ready", f"rank {r}: {msg}"
        results = []
        for r, (conn, _) in enumerate(procs):
            assert conn.poll(540), f"rank {r}: no result"
            msg = conn.recv()
            assert not isinstance(msg, str), f"rank {r}: {msg}"
            results.append(msg[1])
        for r, res in enumerate(results):
            assert res["bad"] == [], f"rank {r}: {res['bad']}"
            assert res["replays"] == cfg["replays"]
            if node_size < ranks:
                assert res["writes"] > 0, "no WRITEs between the nodes"
        med = lambda k: sorted(x[k] for x in results)[len(results) // 2]  # noqa: E731
        print(f"moe-gpu ranks={ranks} node_size={node_size} dtype={dtype} hidden={cfg['hidden']} "
              f"tokens={cfg['max_tokens']} experts={cfg['experts']} mps={mps.split(':')[0]} "
              f"graph_step_us_p50={med('step_us'):.1f} replays={cfg['replays']} "
              f"max_calc_diff={max(x['max_diff'] for x in results):.2e} exact=yes wall_s={med('wall_s'):.1f}")
    finally:
        for _, p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
