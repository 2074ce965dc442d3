"""A disaggregated prefill/decode pair moving KV-cache pages layer by layer, found through etcd.

    python3 examples/kv_transfer/run.py [--etcd URL] [--provider shm] [--requests 3] [--layers 8]

Starts a private etcd on loopback unless --etcd names one, then two processes: a prefill rank
(KvSender + Prefiller) and a decode rank (KvReceiver + Decoder), each with a host-memory paged
cache. The decode rank finds the prefill rank in etcd, admits each request into pages it picked,
and prints when each layer landed; the prefill rank "computes" each layer (a sleep), and its pages
go out the moment it is done. Every byte is checked on the decode side.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import numpy as np

import fabric_lib as fl
from fabric_lib import kv
from fabric_lib.directory import EtcdDirectory

PAGES, PAGE_TOKENS, HEADS, HEAD_DIM = 64, 16, 4, 64


def layout(layers: int) -> kv.KvLayout:
    return kv.make_layout(num_layers=layers, num_pages=PAGES, page_tokens=PAGE_TOKENS, kv_heads=HEADS,
                          head_dim=HEAD_DIM)


def content(request: int, layer: int, value: int, page: int, nbytes: int) -> np.ndarray:
    return ((request * 7 + layer * 13 + value * 29 + page * 17 + np.arange(nbytes)) % 251 + 1).astype(np.uint8)


def engine(provider: str) -> fl.TransferEngine:
    return fl.TransferEngine(provider=provider, nics=[""] if provider == "shm" else ["127.0.0.1"])


def prefill(args: argparse.Namespace) -> None:
    lay = layout(args.layers)
    k = [np.zeros(lay.tensor_bytes, np.uint8) for _ in range(args.layers)]
    v = [np.zeros(lay.tensor_bytes, np.uint8) for _ in range(args.layers)]
    with engine(args.provider) as e, EtcdDirectory(args.etcd, ttl_s=3) as d:
        tx = kv.KvSender(e, lay, k, v, group=1, total_heads=HEADS)
        pf = kv.Prefiller(e, tx, d, cluster="example")
        pf.watch(0.2)  # decode groups that join are added here, or at their first request
        for _ in range(args.requests):
            req = pf.next_request(timeout=60)
            if req is None:
                raise SystemExit("prefill: no request came")
            src = list(range(req.pages))  # this rank's pages for the prompt
            pb = lay.page_bytes
            for layer in range(args.layers):
                for i, p in enumerate(src):
                    k[layer][p * pb:(p + 1) * pb] = content(req.request, layer, 0, i, pb)
                    v[layer][p * pb:(p + 1) * pb] = content(req.request, layer, 1, i, pb)
            sent = fl.DoneFlag()
            pf.begin(req, src, on_sent=sent)
            for layer in range(args.layers):
                time.sleep(args.layer_ms / 1000)  # the layer's compute
                tx.layer_done(req.request, layer)
            tx.extras_done(req.request)
            sent.wait(30)
            print(f"prefill: request {req.request}: {req.pages} pages x {args.layers} layers sent "
                  f"({'ok' if sent.ok else 'failed'})", flush=True)
        pf.close()


def decode(args: argparse.Namespace) -> None:
    lay = layout(args.layers)
    k = [np.zeros(lay.tensor_bytes, np.uint8) for _ in range(args.layers)]
    v = [np.zeros(lay.tensor_bytes, np.uint8) for _ in range(args.layers)]
    rng = np.random.default_rng(1)
    with engine(args.provider) as e, EtcdDirectory(args.etcd, ttl_s=3) as d:
        rx = kv.KvReceiver(e, lay, k, v, group=11, total_heads=HEADS)
        dec = kv.Decoder(e, rx, d, cluster="example")
        dec.wait_paired(1, timeout_s=60)  # prefill group 1 is up: requests for it can be admitted
        total, failures = 0, 0
        for request in range(1, args.requests + 1):
            n = int(rng.integers(4, 17))
            pages = [int(p) for p in rng.permutation(PAGES)[:n]]
            landed, done = [], threading.Event()
            status = []
            t0 = time.perf_counter()
            dec.admit(request, pages, prefill_group=1, timeout_s=30,
                      on_layer=lambda layer: landed.append((layer, time.perf_counter() - t0)),
                      on_done=lambda s: (status.append(s), done.set()))
            done.wait(60)
            pb = lay.page_bytes
            bad = sum(int((t[layer][p * pb:(p + 1) * pb] != content(request, layer, val, i, pb)).sum())
                      for layer in range(args.layers) for val, t in ((0, k), (1, v))
                      for i, p in enumerate(pages))
            failures += int(bad > 0 or not (status and status[0].ok))
            moved = 2 * n * pb * args.layers
            total += moved
            timeline = " ".join(f"L{layer}@{ms * 1000:.1f}" for layer, ms in sorted(landed))
            print(f"decode: request {request}: {n} pages, {moved / 1024:.0f} KiB, "
                  f"{'ok' if status and status[0].ok else status}, {bad} bytes differ; "
                  f"layers landed (ms after admit): {timeline}", flush=True)
        print(f"decode: {total / 1048576:.2f} MiB moved in {args.requests} requests, "
              f"{'every byte checked: OK' if not failures else f'{failures} request(s) FAILED'}", flush=True)
        dec.close()
        if failures:
            raise SystemExit(1)


def start_etcd() -> tuple[subprocess.Popen, str, str]:
    etcd = shutil.which("etcd")
    if etcd is None:
        raise SystemExit("no etcd: apt-get install etcd-server, or pass --etcd URL")
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    url, peer = f"http://127.0.0.1:{ports[0]}", f"http://127.0.0.1:{ports[1]}"
    data = tempfile.mkdtemp(prefix="kv-example-etcd-")
    proc = subprocess.Popen([etcd, "--name", "kv-example", "--data-dir", data, "--listen-client-urls", url,
                             "--advertise-client-urls", url, "--listen-peer-urls", peer,
                             "--initial-advertise-peer-urls", peer, "--initial-cluster", f"kv-example={peer}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(200):
        try:
            with urllib.request.urlopen(url + "/health", timeout=1):
                return proc, url, data
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("etcd did not start")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--etcd", help="an etcd client URL (default: start one on loopback)")
    ap.add_argument("--provider", default="tcp;ofi_rxm")
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--layer-ms", type=float, default=2.0, help="simulated compute per layer")
    args = ap.parse_args()
    proc = data = None
    if not args.etcd:
        proc, args.etcd, data = start_etcd()
    try:
        ctx = mp.get_context("spawn")
        roles = [ctx.Process(target=prefill, args=(args,)), ctx.Process(target=decode, args=(args,))]
        for p in roles:
            p.start()
        for p in roles:
            p.join(120)
        return 0 if all(p.exitcode == 0 for p in roles) else 1
    finally:
        if proc:
            proc.terminate()
            proc.wait(10)
            shutil.rmtree(data, ignore_errors=True)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(__file__))
    sys.exit(main())
