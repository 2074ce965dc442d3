"""RL weight updates: 4 training processes write a small MoE transformer into 2 inference processes
after every "training step", directly, with one-sided WRITEs.

    python3 examples/rl_weights/run.py [--provider shm] [--steps 20] [--window 2] [--owner-rows 0] [--gpu]
        [--hidden 256 --inter 256 --vocab 512 --layers 2 --experts 8 --q-rows 512 --kv-rows 256 | --scale N]

The training ranks hold the model as FSDP2 shards (non-expert tensors over 4 ranks, experts EP 2 x
FSDP 2, BF16); the inference ranks hold it as they serve it (TP 2 attention with fused qkv, EP 2
experts with fused gate_up, FP8 e4m3 matrices with 128 x 128 block scales). Every rank publishes its
pieces and arena in a torch TCPStore this script serves, all build the same plan, and each step the
training ranks gather, quantize and write while the inference ranks wait for their immediate counts
and check every byte against the block quantization of the full weights. Prints each step's time
and where it went, and ends with
`weights steps=<n> train=4 infer=2 bytes_per_step=<n> update_ms_p50=<x> update_ms_max=<x> gb_per_s=<x> exact=<yes|no>`
(update_ms: the slowest training rank's update per step, as the table shows; gb_per_s:
bytes_per_step over update_ms_p50, in GB/s, 1e9 bytes per second).
--gpu: CUDA arenas on GPU 0, every process sharing it through cuda_ipc.
The model's size: --hidden, --inter, --vocab, --layers, --experts, --q-rows, --kv-rows (widths must
be multiples of 256), or --scale N to multiply the default's widths by N.
"""

from __future__ import annotations

