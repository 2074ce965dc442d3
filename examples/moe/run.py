"""MoE dispatch/combine: N rank processes run 20 decode steps of a toy MoE layer on the CPU.

    python3 examples/moe/run.py [--ranks 4] [--node-size 2] [--provider tcp] [--steps 20]
                                [--hidden 512] [--experts 16] [--topk 4] [--tokens 16] [--dtype fp8]

Each rank holds experts/ranks experts (small linear maps, BF16 weights) and, every step, a batch of
decode tokens. A router (a linear map and a softmax over its top-k) picks each token's experts;
fabric_lib.moe.AllToAll dispatches the tokens to the ranks holding them (node-mates through shared
memory, the other node through the transfer engine: --provider tcp or shm), each rank runs its
experts on what it received, and combine brings the weighted outputs back. Every rank checks its
combined output against the oracle (reference_dispatch, then the same experts, then
reference_combine, from every rank's inputs), bit for bit. Prints a per-step table (the slowest
rank's times) and ends with
`moe steps=<n> ranks=<n> dispatch_us_p50_slowest=<x> combine_us_p50_slowest=<x> exact=<yes|no>`:
the p50 over the steps of the table's dispatch_us and combine_us columns, each the slowest rank's
time at that step (a step is as slow as its slowest rank).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
import traceback
import uuid

PROVIDERS = {"tcp": "tcp;ofi_rxm", "shm": "shm"}


def _weights(cfg: dict, expert: int):
    """Expert `expert`'s [hidden, hidden] BF16 map, the same on every rank."""
    import torch

    g = torch.Generator().manual_seed(1000 + expert)
    return (torch.randn(cfg["hidden"], cfg["hidden"], generator=g) / cfg["hidden"] ** 0.5).to(torch.bfloat16)


def _router(cfg: dict):
    import torch

    g = torch.Generator().manual_seed(99)
    return torch.randn(cfg["hidden"], cfg["experts"], generator=g)


def _tokens(cfg: dict, rank: int, step: int):
    """Step `step`'s decode batch of `rank` (BF16 hidden states) and its routing: top-k of the
    router's logits, weights their softmax."""
    import torch

    g = torch.Generator().manual_seed(rank * 100_003 + step)
    x = torch.randn(cfg["tokens"], cfg["hidden"], generator=g).to(torch.bfloat16)
    logits = x.float() @ _router(cfg)
    top, idx = torch.topk(logits, cfg["topk"], dim=1)
    return x, idx.contiguous(), torch.softmax(top, dim=1).contiguous()


def _experts(cfg: dict, rank: int, weights: list, recv: tuple, out):
    """Runs this rank's experts over their received rows into `out` (rows past the counts stay)."""
    from fabric_lib import moe as M

    rx, rs, counts, _ = recv
    for el, w in enumerate(weights):
        c = int(counts[el])
        if c:
            xf = M.dequantize_fp8_tokens(rx[el, :c], rs[el, :c]) if rs is not None else rx[el, :c].float()
            out[el, :c] = xf.to(out.dtype) @ w
    return out


def _oracle(cfg: dict, rank: int, step: int, all_weights: list):
    """What rank's combine must return, from every rank's inputs alone."""
    import torch
    from fabric_lib import moe as M

    W, L = cfg["ranks"], cfg["experts"] // cfg["ranks"]
    inputs = []
    for s in range(W):
        x, idx, w = _tokens(cfg, s, step)
        xd, xs = M.quantize_fp8_tokens(x) if cfg["dtype"] == "fp8" else (x, None)
        inputs.append((xd, xs, idx, w))
    outs = []
    for d, recv in enumerate(M.reference_dispatch(inputs, num_experts=cfg["experts"], max_tokens=cfg["tokens"])):
        y = torch.zeros(L, W * cfg["tokens"], cfg["hidden"], dtype=torch.bfloat16)
        outs.append(_experts(cfg, d, all_weights[d * L:(d + 1) * L], recv, y))
    return M.reference_combine(inputs, outs, rank, num_experts=cfg["experts"])


