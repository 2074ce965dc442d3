"""RL weight updates: 4 training processes write a small MoE transformer into 2 inference processes
after every "training step", directly, with one-sided WRITEs.

    python3 examples/rl_weights/run.py [--provider shm] [--steps 20] [--window 2] [--owner-rows 0] [--gpu]

The training ranks hold the model as FSDP2 shards (non-expert tensors over 4 ranks, experts EP 2 x
FSDP 2, BF16); the inference ranks hold it as they serve it (TP 2 attention with fused qkv, EP 2
experts with fused gate_up, FP8 e4m3 matrices with 128 x 128 block scales). Every rank publishes its
pieces and arena in a torch TCPStore this script serves, all build the same plan, and each step the
training ranks gather, quantize and write while the inference ranks wait for their immediate counts
and check every byte against the block quantization of the full weights. Prints each step's time
and where it went, and ends with
`weights steps=<n> train=4 infer=2 bytes_per_step=<n> update_ms_p50=<x> update_ms_max=<x> exact=<yes|no>`.
--gpu: CUDA arenas on GPU 0, every process sharing it through cuda_ipc.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import moe  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--provider", default="tcp;ofi_rxm", help="tcp;ofi_rxm or shm (host arenas)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--window", type=int, default=2, help="staging slots per training rank")
    ap.add_argument("--owner-rows", type=int, default=0, help="rows per quantizing unit (0: whole tensors)")
    ap.add_argument("--gpu", action="store_true", help="CUDA arenas on GPU 0 over cuda_ipc")
    args = ap.parse_args()

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    steps = list(range(args.steps))
    base = dict(port=store.port, job=uuid.uuid4().hex, provider=args.provider, steps=steps,
                owner_rows=args.owner_rows, gpu=args.gpu)
    ranks = []
    for side, fn, n in (("inference", moe.inference, moe.INFER), ("training", moe.trainer, moe.TRAIN)):
        for r in range(n):
            parent, child = ctx.Pipe()
            cfg = dict(base, rank=r, **({"window": args.window} if side == "training" else {}))
            p = ctx.Process(target=fn, args=(child, cfg), daemon=True)
            p.start()
            ranks.append((side, r, parent, p))
    for side, r, conn, _ in ranks:
        if not conn.poll(180):
            print(f"{side} rank {r} did not start", file=sys.stderr)
            return 1
        msg = conn.recv()
        if msg != "ready":
            print(f"{side} rank {r}: {msg}", file=sys.stderr)
            return 1
    print(f"{moe.TRAIN} training ranks -> {moe.INFER} inference ranks over "
          f"{'cuda_ipc (GPU 0)' if args.gpu else args.provider}, window {args.window}, "
          f"{'whole-tensor' if args.owner_rows == 0 else f'{args.owner_rows}-row'} units")
    per_step = {s: [] for s in steps}
    exact, failed = True, False
    for side, r, conn, _ in ranks:
        for _ in steps:
            if not conn.poll(180):
                print(f"{side} rank {r}: no result", file=sys.stderr)
                return 1
            msg = conn.recv()
            if isinstance(msg, str):
                print(f"{side} rank {r}: {msg}", file=sys.stderr)
                return 1
            if msg[0] != "ok":
                print(f"{side} rank {r} step {msg[1]}: {msg[2]}", file=sys.stderr)
                failed = True
                break
            if side == "inference" and msg[2]:
                print(f"inference rank {r} step {msg[1]}: {msg[2]} differ from the reference", file=sys.stderr)
                exact = False
            if side == "training":
                per_step[msg[1]].append(msg[2])
    for _, _, conn, p in ranks:
        p.join(timeout=60)
    if failed:
        return 1
    print("step  update_ms  gather_wait  quantize  ready_wait  drain   (max over training ranks)  writes  MiB")
    totals = []
    for s in steps:
        t = per_step[s]
        mx = lambda k: max(x[k] for x in t)  # noqa: E731
        totals.append(mx("total_ms"))
        print(f"{s:4d}  {mx('total_ms'):9.2f}  {mx('gather_wait_ms'):11.2f}  {mx('quantize_ms'):8.2f}  "
              f"{mx('ready_wait_ms'):10.2f}  {mx('drain_ms'):6.2f}  {'':26s}  {sum(x['writes'] for x in t):6d}  "
              f"{sum(x['bytes'] for x in t) / 2**20:5.1f}")
    total_bytes = sum(x["bytes"] for x in per_step[steps[0]])
    print(f"weights steps={len(steps)} train={moe.TRAIN} infer={moe.INFER} bytes_per_step={total_bytes} "
          f"update_ms_p50={statistics.median(totals):.2f} update_ms_max={max(totals):.2f} "
          f"exact={'yes' if exact else 'no'}")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
