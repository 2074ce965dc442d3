"""MoE latency of fabric_lib.moe.deep_ep.Buffer measured the way DeepEP measures its own (issue 42,
item 6): FP8 dispatch (BF16 x quantized inside the call) + BF16 combine, 128 tokens per rank,
hidden 7168, top-8 of 256 experts by default.

    python3 bench/deep_ep_bench.py --device cuda --ranks 8 --node-size 4 [--host-wait blocking-sync]
    python3 bench/deep_ep_bench.py --device cpu --ranks 2 --tokens 16 --hidden 256 --experts 8 --topk 2

It spawns --ranks processes (gloo over a TCPStore, as bench/moe_bench.py; under torchrun it uses
torchrun's), each with one deep_ep.Buffer (its defaults: on CUDA it opens its own engine with
cuda_ipc and keeps the regions between nodes in GPU memory; --provider passes an engine of that
provider instead). Each rank times, in one run:
  (a) both: dispatch + combine per iteration as DeepEP's `bench` (deep_ep/utils/testing.py): 50
      warm-up calls, then per iteration a 256 MB L2 flush and CUDA events around one dispatch and
      its combine, no barrier and no synchronization between iterations;
  (b) dispatch and combine apart: per iteration the ranks meet (synchronize, gloo barrier), the L2
      is flushed, and events are recorded before the dispatch, between it and the combine, and
      after the combine (DeepEP's bench_kineto aligns its iterations with a barrier too);
  (c) copy: one contiguous device-to-device copy of the bytes a dispatch moves (top-k FP8 rows of
      hidden + hidden / 32 + 16 bytes per token, DeepEP's count) and of the bytes a combine moves
      (top-k BF16 rows), timed as (b): the hardware's figure for the same bytes in the same run;
  (d) unless --moe-bench-steps 0, bench/moe_bench.py's own timing of the same calls
      (its _run_deep_ep: a barrier before each step, events between the send and receive halves).
Each figure is a rank's p50 over its iterations; the line reports the slowest rank's (the per-rank
p50s are gathered to rank 0). With --device cpu (host kernels) time.perf_counter replaces the
events and there is no L2 flush. Ends with one line per run:
`moe-deepep ranks=.. nodes=.. path=.. dispatch_us=.. combine_us=.. both_us=.. copy_dispatch_us=..
copy_combine_us=.. dispatch_vs_copy=.. combine_vs_copy=.. moe_bench_dispatch_us=.. polling=..`
preceded by a `moe-deepep-ranks` line with every rank's p50s and its host thread's CPU share.

--host-wait says how each rank's host thread waits for its GPU (the CUDA context's scheduling
flag): auto (the Buffer's default: blocking-sync where the ranks on this host, three busy threads
each, outnumber its cores, else spin; fabric_lib.moe.host_wait), spin, yield or blocking-sync (the
Buffer sets it on the running context), or blocking-sync-early (set by this script before the
context exists, to compare with what the Buffer does after).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe_bench  # noqa: E402 - bench/ is not a package: its launch helpers and its timing, shared

from fabric_lib.moe import host_wait  # noqa: E402

L2_FLUSH_BYTES = 256_000_000  # DeepEP's flush_l2_cache size
HOST_WAIT_MODES = (*host_wait.MODES, "blocking-sync-early")


def _set_blocking_sync_before_context(ordinal: int) -> None:
    """The primary context's scheduling flag set to blocking-sync before torch creates the context
    (the flag is read when it does)."""
    cu = ctypes.CDLL("libcuda.so.1")
    set_flags = getattr(cu, "cuDevicePrimaryCtxSetFlags_v2", None) or cu.cuDevicePrimaryCtxSetFlags
    dev = ctypes.c_int()
    for what, code in (("cuInit", cu.cuInit(0)), ("cuDeviceGet", cu.cuDeviceGet(ctypes.byref(dev), ordinal)),
                       ("cuDevicePrimaryCtxSetFlags", set_flags(dev, host_wait.SCHED_FLAGS["blocking-sync"]))):
        if code != 0:
            raise RuntimeError(f"--host-wait blocking-sync-early: {what} failed with CUDA driver error {code}")


def _us(clock, a, b) -> float:
    """Elapsed us between two marks of moe_bench's clock (CUDA events or perf_counter readings)."""
    return clock.elapsed_us([a, b])[0]  # synchronizes first: the host waits here, as --host-wait says