import argparse
import dataclasses
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
    ap.add_argument("--hook", default="auto", help="the training ranks' unit hook: auto, torch, cuda or host")
    default = moe.Model()
    for name in ("hidden", "inter", "vocab", "layers", "experts", "q_rows", "kv_rows"):
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=None,
                        help=f"the model's {name} (default {getattr(default, name)})")
    ap.add_argument("--mps", type=int, default=None, help="label only: 1 if the GPU processes run under MPS")
    ap.add_argument("--trace", action="store_true", help="print the last step's timeline per unit and rank")
    ap.add_argument("--scale", type=int, default=1, help="multiply the default model's widths by N")
    args = ap.parse_args()
    model = default.scaled(args.scale)
    model = moe.Model(**{k: (getattr(args, k) if getattr(args, k) is not None else v)
                         for k, v in dataclasses.asdict(model).items()})
    try:
        model.check()
    except ValueError as e:
        ap.error(str(e))

    import torch.distributed as dist

    machine = {"link_gbs": copy_gbs(), "one_device": True} if args.gpu else None
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    steps = list(range(args.steps))
    base = dict(port=store.port, job=uuid.uuid4().hex, provider=args.provider, steps=steps,
                owner_rows=args.owner_rows, gpu=args.gpu, model=dataclasses.asdict(model), step_barrier=True)
    ranks = []
    for side, fn, n in (("inference", moe.inference, moe.INFER), ("training", moe.trainer, moe.TRAIN)):
        for r in range(n):
            parent, child = ctx.Pipe()
            extra = dict(window=args.window, hook=args.hook, trace=args.trace, predict=machine)
            cfg = dict(base, rank=r, **(extra if side == "training" else {}))
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
          f"{'whole-tensor' if args.owner_rows == 0 else f'{args.owner_rows}-row'} units; "
          f"model {model} ({model.param_count() / 1e6:.1f} M params)")
    per_step = {s: [] for s in steps}
    exact, failed, predicted = True, False, None
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
    if machine and not failed:  # training rank 0 sends the cost model's prediction after its steps
        conn = next(c for side, r, c, _ in ranks if side == "training" and r == 0)
        msg = conn.recv() if conn.poll(60) else None
        if isinstance(msg, tuple) and msg[0] == "predicted":
            predicted = msg[1]
    for _, _, conn, p in ranks:
        p.join(timeout=60)
    if failed:
        return 1
    print("step  update_ms  gather_wait  quantize  ready_wait  drain  post   (max over training ranks)  "
          "writes  requests  MiB")
    totals = []
    for s in steps:
        t = per_step[s]
        mx = lambda k: max(x[k] for x in t)  # noqa: E731
        totals.append(mx("total_ms"))
        print(f"{s:4d}  {mx('total_ms'):9.2f}  {mx('gather_wait_ms'):11.2f}  {mx('quantize_ms'):8.2f}  "
              f"{mx('ready_wait_ms'):10.2f}  {mx('drain_ms'):6.2f}  {mx('post_ms'):5.2f}  {'':26s}  "
              f"{sum(x['writes'] for x in t):6d}  {sum(x['requests'] for x in t):8d}  "
              f"{sum(x['bytes'] for x in t) / 2**20:5.1f}")
    if args.trace:
        print_trace(per_step[steps[-1]])
    total_bytes = sum(x["bytes"] for x in per_step[steps[0]])
    p50 = statistics.median(totals)
    gb_per_s = total_bytes / p50 / 1e6  # bytes per ms / 1e6 = GB/s
    print(f"weights steps={len(steps)} train={moe.TRAIN} infer={moe.INFER} bytes_per_step={total_bytes} "
          f"update_ms_p50={p50:.2f} update_ms_max={max(totals):.2f} gb_per_s={gb_per_s:.2f} "
          f"exact={'yes' if exact else 'no'}")
    if machine and predicted:
        print(f"weights-gpu params={model.param_count()} bytes_per_step={total_bytes} update_ms_p50={p50:.2f} "
              f"gb_per_s={gb_per_s:.2f} predicted_ms={predicted['predicted_ms']:.2f} "
              f"measured_over_predicted={p50 / predicted['predicted_ms']:.2f}")
        print(f"  the model: chain {predicted['chain_ms']:.2f} ms (the slowest rank's units), link "
              f"{predicted['link_ms']:.2f} + quantize {predicted['quantize_ms']:.2f} + fill {predicted['fill_ms']:.2f} ms, "
              f"post {predicted['post_ms']:.2f} ms ({predicted['requests_max']} requests on the busiest rank); fed with "
              f"copy {machine['link_gbs']:.0f} GB/s, WRITE round trip {predicted['write_rtt_us']:.1f} us, "
              f"{predicted['unit_us']:.1f} us per unit hook, {predicted['post_us']:.2f} us per request; "
              f"mps={args.mps if args.mps is not None else '?'} hook={args.hook} window={args.window}")
    return 0 if exact else 1


def copy_gbs() -> float:
    """GB/s of one contiguous 1 GiB device-to-device copy on GPU 0 (bytes copied per second), the
    median of 10: what the GPU can do, beside which the update's own rate is read."""
    import torch

    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda:0")
    b = torch.empty_like(a)
    b.copy_(a)
    times = []
    for _ in range(10):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        b.copy_(a)
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1))
    del a, b
    torch.cuda.empty_cache()
    return (1 << 30) / (sorted(times)[5] / 1e3) / 1e9


def print_trace(ranks: list) -> None:
    """One step's timeline per training rank: each unit's input seen, hook start and end, sends
    submitted (ms from the rank's update start)."""
    for r, t in enumerate(ranks):
        print(f"trace rank {r}: total {t['total_ms']:.2f} ms, {t['requests']} requests, post {t['post_ms']:.2f} ms, "
              f"drain {t['drain_ms']:.2f} ms")
        for unit, inp, start, quantized, posted in t.get("units", []):
            print(f"  unit {unit:3d}  input {inp:8.2f}  start {start:8.2f}  quantized {quantized:8.2f}  "
                  f"sent {posted:8.2f}")


if __name__ == "__main__":
    sys.exit(main())