def rank_main(conn, cfg: dict) -> None:
    try:
        import torch
        import torch.distributed as dist

        import fabric_lib as fl
        from fabric_lib import moe as M

        torch.set_num_threads(1)
        rank, L = cfg["rank"], cfg["experts"] // cfg["ranks"]
        all_weights = [_weights(cfg, e) for e in range(cfg["experts"])]
        mine = all_weights[rank * L:(rank + 1) * L]
        provider = PROVIDERS[cfg["provider"]]
        store = dist.TCPStore("127.0.0.1", cfg["port"], is_master=False, wait_for_workers=False)
        with fl.TransferEngine(provider=provider, nics=[""] if provider == "shm" else ["127.0.0.1"]) as engine:
            a2a = M.AllToAll(engine, rank=rank, world_size=cfg["ranks"], node_size=cfg["node_size"],
                             num_experts=cfg["experts"], experts_per_token=cfg["topk"], hidden=cfg["hidden"],
                             max_tokens=cfg["tokens"], dispatch_dtype=cfg["dtype"], timeout_s=60.0, store=store,
                             job=cfg["job"])
            expert_out = torch.zeros(L, a2a.rows_per_expert, cfg["hidden"], dtype=torch.bfloat16)
            out = torch.empty(cfg["tokens"], cfg["hidden"], dtype=torch.bfloat16)
            conn.send("ready")
            timed, outs = [], []
            for step in range(cfg["steps"]):
                x, idx, w = _tokens(cfg, rank, step)
                t0 = time.perf_counter()
                *recv, handle = a2a.dispatch(x, idx)
                t1 = time.perf_counter()
                _experts(cfg, rank, mine, recv, expert_out)
                t2 = time.perf_counter()
                a2a.combine(expert_out, w, handle, out)
                t3 = time.perf_counter()
                timed.append(((t1 - t0) * 1e6, (t2 - t1) * 1e6, (t3 - t2) * 1e6, int(recv[2].sum()),
                              a2a.proxy_stats().writes))
                outs.append(out.clone())
            a2a.close()
            # Checked after the steps, so that no rank's oracle delays the others' next step.
            for step, (times, got) in enumerate(zip(timed, outs)):
                exact = torch.equal(got.view(torch.int16), _oracle(cfg, rank, step, all_weights).view(torch.int16))
                conn.send((step, *times[:3], exact, *times[3:]))
        conn.send("bye")
    except Exception:  # noqa: BLE001 - the failure goes back to the parent
        conn.send("error " + traceback.format_exc())


def _start(args) -> tuple:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    base = dict(port=store.port, job="moe-example-" + uuid.uuid4().hex[:8], provider=args.provider,
                ranks=args.ranks, node_size=args.node_size, steps=args.steps, hidden=args.hidden,
                experts=args.experts, topk=args.topk, tokens=args.tokens, dtype=args.dtype)
    ranks = []
    for r in range(args.ranks):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=rank_main, args=(child, dict(base, rank=r)), daemon=True)
        p.start()
        ranks.append((parent, p))
    return store, ranks


def _collect(ranks: list, steps: int) -> list:
    """results[r][step] = (dispatch_us, experts_us, combine_us, exact, rows received, writes)."""
    results = []
    for r, (conn, _) in enumerate(ranks):
        got = []
        while True:
            if not conn.poll(300):
                raise RuntimeError(f"rank {r}: no result")
            msg = conn.recv()
            if msg == "bye":
                break
            if isinstance(msg, str):
                raise RuntimeError(f"rank {r}: {msg}")
            got.append(msg[1:])
        if len(got) != steps:
            raise RuntimeError(f"rank {r}: {len(got)} of {steps} steps")
        results.append(got)
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--node-size", type=int, default=2, help="ranks per node (shared memory between them)")
    ap.add_argument("--provider", choices=sorted(PROVIDERS), default="tcp", help="between the nodes")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=16, help="decode tokens per rank and step")
    ap.add_argument("--dtype", choices=["fp8", "bf16"], default="fp8", help="what dispatch moves")
    args = ap.parse_args()

    store, ranks = _start(args)
    for r, (conn, _) in enumerate(ranks):
        msg = conn.recv() if conn.poll(300) else "no answer"
        if msg != "ready":
            print(f"rank {r} did not start: {msg}", file=sys.stderr)
            return 1
    print(f"{args.ranks} ranks in {args.ranks // args.node_size} nodes over {PROVIDERS[args.provider]}, "
          f"{args.experts} experts (top-{args.topk}), hidden {args.hidden}, {args.tokens} tokens per rank, "
          f"{args.dtype} dispatch")
    try:
        results = _collect(ranks, args.steps)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    for _, p in ranks:
        p.join(timeout=60)
    del store
    print("step  dispatch_us  experts_us  combine_us  rows  writes   (max over ranks; rows and writes: sums)")
    dispatch, combine, exact = [], [], True  # the table's columns: the slowest rank's, per step
    for s in range(args.steps):
        per = [results[r][s] for r in range(args.ranks)]
        d, e, c = max(x[0] for x in per), max(x[1] for x in per), max(x[2] for x in per)
        dispatch.append(d)
        combine.append(c)
        exact &= all(x[3] for x in per)
        writes = sum(x[5] - (results[r][s - 1][5] if s else 0) for r, x in enumerate(per))
        print(f"{s:4d}  {d:11.0f}  {e:10.0f}  {c:10.0f}  {sum(x[4] for x in per):4d}  {writes:6d}"
              f"{'' if all(x[3] for x in per) else '   DIFFERS from the oracle'}")
    print(f"moe steps={args.steps} ranks={args.ranks} dispatch_us_p50_slowest={statistics.median(dispatch):.0f} "
          f"combine_us_p50_slowest={statistics.median(combine):.0f} exact={'yes' if exact else 'no'}")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