def _flush_l2(device, enabled: bool) -> None:
    """DeepEP's flush_l2_cache: zero 256 MB so the next call starts with a cold L2. Ranks sharing
    one GPU flush at once: in (a), as in DeepEP's loop, one rank's flush can overlap another's
    timed call (a 256 MB memset takes ~100 us on an H100; --no-flush-l2 measures without it); (b)
    and (c) align the ranks after the flush."""
    import torch

    if enabled and device.type == "cuda":
        torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device=device).zero_()


def _align(device) -> None:
    """Every rank idle and at the same point: the GPU drained, then a gloo barrier."""
    import torch
    import torch.distributed as dist

    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()


def _bench_both(args, device, timer, step) -> list:
    """(a) DeepEP's `bench`: warm-up calls, then per iteration a flush and marks around one
    dispatch + combine, nothing between iterations; us per iteration."""
    _align(device)
    for _ in range(args.warmup):
        step()
    marks = []
    for _ in range(args.iters):
        _flush_l2(device, args.flush_l2)
        start = timer.mark()
        step()
        marks.append((start, timer.mark()))
    return [_us(timer, a, b) for a, b in marks][1:]  # as DeepEP, the first timed iteration is dropped


def _bench_apart(args, device, timer, dispatch, combine) -> tuple:
    """(b) per iteration: flush, ranks aligned, marks before the dispatch, between it and its
    combine, and after; (dispatch us, combine us) lists and the host thread's CPU share (CPU time
    over wall time of the loop: near 1 when it spins in CUDA's waits)."""
    d_us, c_us = [], []
    for _ in range(args.warmup):
        combine(dispatch())
    wall0, cpu0 = time.perf_counter(), time.thread_time()
    for _ in range(args.iters):
        # Flush, then align: on a shared GPU the other ranks' flushes are over before the call.
        _flush_l2(device, args.flush_l2)
        _align(device)
        m0 = timer.mark()
        handle = dispatch()
        m1 = timer.mark()
        combine(handle)
        m2 = timer.mark()
        d_us.append(_us(timer, m0, m1))
        c_us.append(_us(timer, m1, m2))
    cpu_share = (time.thread_time() - cpu0) / max(time.perf_counter() - wall0, 1e-9)
    return d_us, c_us, cpu_share


def _bench_copy(args, device, timer, nbytes: int) -> list:
    """(c) one contiguous copy of nbytes within this rank's device memory (host memory on the
    CPU), timed as (b), every rank copying at once as they dispatch at once."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    us = []
    for _ in range(args.iters):
        _flush_l2(device, args.flush_l2)
        _align(device)
        a = timer.mark()
        dst.copy_(src)
        b = timer.mark()
        us.append(_us(timer, a, b))
    return us


def _moe_bench_dispatch_us(args, rank: int, world: int, engine, device, rdma_buffers: str) -> float:
    """(d) bench/moe_bench.py's timing of the same calls through its own deep_ep.Buffer on the same
    engine: this rank's p50 of dispatch send + receive (us)."""
    ns = argparse.Namespace(node_size=args.node_size, timeout_s=args.timeout_s, busy_poll=False, num_sms=0,
                            rdma_buffers=rdma_buffers, tokens=args.tokens, hidden=args.hidden, topk=args.topk,
                            warmup=3, steps=args.moe_bench_steps)
    r = moe_bench._run_deep_ep(ns, rank, world, args.experts, engine, device)
    t = r["times"]
    return statistics.median(a + b for a, b in zip(t["dispatch_send"], t["dispatch_recv"]))


def _engine_for(args, device):
    """None (the Buffer opens its own engine with its defaults) or an engine of --provider."""
    import fabric_lib as fl

    if args.provider is None:
        return None
    provider, nics = moe_bench._provider(args.provider)
    extra = dict(cuda_device=device.index) if device.type == "cuda" else {}
    return fl.TransferEngine(provider=provider, nics=nics, **extra)


