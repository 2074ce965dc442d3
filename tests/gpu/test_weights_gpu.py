"""RL weight updates with CUDA arenas (run by tests/gpu/run.sh on the GPU machine; skipped where torch
has no CUDA): 4 training and 2 inference processes share GPU 0 through cuda_ipc, the training ranks
quantize on the GPU (the torch unit hook), 20 steps of changing weights land bit for bit."""

import multiprocessing as mp
import os
import statistics
import sys
import uuid

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("torch sees no CUDA device", allow_module_level=True)

import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples", "rl_weights"))
import moe  # noqa: E402


def test_twenty_steps_between_gpu_processes_land_bit_for_bit():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    steps = list(range(20))
    base = dict(port=store.port, job=uuid.uuid4().hex, steps=steps, gpu=True, provider="")
    ranks = []
    for side, fn, n in (("i", moe.inference, moe.INFER), ("t", moe.trainer, moe.TRAIN)):
        for r in range(n):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=fn, args=(child, dict(base, rank=r)), daemon=True)
            p.start()
            ranks.append((side, r, parent, p))
    try:
        for side, r, conn, _ in ranks:
            assert conn.poll(180), f"{side}{r} did not start"
            msg = conn.recv()
            assert msg == "ready", msg
        slowest = {}  # step -> the slowest training rank's update, as examples/rl_weights/run.py reports
        for side, r, conn, _ in ranks:
            for _ in steps:
                assert conn.poll(180), f"{side}{r}: no result"
                msg = conn.recv()
                assert not isinstance(msg, str), msg
                assert msg[0] == "ok", (side, r, msg)
                if side == "i":
                    assert msg[2] == [], f"inference rank {r} step {msg[1]}: {msg[2]} differ"
                else:
                    slowest[msg[1]] = max(slowest.get(msg[1], 0.0), msg[2]["total_ms"])
        totals = list(slowest.values())
        print(f"weights-gpu steps={len(steps)} update_ms_p50={statistics.median(totals):.2f} "
              f"update_ms_max={max(totals):.2f} (the slowest training rank's, per step)")
    finally:
        for _, _, _, p in ranks:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
