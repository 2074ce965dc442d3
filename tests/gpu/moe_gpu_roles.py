"""MoE ranks with CUDA kernels (tests/gpu/test_moe_gpu.py): each rank is a process on GPU 0 that
builds an AllToAll(device="cuda:0") over a TCPStore, runs eager steps of skewed random routing
(tests/python/moe_roles.make_input), then captures dispatch + experts + combine in one CUDA graph
and replays it with fresh routing copied into the captured inputs. DeepEP-style checks
(test_low_latency.py): counts against the bincount of every rank's routing, each received row is
its source token, and the combine of the identity expert (the dequantized rows) against
x * sum of the used weights within a relative error (calc_diff), plus the oracle bit for bit."""

from __future__ import annotations

import os
import sys
import time
import traceback

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import moe_roles as R  # noqa: E402

import fabric_lib as fl  # noqa: E402
from fabric_lib import moe as M  # noqa: E402

DEV = torch.device("cuda", 0)


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepEP's relative difference: 1 - 2 <x, y> / (|x|^2 + |y|^2), in float64."""
    x, y = x.double() + 1, y.double() + 1
    denom = (x * x + y * y).sum()
    return float(1 - 2 * (x * y).sum() / denom)


def graph_input(cfg: dict, rank: int, replay: int) -> tuple:
    """make_input with every rank sending max_tokens tokens (a captured graph's shapes are fixed)."""
    c = dict(cfg, seed=cfg.get("seed", 7) + 1)
    x, idx, w = R.make_input(c, rank, replay)
    n, T = x.shape[0], cfg["max_tokens"]
    if n < T:  # pad with fresh tokens whose slots are all masked: routing still varies per replay
        g = torch.Generator().manual_seed(rank * 7 + replay)
        x = torch.cat([x, (torch.randn(T - n, cfg["hidden"], generator=g) * 2).to(torch.bfloat16)])
        idx = torch.cat([idx, torch.full((T - n, cfg["topk"]), -1, dtype=torch.int64)])
        w = torch.cat([w, torch.rand(T - n, cfg["topk"], generator=g)])
    return x, idx, w


class GpuRank:
    def __init__(self, cfg: dict, a2a: M.AllToAll, rank: int) -> None:
        self.cfg, self.a2a, self.rank = cfg, a2a, rank
        self.L, self.M = a2a.local_experts, a2a.rows_per_expert
        self.fp8 = cfg["dtype"] == "fp8"

    def experts(self, recv: tuple, expert_out: torch.Tensor) -> None:
        """The identity expert, as DeepEP's test: each row's (dequantized) values in BF16, over
        the whole buffer (stale rows too: no host sync on the counts, so a graph can hold it)."""
        rx, rs, _, _ = recv
        expert_out.copy_(M.dequantize_fp8_tokens(rx, rs).to(torch.bfloat16) if self.fp8 else rx)

    def check(self, tag: str, inputs: list, recv: tuple, out: torch.Tensor, exact: bool) -> tuple:
        """(problems, calc_diff of combine against x * sum of weights)."""
        cfg, r, L = self.cfg, self.rank, self.L
        rx, rs, counts, src = (t.cpu() if t is not None else None for t in recv)
        out = out.cpu()
        bad = R.counts_problem(cfg, r, L, inputs, counts, tag)
        if bad:
            return bad, float("nan")
        forms = [R.dispatch_form(cfg, x) for x, _, _ in inputs]
        if exact:
            bad += R.row_problems(cfg, r, L, forms, (rx, rs, counts, src), tag)
        x, idx, w = inputs[r]
        if torch.isnan(out.float()).any():
            bad.append(f"{tag}: NaN in the combined output")
        # DeepEP: combine of the identity expert against x * the sum of the used weights.
        ref = x.float() * w.masked_fill(idx < 0, 0).sum(1, keepdim=True)
        diff = calc_diff(ref, out.float()) if x.shape[0] else 0.0
        if diff > (9e-4 if self.fp8 else 1e-5):
            bad.append(f"{tag}: calc_diff {diff:.2e} against x * sum(w)")
        if exact:
            xf = R.values_of(cfg, *forms[r]).to(torch.bfloat16)
            rows = xf.unsqueeze(1).expand(x.shape[0], cfg["topk"], cfg["hidden"])
            want = M.reference_combine_rows(idx, w, rows)
            if not torch.equal(out.view(torch.int16), want.view(torch.int16)):
                n_bad = int((out.view(torch.int16) != want.view(torch.int16)).sum())
                bad.append(f"{tag}: combine differs from the oracle in {n_bad} of {out.numel()} values")
        return bad, diff