def worker(rank: int, world: int, local_rank: int, args) -> None:
    """One rank, in a process whose gloo group is initialized."""
    import torch
    import torch.distributed as dist

    from fabric_lib.moe import deep_ep

    cuda = args.device == "cuda"
    if cuda:
        # Read when CUDA starts: hardware queues for this process's streams, so the engine's
        # cuda_ipc copies do not queue behind a waiting receive kernel; MPS clients draw them from
        # one pool, which 8 x 16 exhausted on an H100 (bench/moe_bench.py's worker, the same rule).
        sharing = -(-world // max(1, torch.cuda.device_count()))
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "16" if sharing <= 4 else "12")
        ordinal = local_rank % torch.cuda.device_count()
        if args.host_wait == "blocking-sync-early":
            _set_blocking_sync_before_context(ordinal)
        device = torch.device("cuda", ordinal)
        torch.cuda.set_device(device)
        torch.zeros(1, device=device)  # the context exists from here on
    else:
        device = torch.device("cpu")
    torch.set_num_threads(1)

    engine = _engine_for(args, device)
    early = args.host_wait == "blocking-sync-early"
    buf = deep_ep.Buffer(None, explicitly_destroy=True, engine=engine, node_size=args.node_size,
                         timeout_s=args.timeout_s, host_wait="blocking-sync" if early else args.host_wait)
    taken = "host-kernel" if not cuda else f"{buf.host_wait}{'-early' if early else ''}"  # checked by the Buffer
    x, idx, w = moe_bench._inputs(args, rank, args.experts, device)
    local_experts = args.experts // world
    y = torch.randn(local_experts, world * args.tokens, args.hidden, dtype=torch.bfloat16, device=device)
    out = torch.empty(args.tokens, args.hidden, dtype=torch.bfloat16, device=device)

    def dispatch():
        _, _, handle, _, _ = buf.low_latency_dispatch(x, idx, args.tokens, args.experts, use_fp8=True,
                                                      async_finish=False, return_recv_hook=False)
        return handle

    def combine(handle) -> None:
        buf.low_latency_combine(y, idx, w, handle, out=out)

    timer = moe_bench._Clock(device)  # CUDA events on the current stream, or perf_counter

    def phase(name: str, run):
        """run(), then the Buffer checked (each phase ends synchronized): a CUDA kernel's failure
        reports at the next call, so without the check it would be blamed on the next phase."""
        try:
            result = run()
            buf.check()
            return result
        except Exception as e:
            print(f"moe-deepep-failed rank={rank} phase={name}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            raise

    both = phase("a-both", lambda: _bench_both(args, device, timer, lambda: combine(dispatch()))) if args.both else None
    d_us, c_us, cpu_share = phase("b-apart", lambda: _bench_apart(args, device, timer, dispatch, combine))
    selections = int((idx >= 0).sum())
    copy_d = _bench_copy(args, device, timer, selections * (args.hidden + args.hidden // 32 + 16))
    copy_c = _bench_copy(args, device, timer, selections * args.hidden * 2)
    moe_d = None
    if args.moe_bench_steps:
        # The engine the Buffer opened (or ours), and the regions where the Buffer keeps them.
        rdma = "device" if cuda and engine is None else "host"
        moe_d = phase("d-moe-bench", lambda: _moe_bench_dispatch_us(args, rank, world, buf.engine, device, rdma))
    mine = dict(both=statistics.median(both) if both else None, dispatch=statistics.median(d_us), combine=statistics.median(c_us),
                copy_dispatch=statistics.median(copy_d), copy_combine=statistics.median(copy_c),
                moe_bench_dispatch=moe_d, cpu_share=cpu_share, host_wait=taken)
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    buf.destroy()
    if engine is not None:
        engine.close()
    if rank == 0:
        _report(args, world, gathered)
    dist.barrier()
    dist.destroy_process_group()


def _report(args, world: int, per_rank: list) -> None:
    nodes = world // args.node_size
    slowest = {k: max(r[k] for r in per_rank) for k in ("dispatch", "combine", "copy_dispatch", "copy_combine")}
    both = "-" if per_rank[0]["both"] is None else f"{max(r['both'] for r in per_rank):.1f}"
    moe_d = "-" if per_rank[0]["moe_bench_dispatch"] is None else f"{max(r['moe_bench_dispatch'] for r in per_rank):.1f}"
    polling = per_rank[0]["host_wait"]
    per = lambda k: ",".join(f"{r[k]:.1f}" for r in per_rank)  # noqa: E731
    print(f"moe-deepep-ranks device={args.device} provider={args.provider or 'buffer-default'} tokens={args.tokens} "
          f"hidden={args.hidden} topk={args.topk} experts={args.experts} iters={args.iters} "
          f"flush_l2={'yes' if args.flush_l2 and args.device == 'cuda' else 'no'} "
          f"cuda_connections={os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS', 'default') if args.device == 'cuda' else '-'} "
          f"host_wait={','.join(r['host_wait'] for r in per_rank)} "
          f"dispatch_us={per('dispatch')} combine_us={per('combine')} "
          f"both_us={per('both') if both != '-' else '-'} "
          f"copy_dispatch_us={per('copy_dispatch')} copy_combine_us={per('copy_combine')} "
          f"host_cpu_share={','.join('%.2f' % r['cpu_share'] for r in per_rank)}")
    print(f"moe-deepep ranks={world} nodes={nodes} path={'nvlink' if nodes == 1 else f'{nodes}nodes'} "
          f"dispatch_us={slowest['dispatch']:.1f} combine_us={slowest['combine']:.1f} both_us={both} "
          f"copy_dispatch_us={slowest['copy_dispatch']:.1f} copy_combine_us={slowest['copy_combine']:.1f} "
          f"dispatch_vs_copy={slowest['dispatch'] / max(slowest['copy_dispatch'], 1e-3):.2f} "
          f"combine_vs_copy={slowest['combine'] / max(slowest['copy_combine'], 1e-3):.2f} "
          f"moe_bench_dispatch_us={moe_d} polling={polling}", flush=True)


def _spawned(rank: int, world: int, port: int, args) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    worker(rank, world, rank, args)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2, help="processes to spawn (ignored under torchrun)")
    ap.add_argument("--node-size", type=int, default=None, help="ranks per node (default: all ranks, NVLink only)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    ap.add_argument("--tokens", type=int, default=128, help="tokens per rank (num_max_dispatch_tokens_per_rank)")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=50, help="calls before timing (DeepEP's bench: 50)")
    ap.add_argument("--iters", type=int, default=50, help="timed iterations of each kind (DeepEP's bench: 50)")
    ap.add_argument("--flush-l2", action=argparse.BooleanOptionalAction, default=True,
                    help="CUDA: zero 256 MB before each timed iteration, as DeepEP's bench")
    ap.add_argument("--both", action=argparse.BooleanOptionalAction, default=True,
                    help="time (a), DeepEP's loop of back-to-back calls (--no-both: both_us is '-')")
    ap.add_argument("--host-wait", choices=HOST_WAIT_MODES, default="auto",
                    help="CUDA: how each rank's host thread waits for the GPU (the context's scheduling flag; "
                         "auto: the Buffer's default)")
    ap.add_argument("--provider", default=None,
                    help="the Buffer's engine: left out, the Buffer opens its own (CUDA: cuda_ipc, regions between "
                         "nodes in GPU memory); tcp, shm or a libfabric provider (regions in host memory). "
                         "--device cpu defaults to tcp")
    ap.add_argument("--timeout-s", type=float, default=60.0, help="the AllToAll's timeout (a stalled step's error)")
    ap.add_argument("--moe-bench-steps", type=int, default=30,
                    help="steps of bench/moe_bench.py's own timing of the same calls, same process (0: skip)")
    args = ap.parse_args()
    if args.device == "cpu" and args.provider is None:
        args.provider = "tcp"
    world = int(os.environ["WORLD_SIZE"]) if "RANK" in os.environ and "WORLD_SIZE" in os.environ else args.ranks
    if args.node_size is None:
        args.node_size = world
    if world % args.node_size or args.experts % world:
        ap.error(f"--node-size {args.node_size} must divide the {world} ranks, and they --experts {args.experts}")

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        import torch.distributed as dist

        dist.init_process_group("gloo")
        worker(dist.get_rank(), world, int(os.environ.get("LOCAL_RANK", 0)), args)
        return 0
    return moe_bench.spawn_ranks(_spawned, world, args, f"moe-deepep node_size={args.node_size}")


if __name__ == "__main__":
    sys.exit(main())
