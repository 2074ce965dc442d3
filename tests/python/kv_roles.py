"""Prefill and decode ranks as processes for the KV tests: each holds a host-memory paged KV cache,
announces itself in etcd, and is driven by commands over its pipe. Page contents are a function of
(request, layer, K/V, global head, prompt page, token, byte), so a decode rank checks every byte it
holds whatever prefill TP wrote it."""

from __future__ import annotations

import os
import threading
import time
import traceback

import numpy as np

import fabric_lib as fl
from fabric_lib import kv
from fabric_lib.directory import EtcdDirectory, StoreDirectory

LAYERS = 4
PAGES = 48
PAGE_TOKENS = 4
HEAD_DIM = 8  # bytes per head per token: HEAD_DIM * 2
TOTAL_HEADS = 4
EXTRA_SLOTS = 16  # slot = request % 16: the tests keep fewer than 16 consecutive requests in flight
EXTRA_BYTES = 96
HEAD_BYTES = HEAD_DIM * 2


def layout(tp_size: int) -> kv.KvLayout:
    return kv.make_layout(num_layers=LAYERS, num_pages=PAGES, page_tokens=PAGE_TOKENS,
                          kv_heads=TOTAL_HEADS // tp_size, head_dim=HEAD_DIM, dtype_bytes=2)


def page_content(request: int, layer: int, value: bool, first_head: int, heads: int,
                 prompt_page: int) -> np.ndarray:
    """One page of one tensor, [PAGE_TOKENS, heads, HEAD_BYTES] bytes, for global heads
    first_head .. first_head + heads."""
    t = np.arange(PAGE_TOKENS).reshape(-1, 1, 1)
    h = np.arange(first_head, first_head + heads).reshape(1, -1, 1)
    b = np.arange(HEAD_BYTES).reshape(1, 1, -1)
    v = request * 7 + layer * 13 + int(value) * 29 + h * 31 + prompt_page * 17 + t * 3 + b
    return (v % 251 + 1).astype(np.uint8)


def extras_content(request: int) -> np.ndarray:
    return ((request * 11 + np.arange(EXTRA_BYTES)) % 253 + 1).astype(np.uint8)


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _directory(cfg: dict):
    """etcd (cfg["etcd"]: its URL), or a torch TCPStore the test serves (cfg["tcpstore"]: port)."""
    if cfg.get("tcpstore"):
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", cfg["tcpstore"], is_master=False, wait_for_workers=False)
        return StoreDirectory(store, ttl_s=cfg["ttl_s"], prefix=cfg["cluster"] + "/")
    return EtcdDirectory(cfg["etcd"], ttl_s=cfg["ttl_s"])


def _engine(provider: str) -> fl.TransferEngine:
    return fl.TransferEngine(provider=provider, nics=[""] if provider == "shm" else ["127.0.0.1"],
                             transfer_timeout_s=5.0)


class _Cache:
    def __init__(self, tp_size: int):
        self.layout = layout(tp_size)
        n = self.layout.tensor_bytes
        self.k = [np.zeros(n, np.uint8) for _ in range(LAYERS)]
        self.v = [np.zeros(n, np.uint8) for _ in range(LAYERS)]
        self.extras = np.zeros(EXTRA_SLOTS * EXTRA_BYTES, np.uint8)

    def page(self, layer: int, value: bool, page: int) -> np.ndarray:
        pb = self.layout.page_bytes
        t = (self.v if value else self.k)[layer]
        return t[page * pb:(page + 1) * pb].reshape(PAGE_TOKENS, self.layout.kv_heads, HEAD_BYTES)


def prefill_main(conn, cfg: dict) -> None:
    """A prefill rank: begins every request it is admitted for, sends its layers one by one
    (cfg["layer_sleep_s"] apart) and its extras; answers "stats" and "stop"."""
    try:
        tp_size, tp_rank = cfg["tp_size"], cfg["tp_rank"]
        heads = TOTAL_HEADS // tp_size
        with _engine(cfg["provider"]) as engine, _directory(cfg) as d:
            cache = _Cache(tp_size)
            tx = kv.KvSender(engine, cache.layout, cache.k, cache.v, group=cfg["group"], tp_size=tp_size,
                             tp_rank=tp_rank, total_heads=TOTAL_HEADS, extras=cache.extras,
                             extra_slots=EXTRA_SLOTS)
            pf = kv.Prefiller(engine, tx, d, cluster=cfg["cluster"])
            pf.watch(0.2)
            free = list(range(PAGES))
            lock = threading.Lock()
            counts = {"sent": 0, "failed": 0, "begun": 0}
            rng = np.random.default_rng(cfg["group"] * 10 + tp_rank)
            conn.send("ready")
            while True:
                if conn.poll():
                    cmd = conn.recv()
                    if cmd == "stop":
                        break
                    if cmd == "stats":
                        pf.refresh()
                        with lock:
                            conn.send(dict(counts, in_flight=tx.in_flight, peers=engine.peer_count,
                                           rss_kib=rss_kib(), free=len(free)))
                    continue
                req = pf.next_request(timeout=0.02)
                if req is None:
                    continue
                with lock:
                    order = rng.permutation(len(free))[:req.pages]
                    src = [free[i] for i in order]
                    for p in src:
                        free.remove(p)
                for i, p in enumerate(src):
                    for layer in range(LAYERS):
                        for value in (False, True):
                            cache.page(layer, value, p)[:] = page_content(
                                req.request, layer, value, tp_rank * heads, heads, i)
                slot = None
                if req.extra_slot is not None and tp_rank == 0:
                    slot = req.request % EXTRA_SLOTS
                    cache.extras[slot * EXTRA_BYTES:(slot + 1) * EXTRA_BYTES] = extras_content(req.request)

                def on_sent(status, src=src):
                    with lock:
                        counts["sent" if status.ok else "failed"] += 1
                        free.extend(src)  # the pages are ours again

                try:  # a decode group that joined after the watch's last refresh is looked up here
                    pf.begin(req, src, extra_slot=slot, on_sent=on_sent)
                except fl.FabricError:  # refused: its decode ranks were told
                    with lock:
                        counts["refused"] = counts.get("refused", 0) + 1
                        free.extend(src)
                    continue
                counts["begun"] += 1
                try:
                    for layer in range(LAYERS):
                        if cfg["layer_sleep_s"]:
                            time.sleep(cfg["layer_sleep_s"])
                        tx.layer_done(req.request, layer)
                    tx.extras_done(req.request)
                except fl.FabricError:
                    pass  # cancelled by its decode side, or its decode group was removed
            pf.close()
        conn.send("bye")
    except Exception:  # noqa: BLE001 - reported to the test
        conn.send("error: " + traceback.format_exc())


def decode_main(conn, cfg: dict) -> None:
    """A decode rank: admits what the test says ("admit", id, pages, prefill_group, extras),
    checks every byte of a request that landed ("wait", id), waits until it can admit for a
    prefill group ("paired", group, timeout_s), answers "groups", "stats", "stop"."""
    try:
        tp_size, tp_rank = cfg["tp_size"], cfg["tp_rank"]
        heads = TOTAL_HEADS // tp_size
        with _engine(cfg["provider"]) as engine, _directory(cfg) as d:
            cache = _Cache(tp_size)
            rx = kv.KvReceiver(engine, cache.layout, cache.k, cache.v, group=cfg["group"], tp_size=tp_size,
                               tp_rank=tp_rank, total_heads=TOTAL_HEADS, extras=cache.extras,
                               extra_slots=EXTRA_SLOTS, late_writes_s=cfg.get("late_writes_s", 10.0))
            dec = kv.Decoder(engine, rx, d, cluster=cfg["cluster"])
            ended: dict[int, object] = {}
            cond = threading.Condition()
            admitted: dict[int, tuple] = {}
            conn.send("ready")
            while True:
                cmd = conn.recv()
                if cmd == "stop":
                    break
                if cmd == "groups":
                    conn.send(sorted(dec.prefill_groups()))
                elif cmd[0] == "paired":
                    try:
                        dec.wait_paired(cmd[1], timeout_s=cmd[2])
                        conn.send("paired")
                    except TimeoutError as e:
                        conn.send(f"timeout: {e}")
                elif cmd == "stats":
                    conn.send(dict(in_flight=rx.in_flight, peers=engine.peer_count, rss_kib=rss_kib()))
                elif cmd[0] == "admit":
                    _, request, pages, group, extras, timeout_s = cmd

                    def on_done(status, request=request):
                        with cond:
                            ended[request] = (status.ok, status.message)
                            cond.notify_all()

                    admitted[request] = (pages, extras)
                    dec.admit(request, pages, prefill_group=group,
                              extra_slot=(request % EXTRA_SLOTS) if extras else None,
                              timeout_s=timeout_s, on_done=on_done)
                    conn.send("admitted")
                elif cmd[0] == "wait":
                    _, request, timeout_s = cmd
                    with cond:
                        cond.wait_for(lambda: request in ended, timeout=timeout_s)
                        result = ended.pop(request, None)
                    pages, extras = admitted.pop(request)
                    if result is None:
                        conn.send(("pending", ""))
                        continue
                    ok, message = result
                    if ok:
                        bad = 0
                        for i, p in enumerate(pages):
                            for layer in range(LAYERS):
                                for value in (False, True):
                                    want = page_content(request, layer, value, tp_rank * heads, heads, i)
                                    bad += int((cache.page(layer, value, p) != want).sum())
                        if extras:
                            s = request % EXTRA_SLOTS
                            bad += int((cache.extras[s * EXTRA_BYTES:(s + 1) * EXTRA_BYTES]
                                        != extras_content(request)).sum())
                        message = f"{bad} bytes differ" if bad else ""
                        ok = bad == 0
                    conn.send(("ok" if ok else "failed", message))
            dec.close()
        conn.send("bye")
    except Exception:  # noqa: BLE001
        conn.send("error: " + traceback.format_exc())


def pid() -> int:
    return os.getpid()