def _events_us(a: torch.cuda.Event, b: torch.cuda.Event) -> float:
    return a.elapsed_time(b) * 1e3


def overlap_steps(cfg: dict, me: GpuRank, steps: int) -> list:
    """Two batches in flight (two-batch overlap): dispatch A, dispatch B (both sent before either
    is received), then combine A and B, received in the opposite order; every output exact."""
    a2a, W, bad = me.a2a, cfg["ranks"], []
    outs = [torch.zeros(me.L, me.M, cfg["hidden"], dtype=torch.bfloat16, device=DEV) for _ in range(2)]
    for step in range(1, steps + 1):
        inputs = [[R.make_input(cfg, s, 5000 + 2 * step + b) for s in range(W)] for b in range(2)]
        mine = [[t.to(DEV) for t in inputs[b][me.rank]] for b in range(2)]
        handles = [a2a.dispatch_send(x, idx) for x, idx, _ in mine]
        recvs = [a2a.dispatch_recv(h) for h in handles]
        for b in range(2):
            me.experts(recvs[b], outs[b])
            a2a.combine_send(outs[b], handles[b])
        combined = {b: a2a.combine_recv(mine[b][2], handles[b]) for b in (1, 0)}
        torch.cuda.synchronize()
        a2a.check()
        for b in range(2):
            bad += me.check(f"overlap step {step} batch {'AB'[b]}", inputs[b], recvs[b], combined[b], exact=True)[0]
    return bad


def stalled(conn, cfg: dict, me: GpuRank) -> dict:
    """One rank (cfg["stall_rank"]) stops taking part at step 2, before its dispatch
    (stall_at "dispatch") or before its combine ("combine"), and waits for the test's release;
    every other rank's receive kernel gives up after timeout_s. What those ranks then see: the
    step's outputs marked invalid (every count MOE_INVALID_COUNT, or every combined value NaN),
    check() and the next call raising a clear error."""
    a2a, H, at = me.a2a, cfg["hidden"], cfg["stall_at"]
    expert_out = torch.zeros(me.L, me.M, H, dtype=torch.bfloat16, device=DEV)
    for step in (1, 2):
        inputs = [R.make_input(cfg, s, step) for s in range(cfg["ranks"])]
        x, idx, w = (t.to(DEV) for t in inputs[me.rank])
        stops = me.rank == cfg["stall_rank"] and step == 2
        if stops and at == "dispatch":
            break
        t0 = time.monotonic()
        *recv, h = a2a.dispatch(x, idx)
        if stops:
            break
        out = None
        if step == 1 or at == "combine":
            me.experts(recv, expert_out)
            out = a2a.combine(expert_out, w, h)
        torch.cuda.synchronize()
        seconds = time.monotonic() - t0
    if me.rank == cfg["stall_rank"]:
        conn.send(("stalled", {}))
        assert conn.recv() == "release"
        return dict(stalled=True)
    result = dict(seconds=seconds, counts=recv[2].tolist(), runs=a2a.runs(h).flatten().tolist(),
                  nan_fraction=float(out.float().isnan().float().mean()) if out is not None else 0.0)
    for what, call in (("check", a2a.check), ("next dispatch", lambda: a2a.dispatch_send(x, idx))):
        try:
            call()
            result[what] = "accepted"
        except fl.FabricError as e:
            result[what] = str(e)
    return result


