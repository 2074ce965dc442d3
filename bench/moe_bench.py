"""MoE dispatch/combine latency (fabric_lib.moe.AllToAll), DeepEP low-latency style: 128 decode
tokens per rank, hidden 7168, top-8 of 256 (and 288) experts, FP8 dispatch, BF16 combine.

    python3 bench/moe_bench.py [--ranks 4] [--node-size 2] [--device cpu|cuda] [--tokens 128]
                               [--experts 256,288] [--steps 20] [--provider tcp|shm|<libfabric name>]
    torchrun --nproc-per-node 8 bench/moe_bench.py --device cuda --node-size 8 ...

Without torchrun's environment (RANK, WORLD_SIZE, ...) it spawns --ranks processes itself. Ranks
meet in a gloo process group (its store carries the AllToAll's descriptors; its barrier aligns the
ranks before every step, outside the timed halves). Each step times the four halves (dispatch send,
dispatch receive, combine send, combine receive) with CUDA events on the current stream (--device
cuda; ranks of one process spawn share GPU rank % GPUs) or wall time (--device cpu: host kernels on
the calling thread). x is quantized to FP8 before the timed call (the transport alone; with
--quantize x is BF16 and the send half quantizes it, as DeepEP's use_fp8), and the experts are not
run (combine sends a fixed BF16 buffer).

Reported per half and per call (send + receive): (a) the p50 over ranks of each rank's median over
the steps and (b) the mean time per call over every rank and step; then the proxy's CPU ms and
WRITEs posted per step (proxy_stats(), means over ranks), how long each proxy waited per step for
the other nodes' rows after its own post (host clock), and what the hardware does with the
same bytes in the same run (copy_us: one contiguous copy of a rank's dispatch rows, all ranks at
once). Ends with one line per expert count:
`moe-bench api=.. ranks=.. node_size=.. device=.. experts=.. dispatch_us_p50=.. combine_us_p50=.. ...`
(--api deep_ep: the same steps through fabric_lib.moe.deep_ep.Buffer, its proxy figures not kept).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time

HALVES = ["dispatch_send", "dispatch_recv", "combine_send", "combine_recv"]
CALLS = {"dispatch": ("dispatch_send", "dispatch_recv"), "combine": ("combine_send", "combine_recv")}


def _provider(name: str) -> tuple:
    """(libfabric provider, nics) for --provider."""
    if name == "tcp":
        return "tcp;ofi_rxm", ["127.0.0.1"]
    return name, [""]


def _inputs(args, rank: int, experts: int, device):
    """Random BF16 tokens and routing: top-k distinct experts per token, weights in [0, 1)."""
    import torch

    g = torch.Generator().manual_seed(rank * 7919 + experts)
    x = torch.randn(args.tokens, args.hidden, generator=g).to(torch.bfloat16)
    idx = torch.rand(args.tokens, experts, generator=g).topk(args.topk, dim=1).indices
    w = torch.rand(args.tokens, args.topk, generator=g)
    return x.to(device), idx.to(device).contiguous(), w.to(device)


class _Clock:
    """Marks on the current CUDA stream (events) or the host (perf_counter); elapsed in us."""

    def __init__(self, device) -> None:
        import torch

        self.cuda = device.type == "cuda"
        self.torch = torch

    def mark(self):
        if self.cuda:
            e = self.torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def elapsed_us(self, marks: list) -> list:
        if self.cuda:
            self.torch.cuda.synchronize()
            return [a.elapsed_time(b) * 1e3 for a, b in zip(marks, marks[1:])]
        return [(b - a) * 1e6 for a, b in zip(marks, marks[1:])]


def _timed_steps(args, device, clock, halves, on_warm=None) -> dict:
    """Warm-up, then --steps steps of halves(mark) (it runs the four halves, calling mark()
    between them), every rank starting together; the times of each half per timed step."""
    import torch
    import torch.distributed as dist

    times = {h: [] for h in HALVES}
    for step in range(args.warmup + args.steps):
        if step == args.warmup and on_warm:
            on_warm()
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        marks = [clock.mark()]
        halves(lambda: marks.append(clock.mark()))
        marks.append(clock.mark())
        us = clock.elapsed_us(marks)
        if step >= args.warmup:
            for h, t in zip(HALVES, us):
                times[h].append(t)
    return times


def _run_one(args, rank: int, world: int, experts: int, engine, device) -> dict:
    """One AllToAll of `experts` experts: warm-up, then --steps timed steps; this rank's results."""
    import torch
    import torch.distributed as dist

    from fabric_lib import moe as M

    if args.api == "deep_ep":
        return _run_deep_ep(args, rank, world, experts, engine, device)
    a2a = M.AllToAll(engine, rank=rank, world_size=world, node_size=args.node_size, num_experts=experts,
                     experts_per_token=args.topk, hidden=args.hidden, max_tokens=args.tokens, dispatch_dtype="fp8",
                     timeout_s=args.timeout_s, device=device, job=f"moe-bench-{experts}-{args.job}",
                     proxy_busy_poll=args.busy_poll, num_sms=args.num_sms, rdma_buffers=args.rdma_buffers)
    x, idx, w = _inputs(args, rank, experts, device)
    xs = None
    if not args.quantize:
        x, xs = M.quantize_fp8_tokens(x)
    expert_out = torch.zeros(a2a.local_experts, a2a.rows_per_expert, args.hidden, dtype=torch.bfloat16, device=device)
    out = torch.empty(args.tokens, args.hidden, dtype=torch.bfloat16, device=device)
    clock = _Clock(device)
    stats0 = []

    def halves(mark) -> None:
        h = a2a.dispatch_send(x, idx, xs)
        mark()
        a2a.dispatch_recv(h)
        mark()
        a2a.combine_send(expert_out, h)
        mark()
        a2a.combine_recv(w, h, out)

    times = _timed_steps(args, device, clock, halves, on_warm=lambda: stats0.append(a2a.proxy_stats()))
    stats0 = stats0[0]
    a2a.check()
    stats1 = a2a.proxy_stats()
    a2a.close()
    per_step = {k: (getattr(stats1, k) - getattr(stats0, k)) / args.steps
                for k in ("cpu_ms", "writes", "dispatch_wait_ms", "combine_wait_ms")}
    return dict(times=times, proxy_cpu_ms=per_step["cpu_ms"], writes=per_step["writes"],
                proxy_wait_us={k[:-8]: 1000 * per_step[k] for k in ("dispatch_wait_ms", "combine_wait_ms")},
                copy_us=_copy_us(args, device, clock))


