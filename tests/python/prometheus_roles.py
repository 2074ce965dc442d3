"""The two processes of test_prometheus.py, one engine each on tcp loopback: side 0 is a KV decode
rank, a weight-update inference rank and MoE rank 0, and serves its metrics through
fabric_lib.metrics and prometheus_client's HTTP server; side 1 is the KV prefill rank, the
training rank and MoE rank 1, and serves them from the engine's own endpoint (metrics_port).
They meet in the test's TCPStore, run what the test counts, report what they moved, and keep
their endpoints (whose metrics go with them) and servers up until told to stop."""

from __future__ import annotations

import threading
import traceback

import numpy as np

import fabric_lib as fl
from fabric_lib import kv

REQUESTS = 3   # KV requests, of 1, 2 and 3 pages
LAYERS = 4
UPDATES = 2    # weight update steps
MOE_STEPS = 3  # dispatch + combine
MOE_TOKENS = 6
HIDDEN = 128

LAYOUT = dict(num_layers=LAYERS, num_pages=8, page_tokens=4, kv_heads=2, head_dim=8, dtype_bytes=2)


def _ended(n: int):
    """An on_done callback and a wait for n calls of it (every status ok)."""
    seen = []
    cond = threading.Condition()

    def on_done(status):
        with cond:
            seen.append((status.ok, status.message))
            cond.notify_all()

    def wait(what: str):
        with cond:
            assert cond.wait_for(lambda: len(seen) == n, timeout=60), f"{what}: {len(seen)} of {n} ended"
        assert all(ok for ok, _ in seen), f"{what}: {seen}"

    return on_done, wait


def _kv(side: int, engine, store, keep: list) -> dict:
    layout = kv.make_layout(**LAYOUT)
    k = [np.full(layout.tensor_bytes, i + 1, np.uint8) for i in range(LAYERS)]
    v = [np.full(layout.tensor_bytes, i + 101, np.uint8) for i in range(LAYERS)]
    keep += [k, v]
    on_done, wait = _ended(REQUESTS)
    if side == 0:  # decode
        rx = kv.KvReceiver(engine, layout, k, v, group=7, total_heads=2)
        keep.append(rx)
        store.set("kv/desc", rx.descriptor())
        for q in range(1, REQUESTS + 1):
            store.set(f"kv/admit/{q}", rx.admit(q, list(range(q)), on_done=on_done, timeout_s=60.0))
    else:  # prefill
        tx = kv.KvSender(engine, layout, k, v, group=3, total_heads=2)
        keep.append(tx)
        tx.add_decoder(store.get("kv/desc"))
        for q in range(1, REQUESTS + 1):
            tx.begin(store.get(f"kv/admit/{q}"), list(range(q)), on_sent=on_done)
            for layer in range(LAYERS):
                tx.layer_done(q, layer)
    wait("KV requests")
    # K and V pages of every layer of every request, the same on both sides (TP 1 -> 1).
    return {"kv_bytes": 2 * layout.page_bytes * sum(range(1, REQUESTS + 1)) * LAYERS}


def _weights(side: int, engine, store, keep: list) -> dict:
    import torch

    from fabric_lib import weights as W

    params = [W.Param("w", (256, 256), fp8=True), W.Param("b", (128, 64))]
    pieces = [W.Piece("w"), W.Piece("b")]
    if side == 1:  # the one training rank: no gathers, so its bytes are the inference rank's
        t = W.Trainer(engine, params, pieces, rank=0, world=1, infer_world=1, store=store, job="prom")
        keep.append(t)
        sent = 0
        for step in range(UPDATES):
            for p in params:
                t.shard(p.name).copy_(torch.randn(*p.shape).to(torch.bfloat16))
            sent += t.update(step)["bytes"]
        return {"weights_bytes": sent}
    i = W.Inference(engine, params, pieces, rank=0, world=1, train_world=1, store=store, job="prom")
    keep.append(i)
    for step in range(UPDATES):
        i.update(step)
    return {}


def _moe(side: int, engine, store, keep: list) -> dict:
    import torch

    from fabric_lib import moe

    a2a = moe.AllToAll(engine, rank=side, world_size=2, node_size=1, num_experts=4, experts_per_token=2,
                       hidden=HIDDEN, max_tokens=8, dispatch_dtype="bf16", store=store, job="prom", timeout_s=60.0)
    keep.append(a2a)
    g = torch.Generator().manual_seed(side)
    for _ in range(MOE_STEPS):
        x = torch.randn(MOE_TOKENS, HIDDEN, generator=g).to(torch.bfloat16)
        topk = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(MOE_TOKENS)])
        recv_x, _, _, _, handle = a2a.dispatch(x, topk)
        weights = torch.full((MOE_TOKENS, 2), 0.5)
        a2a.combine(recv_x.clone(), weights, handle)
    return {}


def rank_main(conn, cfg: dict) -> None:
    """cfg: side (0, 1), store_port, metrics_port. Sends "ready" once its metrics are served, then
    what it moved (a dict) once done; answers "text" (its engine's metrics_text) and "stop"."""
    try:
        import torch.distributed as dist

        side = cfg["side"]
        extra = {"metrics_port": cfg["metrics_port"]} if side == 1 else {}
        with fl.TransferEngine(provider="tcp;ofi_rxm", nics=["127.0.0.1"], transfer_timeout_s=30.0, **extra) as engine:
            server = None
            if side == 0:
                import prometheus_client

                from fabric_lib import metrics

                registry = prometheus_client.CollectorRegistry()
                metrics.register(engine, registry)
                started = prometheus_client.start_http_server(cfg["metrics_port"], addr="127.0.0.1",
                                                              registry=registry)
                server = started[0] if started else None  # (server, thread) from prometheus_client 0.20
            conn.send("ready")
            store = dist.TCPStore("127.0.0.1", cfg["store_port"], is_master=False, wait_for_workers=False)
            keep: list = []
            moved: dict = {}
            for part in (_kv, _weights, _moe):
                moved.update(part(side, engine, store, keep))
            conn.send(moved)
            while True:
                cmd = conn.recv()
                if cmd == "stop":
                    break
                if cmd == "text":
                    conn.send(engine.metrics_text())
            for obj in reversed(keep):
                if hasattr(obj, "close"):
                    obj.close()
            if server is not None:
                server.shutdown()
        conn.send("bye")
    except Exception:  # noqa: BLE001 - reported to the test
        conn.send("error: " + traceback.format_exc())