def run(conn, cfg: dict, me: GpuRank) -> dict:
    a2a, H = me.a2a, cfg["hidden"]
    expert_out = torch.zeros(me.L, me.M, H, dtype=torch.bfloat16, device=DEV)
    bad, diffs, eager_d, eager_c = [], [], [], []
    for step in range(1, cfg["eager_steps"] + 1):
        inputs = [R.make_input(cfg, s, step) for s in range(cfg["ranks"])]
        x, idx, w = (t.to(DEV) for t in inputs[me.rank])
        e = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        e[0].record()
        *recv, h = a2a.dispatch(x, idx)
        e[1].record()
        me.experts(recv, expert_out)
        e[2].record()
        out = a2a.combine(expert_out, w, h)
        e[3].record()
        torch.cuda.synchronize()
        a2a.check()
        eager_d.append(_events_us(e[0], e[1]))
        eager_c.append(_events_us(e[2], e[3]))
        b, d = me.check(f"eager step {step}", inputs, recv, out, exact=True)
        bad += b
        diffs.append(d)
    bad += overlap_steps(cfg, me, cfg.get("overlap_steps", 4))
    # One graph: quantization, dispatch, the experts, combine; inputs and out fixed tensors.
    T, K = cfg["max_tokens"], cfg["topk"]
    sx = torch.zeros(T, H, dtype=torch.bfloat16, device=DEV)
    sidx = torch.full((T, K), -1, dtype=torch.int64, device=DEV)
    sw = torch.zeros(T, K, dtype=torch.float32, device=DEV)
    sout = torch.empty(T, H, dtype=torch.bfloat16, device=DEV)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        *grecv, gh = a2a.dispatch(sx, sidx)
        me.experts(grecv, expert_out)
        a2a.combine(expert_out, sw, gh, sout)
    replay_us = []
    for i in range(cfg["replays"]):
        inputs = [graph_input(cfg, s, i) for s in range(cfg["ranks"])]
        x, idx, w = inputs[me.rank]
        sx.copy_(x)
        sidx.copy_(idx)
        sw.copy_(w)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        graph.replay()
        e1.record()
        torch.cuda.synchronize()
        a2a.check()
        replay_us.append(_events_us(e0, e1))
        b, d = me.check(f"replay {i}", inputs, grecv, sout, exact=i % 10 == 0 or i == cfg["replays"] - 1)
        bad += b
        diffs.append(d)
        if len(bad) > 5:
            break
    # Back to back, no host work between replays: the ranks run in step (the times above include
    # waiting for ranks still checking their last replay), the last input again.
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(2 * cfg["timed_replays"])]
    torch.cuda.synchronize()
    for i in range(cfg["timed_replays"]):
        marks[2 * i].record()
        graph.replay()
        marks[2 * i + 1].record()
    torch.cuda.synchronize()
    a2a.check()
    b, d = me.check("timed replays", inputs, grecv, sout, exact=True)
    timed = [_events_us(marks[2 * i], marks[2 * i + 1]) for i in range(cfg["timed_replays"])]
    return dict(bad=bad + b, max_diff=max(diffs + [d]), eager_dispatch_us=float(np.median(eager_d)),
                eager_combine_us=float(np.median(eager_c)), replay_us=float(np.median(replay_us)),
                step_us=float(np.median(timed)), replays=len(replay_us), writes=a2a.proxy_stats().writes)


def rank_main(conn, cfg: dict) -> None:
    try:
        import torch.distributed as dist

        if cfg.get("mps_share"):
            # Read when the CUDA context is made (below): this rank's share of the SMs under MPS.
            os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(cfg["mps_share"])
        if cfg.get("cuda_connections"):
            # Also read at context creation: hardware queues for this process's streams.
            os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = str(cfg["cuda_connections"])
        torch.cuda.set_device(DEV)
        torch.set_num_threads(2)
        rank = cfg["rank"]
        # rdma_buffers "device": the regions between nodes in GPU memory, written through the
        # engine's cuda_ipc domain (the proxy's WRITEs become GPU copies between the processes).
        on_device = cfg.get("rdma_buffers", "host") == "device"
        extra = dict(cuda_device=0, cuda_ipc=True) if on_device else {}
        with fl.TransferEngine(provider="shm", nics=[""], **extra) as engine:
            store = dist.TCPStore("127.0.0.1", cfg["port"], is_master=False, wait_for_workers=False)
            a2a = M.AllToAll(engine, rank=rank, world_size=cfg["ranks"], node_size=cfg["node_size"],
                             num_experts=cfg["experts"], experts_per_token=cfg["topk"], hidden=cfg["hidden"],
                             max_tokens=cfg["max_tokens"], dispatch_dtype=cfg["dtype"],
                             private_rows=cfg.get("private_rows", 32), timeout_s=cfg.get("timeout_s", 30.0),
                             device=DEV, store=store, job=cfg["job"], num_sms=cfg.get("num_sms", 0),
                             buffers=cfg.get("buffers", 2), rdma_buffers=cfg.get("rdma_buffers", "host"))
            conn.send("ready")
            t0 = time.monotonic()
            result = (stalled if cfg.get("stall_at") else run)(conn, cfg, GpuRank(cfg, a2a, rank))
            result["wall_s"] = time.monotonic() - t0
            torch.cuda.synchronize()
            a2a.close()
        conn.send(("done", result))
    except Exception:  # noqa: BLE001 - the failure goes back to the test
        conn.send("error " + traceback.format_exc())