def _run_deep_ep(args, rank: int, world: int, experts: int, engine, device) -> dict:
    """The same steps through fabric_lib.moe.deep_ep.Buffer (DeepEP's low-latency calls, each
    receive through its hook so the four halves are timed apart): BF16 x quantized inside
    dispatch as DeepEP does, plus the shim's own work (scales layout, src_info, layout_range)."""
    import torch
    import torch.distributed as dist

    from fabric_lib.moe import deep_ep

    buf = deep_ep.Buffer(None, explicitly_destroy=True, engine=engine, node_size=args.node_size, timeout_s=args.timeout_s,
                         proxy_busy_poll=args.busy_poll, num_sms=args.num_sms, rdma_buffers=args.rdma_buffers)
    x, idx, w = _inputs(args, rank, experts, device)
    y = torch.zeros(experts // world, world * args.tokens, args.hidden, dtype=torch.bfloat16, device=device)
    out = torch.empty(args.tokens, args.hidden, dtype=torch.bfloat16, device=device)
    clock = _Clock(device)

    def halves(mark) -> None:
        _, _, handle, _, hook = buf.low_latency_dispatch(x, idx, args.tokens, experts, use_fp8=True,
                                                         return_recv_hook=True)
        mark()
        hook()
        mark()
        _, _, hook = buf.low_latency_combine(y, idx, w, handle, return_recv_hook=True, out=out)
        mark()
        hook()

    times = _timed_steps(args, device, clock, halves)
    buf.check()
    buf.destroy()
    return dict(times=times, proxy_cpu_ms=0.0, writes=0.0, copy_us=_copy_us(args, device, clock))


def _copy_us(args, device, clock) -> float:
    """What the hardware does with this rank's dispatch bytes in the same run: one contiguous
    copy of tokens x top-k FP8 rows (payload and scales) on the current stream, p50 of 20, while
    the other ranks do the same (they share the GPU as the dispatches did)."""
    import torch
    import torch.distributed as dist

    n = args.tokens * args.topk * (args.hidden + 4 * (args.hidden // 128))
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    us = []
    for _ in range(23):
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        marks = [clock.mark()]
        dst.copy_(src)
        marks.append(clock.mark())
        us += clock.elapsed_us(marks)
    return statistics.median(us[3:])


def _report(args, world: int, experts: int, per_rank: list, device_name: str) -> None:
    def per_call(r: dict, name: str) -> list:
        if name in CALLS:
            a, b = CALLS[name]
            return [x + y for x, y in zip(r["times"][a], r["times"][b])]
        return r["times"][name]

    print(f"\nexperts={experts} ranks={world} node_size={args.node_size} device={device_name} tokens={args.tokens} "
          f"hidden={args.hidden} top-{args.topk}, FP8 dispatch / BF16 combine, {args.steps} steps")
    print(f"{'':16s} {'p50 over ranks':>15s} {'max over ranks':>15s} {'mean per call':>14s}   (us)")
    line = {}
    for name in ["dispatch", "combine"] + HALVES:
        medians = sorted(statistics.median(per_call(r, name)) for r in per_rank)
        mean = statistics.fmean(t for r in per_rank for t in per_call(r, name))
        p50 = medians[len(medians) // 2]
        print(f"{name:16s} {p50:15.1f} {medians[-1]:15.1f} {mean:14.1f}")
        line[name] = (p50, mean)
    cpu = statistics.fmean(r["proxy_cpu_ms"] for r in per_rank)
    writes = statistics.fmean(r["writes"] for r in per_rank)
    copy = sorted(r["copy_us"] for r in per_rank)[len(per_rank) // 2]
    print(f"proxy per step: {cpu:.3f} CPU ms, {writes:.1f} WRITEs (means over ranks)")
    waits = {k: statistics.fmean(r["proxy_wait_us"][k] for r in per_rank)
             for k in ("dispatch", "combine")} if "proxy_wait_us" in per_rank[0] else None
    if waits and writes:
        print(f"proxy waits per step on the other nodes, from its own post (host clock, means over ranks): "
              f"dispatch rows {waits['dispatch']:.1f} us, "
              f"combine rows {waits['combine']:.1f} us")
    print(f"a contiguous copy of one rank's dispatch bytes, same run: {copy:.1f} us (p50 over ranks)")
    halves = " ".join(f"{h}_us_p50={line[h][0]:.1f}" for h in HALVES)
    print(f"moe-bench api={args.api} ranks={world} node_size={args.node_size} device={device_name} "
          f"provider={args.provider} rdma_buffers={args.rdma_buffers} num_sms={args.num_sms or 'default'} "
          f"sm_partition={f'{args.mps_share}%' if args.mps_share else 'none'} poll={'busy' if args.busy_poll else 'adaptive'} "
          + (f"cuda_connections={os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS', 'default')} "
             f"host_sync={'blocking' if args.blocking_sync else 'spin'} " if device_name == "cuda" else "")
          + f"tokens={args.tokens} hidden={args.hidden} topk={args.topk} experts={experts} "
          f"dispatch_us_p50={line['dispatch'][0]:.1f} combine_us_p50={line['combine'][0]:.1f} "
          f"dispatch_us_mean={line['dispatch'][1]:.1f} combine_us_mean={line['combine'][1]:.1f} {halves} "
          f"proxy_cpu_ms_per_step={cpu:.3f} writes_per_step={writes:.1f} "
          + (" ".join(f"proxy_{k}_wait_us={v:.1f}" for k, v in waits.items()) + " " if waits and writes else "")
          + f"copy_us_p50={copy:.1f} "
          f"dispatch_over_copy={line['dispatch'][0] / max(copy, 1e-3):.1f}", flush=True)


def _sleep_in_cuda_waits(ordinal: int) -> None:
    """The host thread sleeps in CUDA's waits (synchronize, event waits) instead of spinning:
    set on the device's primary context before it exists. Ranks sharing one host's cores then
    leave them to the proxies and the engines' workers."""
    import ctypes

    cu = ctypes.CDLL("libcuda.so.1")
    set_flags = getattr(cu, "cuDevicePrimaryCtxSetFlags_v2", None) or cu.cuDevicePrimaryCtxSetFlags
    dev = ctypes.c_int()
    for what, rc in (("cuInit", lambda: cu.cuInit(0)),
                     ("cuDeviceGet", lambda: cu.cuDeviceGet(ctypes.byref(dev), ordinal)),
                     ("cuDevicePrimaryCtxSetFlags", lambda: set_flags(dev, 4))):  # CU_CTX_SCHED_BLOCKING_SYNC
        code = rc()
        if code != 0:
            raise RuntimeError(f"--blocking-sync: {what} failed with CUDA driver error {code}")


def worker(rank: int, world: int, local_rank: int, args) -> None:
    """One rank, in a process whose gloo group is initialized."""
    import torch
    import torch.distributed as dist

    import fabric_lib as fl

    if args.mps_share:
        # Read when the CUDA context is made: ranks sharing a GPU under MPS each get this share of
        # its SMs (with all of it, a rank's spinning receive kernel starves another's send).
        os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(args.mps_share)
    if args.device == "cuda" and args.rdma_buffers == "device":
        # Read when CUDA starts: hardware queues for this process's streams. The engine's cuda_ipc
        # copies must not share one with the receive kernel's queued work (docs/api.md). MPS
        # clients draw them from one pool: 8 processes x 16 failed at context creation on an H100
        # ("out of memory"), 8 x 12 ran (docs/benchmarks.md).
        sharing = -(-world // max(1, torch.cuda.device_count()))
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "16" if sharing <= 4 else "12")
    torch.set_num_threads(1)
    if args.device == "cuda" and args.blocking_sync:
        _sleep_in_cuda_waits(local_rank % torch.cuda.device_count())
    if args.device == "cuda":
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    provider, nics = _provider(args.provider)
    # --rdma-buffers device: the proxy's WRITEs go GPU to GPU through the engine's cuda_ipc domain.
    extra = dict(cuda_device=device.index, cuda_ipc=True) if args.rdma_buffers == "device" else {}
    if args.busy_poll:  # production polling: the engine's worker and callback threads spin too
        extra.update(poll="busy", callback_poll="busy")
    with fl.TransferEngine(provider=provider, nics=nics, **extra) as engine:
        for experts in args.experts:
            mine = _run_one(args, rank, world, experts, engine, device)
            gathered = [None] * world
            dist.all_gather_object(gathered, mine)
            if rank == 0:
                _report(args, world, experts, gathered, args.device)
    dist.barrier()
    dist.destroy_process_group()


def _spawned(rank: int, world: int, port: int, args) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    worker(rank, world, rank, args)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=4, help="processes to spawn (ignored under torchrun)")
    ap.add_argument("--node-size", type=int, default=2, help="ranks per node (NVLink domain / shared memory)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--tokens", type=int, default=128, help="tokens per rank and step (max_tokens)")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", default="256,288", help="expert counts, comma-separated (one AllToAll each)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--provider", default="tcp", help="tcp (tcp;ofi_rxm on 127.0.0.1), shm, or a libfabric provider")
    ap.add_argument("--quantize", action="store_true", help="pass BF16 x: the send half quantizes it (timed inside dispatch)")
    ap.add_argument("--timeout-s", type=float, default=60.0, help="the AllToAll's timeout (a stalled step's error)")
    ap.add_argument("--busy-poll", action="store_true", help="proxy, worker and callback threads spin (three cores per rank)")
    ap.add_argument("--mps-share", type=int, default=0,
                    help="ranks sharing a GPU under MPS: each one's percentage of the SMs (e.g. 100 / ranks)")
    ap.add_argument("--num-sms", type=int, default=0, help="CUDA: blocks per half (AllToAll num_sms; 0: default)")
    ap.add_argument("--blocking-sync", action="store_true",
                    help="CUDA: each rank's host thread sleeps in CUDA's waits instead of spinning")
    ap.add_argument("--rdma-buffers", choices=["host", "device"], default="host",
                    help="where the regions between nodes live (device: GPU memory written through cuda_ipc)")
    ap.add_argument("--api", choices=["native", "deep_ep"], default="native",
                    help="time fabric_lib.moe.AllToAll's calls, or the same through the DeepEP shim")
    args = ap.parse_args()
    args.experts = [int(e) for e in args.experts.split(",")]
    args.job = os.getpid()  # names the AllToAll's store keys and shared memory: one per run

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        import torch.distributed as dist

        args.job = os.environ.get("MASTER_PORT", "torchrun")  # the same on every rank of the run

        dist.init_process_group("gloo")
        worker(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)), args)
        return 0
    return spawn_ranks(_spawned, args.ranks, args, "moe-bench")


def spawn_ranks(target, world: int, args, label: str) -> int:
    """Runs target(rank, world, port, args) in `world` spawned processes (no CUDA state inherited:
    each rank makes its own context) and waits for them; 1 when a rank failed, naming it."""
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    bad = [r for r, p in enumerate(procs) if p.exitcode != 0]
    if bad:
        print(f"{label} ranks={world}: ranks {bad} failed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
