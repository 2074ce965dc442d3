"""MoE dispatch and combine for decode (include/fabric/moe/all_to_all.h), for torch tensors.

Every rank sends each of its tokens to the ranks holding the token's top-k experts (dispatch),
runs its experts on what it received, and gathers the expert outputs back, weighted and summed
per token (combine). Inside a node (node_size ranks sharing an NVLink domain, or a host's shared
memory) rows go straight into the node-mates' buffers; across nodes a proxy thread per rank posts
them as RDMA WRITEs over the TransferEngine. The calling convention is DeepEP's: dispatch returns
a handle, the routing weights go to combine, and each call splits into a send half and a receive
half, so a caller can overlap other work between them, or keep two batches in flight
(dispatch A, dispatch B, combine A, combine B: `buffers` sets of buffers).

- AllToAll(engine, rank=..., world_size=..., ...): collective construction; the ranks exchange
  their buffers' descriptors through a torch.distributed Store (a TCPStore, or the default
  process group's store). Every buffer is allocated once.
- dispatch(x, topk_idx, x_scales=None) -> (recv_x, recv_scales, recv_counts, recv_src, handle):
  tensors that VIEW the handle's buffer set (valid until that set's next dispatch, and never after
  close()): expert e's rows come from source ranks in rank order, each source's by token, then by
  top-k slot; rows past recv_counts[e] are stale. dispatch_send / dispatch_recv are its halves.
- combine(expert_out, topk_weights, handle, out=None) -> out [num_tokens, hidden] BF16: sum over
  the token's used slots k, in slot order, of topk_weights[t, k] * expert_out[row of (t, k)],
  accumulated in fp32 with fused multiply-adds and rounded to BF16 once. combine_send /
  combine_recv are its halves.
- fabric_lib.moe.deep_ep.Buffer: DeepEP's low-latency API (low_latency_dispatch /
  low_latency_combine) over the same AllToAll, for code written against deep_ep.Buffer.

device="cpu" runs the halves on the calling thread over host memory (tests, CPU decode);
device="cuda" enqueues CUDA kernels on torch's current stream, capturable in a CUDA graph (no
host synchronization, no allocation inside dispatch/combine when `out` is passed and x is already
in the dispatch dtype).

reference_dispatch / reference_combine compute the same results in plain torch on the CPU from
every rank's inputs: the oracle the tests check the AllToAll against, bit for bit.
"""

from __future__ import annotations

import contextlib
import ctypes
from datetime import timedelta
from typing import Any, Optional, Sequence

import torch

from .. import _fabric_lib as _c
from .._fabric_lib import (
    MOE_INVALID_COUNT,
    AllToAllConfig,
    MoeDispatchOutput as DispatchOutput,
    MoeDtype as Dtype,
    MoeHandle as Handle,
    MoeKernelSide as KernelSide,
    MoeRdmaBuffers as RdmaBuffers,
    MoeProxyStats as ProxyStats,
    MoeQuantize as Quantize,
)
from .._stores import store_of

__all__ = ["AllToAll", "AllToAllConfig", "Dtype", "Handle", "KernelSide", "RdmaBuffers", "ProxyStats", "DispatchOutput", "MOE_INVALID_COUNT",
           "Quantize", "quantize_fp8_tokens", "quantize_fp8_tokens_pow2", "dequantize_fp8_tokens", "reference_dispatch", "reference_combine",
           "reference_combine_rows", "fma_fp32"]

E4M3_MAX = 448.0
BLOCK = 128  # FP8 dispatch: one fp32 scale per 128 values of a row

_DTYPES = {"fp8": Dtype.FP8, "bf16": Dtype.BF16}


# ---- FP8 tokens ----


def quantize_fp8_tokens(x: Any) -> tuple:
    """(e4m3 values [n, h], fp32 scales [n, h / 128]) of BF16 tokens x [n, h], per 128 values of
    each row: scale = amax / 448 (1 for an all-zero block), value = e4m3(x / scale), rounded to
    nearest even. The same on CPU and CUDA (capturable: no host synchronization)."""
    n, h = x.shape
    if h % BLOCK:
        raise ValueError(f"hidden {h} is not a multiple of {BLOCK}")
    # BF16 until the division (abs and max are exact in it, and BF16 / fp32 computes in fp32):
    # one pass over x fewer than converting it first, the same bits.
    xb = x.view(n, h // BLOCK, BLOCK)
    amax = xb.abs().amax(dim=2).float()
    # A tensor divisor, not the scalar 448: CUDA divides by a scalar as a multiplication by its
    # reciprocal, which rounds differently from the CPU's amax / 448 (as in weights.py). An
    # all-zero block divides 448 by itself: scale 1.
    scale = torch.where(amax > 0, amax, E4M3_MAX) / torch.full_like(amax, E4M3_MAX)
    q = (xb / scale.unsqueeze(2)).to(torch.float8_e4m3fn).view(n, h)
    return q, scale


def quantize_fp8_tokens_pow2(x: Any) -> tuple:
    """quantize_fp8_tokens with power-of-two scales (DeepEP's round_scale): scale =
    2^ceil(log2(max(amax, 1e-4) / 448)) per 128 values, so one UE8M0 exponent holds it exactly.
    The ceiling comes from the bits of amax / 448 (its exponent, plus one when a mantissa bit is
    set), as the dispatch kernels compute it, not from a log2 that may round."""
    n, h = x.shape
    if h % BLOCK:
        raise ValueError(f"hidden {h} is not a multiple of {BLOCK}")
    xb = x.view(n, h // BLOCK, BLOCK)
    amax = xb.abs().amax(dim=2).float().clamp(min=1e-4)
    v = (amax / torch.full_like(amax, E4M3_MAX)).view(torch.int32)  # normal: >= 2.2e-7
    exponent = (v >> 23) + ((v & 0x7FFFFF) != 0).to(torch.int32)
    scale = (exponent << 23).view(torch.float32)
    q = (xb / scale.unsqueeze(2)).to(torch.float8_e4m3fn).view(n, h)
    return q, scale


def dequantize_fp8_tokens(q: Any, scales: Any) -> Any:
    """fp32 values of e4m3 rows q [..., h] with their scales [..., h / 128]."""
    shape = q.shape
    blocks = q.float().view(*shape[:-1], shape[-1] // BLOCK, BLOCK)
    return (blocks * scales.unsqueeze(-1)).view(shape)


# ---- views of memory the AllToAll owns ----


class _CudaMemory:
    """A device allocation as __cuda_array_interface__ bytes, for torch.as_tensor (no copy)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


def _bytes_at(ptr: int, nbytes: int, device: Any) -> Any:
    """A uint8 tensor over nbytes at ptr (host memory, or device memory on a CUDA device)."""
    if device.type == "cuda":
        return torch.as_tensor(_CudaMemory(ptr, nbytes), device=device)
    # torch.frombuffer keeps the ctypes array (which does not own the memory) referenced.
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), dtype=torch.uint8)


def _view(ptr: int, dtype: Any, shape: tuple, device: Any) -> Any:
    n = 1
    for d in shape:
        n *= d
    return _bytes_at(ptr, n * dtype.itemsize, device).view(dtype).view(shape)


# ---- the all-gather over a store ----


def _delete(store: Any, key: str) -> None:
    # Every torch Store of today has delete_key; one that cannot delete only leaves a few keys.
    try:
        store.delete_key(key)
    except (AttributeError, NotImplementedError, RuntimeError):
        pass


class _StoreAllGather:
    """The AllGather the C++ constructor calls (twice): round r publishes this rank's bytes under
    f"{job}/a2a/{r}/{rank}" and reads every rank's. Keys go once everyone has read them: a rank
    publishes round r only after reading round r - 1, so having seen every round-r key, it
    deletes its own round r - 1 key; finish() counts the ranks done with the last round, and the
    last of them deletes that round's keys and the counter. The keys name the job only: an
    AllToAll rebuilt in the same store (after a failure) takes a new job name."""

    def __init__(self, store: Any, job: str, rank: int, world: int, timeout_s: float) -> None:
        self.store, self.job, self.rank, self.world = store, job, rank, world
        self.timeout = timedelta(seconds=timeout_s)
        self.round = 0

    def _key(self, rnd: int, rank: int) -> str:
        return f"{self.job}/a2a/{rnd}/{rank}"

    def __call__(self, mine: bytes) -> list:
        rnd = self.round
        self.round += 1
        self.store.set(self._key(rnd, self.rank), mine)
        keys = [self._key(rnd, r) for r in range(self.world)]
        try:
            self.store.wait(keys, self.timeout)
        except Exception as e:  # noqa: BLE001 - a store timeout's type differs between stores
            missing = [r for r in range(self.world) if not self.store.check([keys[r]])]
            raise _c.FabricTimeoutError(f"MoE AllToAll job {self.job!r}: ranks {missing} did not publish round {rnd} "
                               f"within {self.timeout.total_seconds():.0f} s ({e})") from None
        got = [self.store.get(k) for k in keys]
        if rnd > 0:
            _delete(self.store, self._key(rnd - 1, self.rank))
        return got

    def finish(self) -> None:
        done = f"{self.job}/a2a/done"
        if self.store.add(done, 1) == self.world:
            for r in range(self.world):
                _delete(self.store, self._key(self.round - 1, r))
            _delete(self.store, done)


# ---- argument checks ----


def _check_tensor(name: str, t: Any, dtype: Any, shape: tuple, device: Any) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}; this AllToAll runs on {device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (pass {name}.contiguous())")


def _device_of(device: Any) -> Any:
    d = torch.device(device)
    if d.type == "cuda":
        return torch.device("cuda", d.index if d.index is not None else torch.cuda.current_device())
    if d.type != "cpu":
        raise ValueError(f"device must be 'cpu' or a CUDA device, got {d}")
    return d


class AllToAll:
    """MoE dispatch/combine of one rank. Construction is collective: every rank of the job builds
    its AllToAll at once (they meet in `store`, under keys named by `job`; the job also names the
    node's shared memory). job=None takes "moe.<n>" for this rank's n-th AllToAll built with a
    default job in this store, so several AllToAlls built in the same order on every rank never
    collide; a job that this rank already holds live in the store is refused (ValueError).

    rank, world_size: this rank and the ranks of the job; node_size: ranks per node (1-8,
    dividing world_size; rank r is on node r // node_size). num_experts (a multiple of
    world_size; expert e lives on rank e // (num_experts // world_size)), experts_per_token (top-k,
    1-8), hidden (a multiple of 128), max_tokens (per rank and call). dispatch_dtype "fp8" (e4m3
    with fp32 scales per 128 values; BF16 input is quantized by the send half) or
    "bf16". private_rows: rows per remote peer sent before the routing counts are known.
    buffers: dispatches in flight at once (1-4; 2 for two-batch overlap). num_sms: CUDA kernels,
    the most blocks each half takes (0: min(SMs, 16)), leaving SMs to compute and to other ranks
    sharing the GPU. rdma_buffers: where the regions between nodes live, "host" (pinned host
    memory, every provider) or "device" (CUDA kernels; the engine must reach the peers' GPU memory:
    cuda_ipc=True and cuda_device on one host, a NIC with FI_HMEM elsewhere). timeout_s: a receive half waiting longer fails, naming the ranks whose rows
    are missing (a dead or stalled peer); its outputs are marked invalid (recv_counts all
    MOE_INVALID_COUNT, combine out NaN), the AllToAll is failed and every later call raises
    (build a new one under a new job name). shrink: DeepEP's shrink mode (host kernels): a rank
    missing after timeout_s, or whose transfers fail, is masked instead (masked_ranks,
    set_masked): nothing more goes to it or is awaited from it, its rows count as none, and
    combine leaves out the slots its experts held (weight zero). init_timeout_s: how long construction waits for the
    other ranks. device: "cpu" (host kernels) or a CUDA device (CUDA kernels on torch's current
    stream).
    """

    def __init__(self, engine: Any, *, rank: int, world_size: int, node_size: int, num_experts: int,
                 experts_per_token: int, hidden: int, max_tokens: int, dispatch_dtype: str = "fp8",
                 private_rows: int = 32, timeout_s: float = 10.0, device: Any = "cpu", store: Any = None,
                 job: Optional[str] = None, proxy_busy_poll: bool = False, init_timeout_s: float = 300.0,
                 buffers: int = 2, num_sms: int = 0, rdma_buffers: str = "host", shrink: bool = False) -> None:
        if dispatch_dtype not in _DTYPES:
            raise ValueError(f"dispatch_dtype must be 'fp8' or 'bf16', got {dispatch_dtype!r}")
        if rdma_buffers not in ("host", "device"):
            raise ValueError(f"rdma_buffers must be 'host' or 'device', got {rdma_buffers!r}")
        self._views: Optional[list] = None
        self._live_key: Optional[str] = None
        self.device = _device_of(device)
        cuda = self.device.type == "cuda"
        self.rank, self.world_size, self.node_size = rank, world_size, node_size
        self.num_experts, self.topk, self.hidden, self.max_tokens = num_experts, experts_per_token, hidden, max_tokens
        self.dispatch_dtype = dispatch_dtype
        self.x_dtype = torch.float8_e4m3fn if dispatch_dtype == "fp8" else torch.bfloat16
        self._store = store_of(store)
        if job is None:
            job = f"moe.{self._store.add(f'fabric-lib/moe/generation/{rank}', 1)}"
        self.job = job
        cfg = AllToAllConfig(rank=rank, ranks=world_size, node_size=node_size, experts=num_experts,
                             topk=experts_per_token, hidden=hidden, max_tokens=max_tokens,
                             dispatch_dtype=_DTYPES[dispatch_dtype], private_rows=private_rows,
                             timeout_s=timeout_s, side=KernelSide.CUDA if cuda else KernelSide.HOST,
                             cuda_device=self.device.index if cuda else 0, job=job,
                             proxy_busy_poll=proxy_busy_poll, buffers=buffers, num_sms=num_sms,
                             rdma_buffers=RdmaBuffers.DEVICE if rdma_buffers == "device" else RdmaBuffers.HOST,
                             shrink=shrink)
        self._hold_job()
        try:
            gather = _StoreAllGather(self._store, job, rank, world_size, init_timeout_s)
            # The C++ side allocates on the current CUDA device.
            with torch.cuda.device(self.device) if cuda else contextlib.nullcontext():
                self._a2a = _c.AllToAll(engine, cfg, gather)
            gather.finish()
        except BaseException:
            self._release_job()
            raise
        self._views = [self._make_views(i) for i in range(buffers)]

    def _hold_job(self) -> None:
        """Refuses a job this rank already holds live in the store: two AllToAlls of one job
        would read each other's construction keys."""
        key = f"{self.job}/a2a/live/{self.rank}"
        if self._store.add(key, 1) != 1:
            self._store.add(key, -1)
            raise ValueError(f"MoE AllToAll job {self.job!r}: rank {self.rank} already has a live AllToAll of this job "
                             f"in this store; close it, or pass another job= (or job=None for a unique one)")
        self._live_key = key

    def _release_job(self) -> None:
        if self._live_key is not None:
            with contextlib.suppress(Exception):  # a store already gone at exit holds nothing
                self._store.add(self._live_key, -1)
            self._live_key = None

    # ---- the output buffers ----

    def _make_views(self, buffer: int) -> tuple:
        """recv_x, recv_scales (FP8; None for BF16), recv_counts, recv_src, recv_runs of one
        buffer set: fixed addresses."""
        o = self._a2a.output_of_set(buffer)
        L, M, H = o.local_experts, o.rows_per_expert, self.hidden
        x = _view(o.x, self.x_dtype, (L, M, H), self.device)
        scales = _view(o.scales, torch.float32, (L, M, H // BLOCK), self.device) if o.scales else None
        counts = _view(o.counts, torch.int32, (L,), self.device)
        src = _view(o.src, torch.int32, (L, M), self.device)
        runs = _view(o.runs, torch.int64, (L, self.world_size), self.device)
        return x, scales, counts, src, runs

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.world_size

    @property
    def rows_per_expert(self) -> int:
        return self.world_size * self.max_tokens

    @property
    def buffers(self) -> int:
        return self.config.buffers

    def _stream(self) -> int:
        return torch.cuda.current_stream(self.device).cuda_stream if self.device.type == "cuda" else 0

    def _live(self) -> list:
        if self._views is None:
            raise RuntimeError("this AllToAll is closed")
        return self._views

    def views(self, handle: Handle) -> tuple:
        """(recv_x, recv_scales, recv_counts, recv_src) of the handle's buffer set: what
        dispatch_recv fills (valid once it returned, or on the stream after it for CUDA)."""
        self._check_handle(handle)
        return self._live()[handle.buffer][:4]

    def runs(self, handle: Handle) -> Any:
        """recv_runs [local_experts, world_size] int64 of the handle's buffer set: (first row << 32) |
        rows, DeepEP's packing (the count in the low 32 bits), of each source rank's rows of each
        expert (DeepEP's layout_range; an empty run
        starts where the next one does; -1 in every entry after a failed receive), filled with
        the rows by dispatch_recv."""
        self._check_handle(handle)
        return self._live()[handle.buffer][4]

    @staticmethod
    def _check_handle(handle: Any) -> None:
        if not isinstance(handle, Handle):
            raise TypeError(f"handle must be the MoeHandle dispatch returned, got {type(handle).__name__}")

    # ---- dispatch ----

    def _dispatch_inputs(self, x: Any, topk_idx: Any, x_scales: Any, round_scale: bool) -> tuple:
        """Checks the inputs (before anything reaches C++, so refused input changes nothing) and
        says who quantizes: (x, x_scales, topk_idx, Quantize)."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 2:
            raise ValueError(f"x must be [num_tokens, hidden {self.hidden}], got shape {list(x.shape)}")
        n = x.shape[0]
        if n > self.max_tokens:
            raise ValueError(f"x holds {n} tokens, more than max_tokens {self.max_tokens}")
        fp8 = self.dispatch_dtype == "fp8"
        quantize = Quantize.NONE
        if round_scale and not (fp8 and x.dtype == torch.bfloat16):
            raise ValueError("round_scale is for BF16 x in an FP8 dispatch (the send half quantizes it)")
        if fp8 and x.dtype == torch.bfloat16:
            if x_scales is not None:
                raise ValueError("x_scales is given with BF16 x: pass BF16 x alone (the send half quantizes it) "
                                 "or float8_e4m3fn x with its scales")
            _check_tensor("x", x, torch.bfloat16, (n, self.hidden), self.device)
            quantize = Quantize.POW2 if round_scale else Quantize.AMAX
        elif fp8:
            if x.dtype != torch.float8_e4m3fn:
                raise TypeError(f"x must be torch.bfloat16 or torch.float8_e4m3fn (dispatch_dtype 'fp8'), got {x.dtype}")
            _check_tensor("x", x, torch.float8_e4m3fn, (n, self.hidden), self.device)
            if x_scales is None:
                raise ValueError("float8_e4m3fn x needs x_scales [num_tokens, hidden / 128] float32")
            _check_tensor("x_scales", x_scales, torch.float32, (n, self.hidden // BLOCK), self.device)
        else:
            _check_tensor("x", x, torch.bfloat16, (n, self.hidden), self.device)
            if x_scales is not None:
                raise ValueError("x_scales is only for dispatch_dtype 'fp8'")
        _check_tensor("topk_idx", topk_idx, torch.int64, (n, self.topk), self.device)
        return x, x_scales, topk_idx, quantize

    def dispatch_send(self, x: Any, topk_idx: Any, x_scales: Any = None, round_scale: bool = False) -> Handle:
        """Sends this rank's tokens to the ranks of their experts and returns the dispatch's
        handle. x [num_tokens, hidden]: BF16, or for an FP8 dispatch float8_e4m3fn with x_scales
        [num_tokens, hidden / 128] float32. BF16 x for an FP8 dispatch is quantized by the send
        half itself, each token once (no torch kernels): bit for bit quantize_fp8_tokens, or with
        round_scale quantize_fp8_tokens_pow2 (power-of-two scales). topk_idx [num_tokens, top-k]
        int64 (-1: slot unused; an expert at most once per token). The routing weights go to
        combine. Up to `buffers` dispatches may be in flight: dispatch n takes buffer set
        n % buffers; one received and never combined is dropped then (its handle raises from
        then on), one not yet received raises FabricError."""
        self._live()
        x, x_scales, topk_idx, quantize = self._dispatch_inputs(x, topk_idx, x_scales, round_scale)
        return self._a2a.dispatch_send(x.shape[0], x.data_ptr(), x_scales.data_ptr() if x_scales is not None else 0,
                                       topk_idx.data_ptr(), self._stream(), quantize)

    def _wait_ns(self, wait_ns: Any, name: str = "wait_ns") -> int:
        """The address of an int64 [world_size] statistics tensor on this AllToAll's device, or 0."""
        if wait_ns is None:
            return 0
        _check_tensor(name, wait_ns, torch.int64, (self.world_size,), self.device)
        return wait_ns.data_ptr()

    def dispatch_recv(self, handle: Handle, wait_ns: Any = None) -> tuple:
        """Waits for every rank's rows of this dispatch to this rank's experts. Returns
        (recv_x [local_experts, rows_per_expert, hidden], recv_scales [local_experts,
        rows_per_expert, hidden / 128] float32 or None for BF16, recv_counts [local_experts] int32,
        recv_src [local_experts, rows_per_expert] int32: source rank * max_tokens + source token),
        views of the handle's buffer set (valid until that set's next dispatch; never after
        close()): expert e's rows come from source ranks in rank order, each source's by token;
        rows past recv_counts[e] are stale. Host kernels raise FabricError for a timeout; CUDA
        kernels report it at the next call and check(). wait_ns: an int64 [world_size] tensor on
        this AllToAll's device, or None; each source rank's wait for its rows (ns, from the call or
        the kernel's start until its rows were seen) is added to its entry."""
        views = self._live()
        self._check_handle(handle)
        self._a2a.dispatch_recv(handle, self._stream(), self._wait_ns(wait_ns))
        return views[handle.buffer][:4]

    def dispatch(self, x: Any, topk_idx: Any, x_scales: Any = None, round_scale: bool = False) -> tuple:
        """dispatch_send and dispatch_recv: (recv_x, recv_scales, recv_counts, recv_src, handle)."""
        h = self.dispatch_send(x, topk_idx, x_scales, round_scale)
        return (*self.dispatch_recv(h), h)

    # ---- combine ----

    def combine_send(self, expert_out: Any, handle: Handle) -> None:
        """Sends this rank's expert outputs of the handle's dispatch back: expert_out
        [local_experts, rows_per_expert, hidden] BF16, rows as dispatch placed them (rows past
        recv_counts are ignored)."""
        self._live()
        self._check_handle(handle)
        _check_tensor("expert_out", expert_out, torch.bfloat16,
                      (self.local_experts, self.rows_per_expert, self.hidden), self.device)
        self._a2a.combine_send(handle, expert_out.data_ptr(), self._stream())

    def _combine_out(self, topk_weights: Any, handle: Handle, out: Any) -> Any:
        n = handle.num_tokens
        _check_tensor("topk_weights", topk_weights, torch.float32, (n, self.topk), self.device)
        if out is None:
            return torch.empty(n, self.hidden, dtype=torch.bfloat16, device=self.device)
        _check_tensor("out", out, torch.bfloat16, (n, self.hidden), self.device)
        return out

    def combine_recv(self, topk_weights: Any, handle: Handle, out: Any = None, wait_ns: Any = None) -> Any:
        """Sums the expert outputs of this rank's tokens of the handle's dispatch into out
        [num_tokens, hidden] BF16 (allocated when None): for each token, the used slots k in slot
        order, topk_weights[t, k] (float32 [num_tokens, top-k]) times the row of (t, k),
        accumulated in fp32 with fused multiply-adds and rounded to BF16 once. For a CUDA graph
        pass `out` (allocated before capture), so the replayed graph writes where the caller
        reads. Frees the handle's buffer set for the next dispatch. wait_ns: as dispatch_recv's."""
        self._live()
        self._check_handle(handle)
        out = self._combine_out(topk_weights, handle, out)
        self._a2a.combine_recv(handle, topk_weights.data_ptr(), out.data_ptr(), self._stream(), self._wait_ns(wait_ns))
        return out

    def combine(self, expert_out: Any, topk_weights: Any, handle: Handle, out: Any = None) -> Any:
        """combine_send and combine_recv; both are checked before anything is sent."""
        self._live()
        self._check_handle(handle)
        out = self._combine_out(topk_weights, handle, out)
        self.combine_send(expert_out, handle)
        self._a2a.combine_recv(handle, topk_weights.data_ptr(), out.data_ptr(), self._stream())
        return out

    # ---- the rest of the C++ API ----

    def output(self, handle: Handle) -> DispatchOutput:
        """The raw addresses and shape of a handle's dispatch output (dispatch returns them as
        tensors)."""
        self._live()
        self._check_handle(handle)
        return self._a2a.output(handle)

    def check(self) -> None:
        """Raises FabricError for the first failure seen (a proxy's transfer, a CUDA kernel's
        timed-out wait or bad expert index)."""
        self._live()
        self._a2a.check()

    def masked_ranks(self) -> list:
        """Shrink mode: the ranks this rank has masked (timed out, failed, or set_masked)."""
        self._live()
        return self._a2a.masked_ranks()

    def set_masked(self, rank: int, masked: bool = True) -> None:
        """Shrink mode: masks (masked=False: unmasks) `rank` on this rank; every rank should do
        the same between steps (DeepEP's low_latency_update_mask_buffer)."""
        self._live()
        self._a2a.set_masked(rank, masked)

    def proxy_stats(self) -> ProxyStats:
        """Steps, writes posted, bytes and CPU ms of this rank's proxies (zeros with one node)."""
        self._live()
        return self._a2a.proxy_stats()

    @property
    def config(self) -> AllToAllConfig:
        return self._a2a.config

    def close(self) -> None:
        """Frees every buffer (the tensors dispatch returned must not be used after), stops the
        proxies and gives the job name back. The engine's close() closes it too."""
        self._views = None
        if hasattr(self, "_a2a"):
            self._a2a.close()
        self._release_job()

    def __enter__(self) -> "AllToAll":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ---- the CPU oracle ----


def fma_fp32(w: Any, x: Any, acc: Any) -> Any:
    """fma(w, x, acc) in fp32, elementwise: w * x + acc rounded once to fp32 (to nearest even), as
    C++ std::fma and CUDA fmaf compute it; torch on the CPU does not fuse. The product of two fp32
    values is exact in float64, but the float64 sum rounds once more than fma, and rounding it to
    fp32 can then land on a tie the exact value was not on (double rounding: about 4 in 1000
    adversarial cases, none in random ones). TwoSum gives the float64 sum's exact error, which
    breaks such ties the way the exact value does."""
    p = w.double() * x.double()
    a = acc.double()
    s = p + a
    bb = s - p
    err = (p - (s - bb)) + (a - bb)  # s + err == p + a exactly
    r = s.float()
    d = s - r.double()  # exact: r is s's nearest fp32
    up = torch.nextafter(r, torch.full_like(r, float("inf")))
    down = torch.nextafter(r, torch.full_like(r, float("-inf")))
    # s halfway between r and a neighbour, the exact value past it: the neighbour is the fma.
    to_up = (d == (up.double() - r.double()) / 2) & (err > 0)
    to_down = (d == (down.double() - r.double()) / 2) & (err < 0)
    return torch.where(to_up, up, torch.where(to_down, down, r))


def _placements(topk_idxs: Sequence[Any], num_experts: int) -> list:
    """For every source rank s: [n_s, top-k] int64, the row of each (token, slot) among its
    expert's rows in the dispatch output (-1 for an unused slot): expert e's rows come from the
    sources in rank order, each source's by token (an expert appears once per token)."""
    before = torch.zeros(num_experts, dtype=torch.int64)  # rows of each expert from lower ranks
    out = []
    for idx in topk_idxs:
        idx = idx.cpu().long()
        used = idx >= 0
        onehot = torch.zeros(idx.shape[0], num_experts, dtype=torch.int64)
        onehot.scatter_add_(1, idx.clamp(min=0), used.long())
        rank_in = torch.cumsum(onehot, 0) - onehot  # tokens before t naming each expert
        row = before[idx.clamp(min=0)] + rank_in.gather(1, idx.clamp(min=0))
        out.append(torch.where(used, row, torch.full_like(row, -1)))
        before += onehot.sum(0)
    return out


def reference_dispatch(inputs: Sequence[tuple], *, num_experts: int, max_tokens: int,
                       rank: Optional[int] = None) -> Any:
    """What every rank's dispatch returns, from every rank's inputs: inputs[s] = (x, x_scales,
    topk_idx, topk_weights) of rank s, x already in the dispatch dtype (float8_e4m3fn with its
    scales, or BF16 with x_scales None). Returns per rank (or for `rank` only) (recv_x, recv_scales,
    recv_counts, recv_src) as dispatch's shapes; rows past recv_counts[e] are zero (src -1)."""
    world = len(inputs)
    L, M = num_experts // world, world * max_tokens
    x0, s0 = inputs[0][0], inputs[0][1]
    hidden = x0.shape[1]
    rows = _placements([inp[2] for inp in inputs], num_experts)

    def one(d: int) -> tuple:
        # Rows are moved as bytes: index_put has no float8 kernels.
        x = torch.zeros(L, M, hidden * x0.element_size(), dtype=torch.uint8)
        scales = torch.zeros(L, M, hidden // BLOCK, dtype=torch.float32) if s0 is not None else None
        counts = torch.zeros(L, dtype=torch.int32)
        src = torch.full((L, M), -1, dtype=torch.int32)
        for s, (xs, ss, idx, _) in enumerate(inputs):
            idx = idx.cpu()
            for el in range(L):
                t, k = torch.nonzero(idx == d * L + el, as_tuple=True)
                if t.numel() == 0:
                    continue
                r = rows[s][t, k]
                x[el, r] = xs.cpu().view(torch.uint8)[t]
                if scales is not None:
                    scales[el, r] = ss.cpu()[t]
                src[el, r] = (s * max_tokens + t).int()
                counts[el] += t.numel()
        return x.view(x0.dtype), scales, counts, src

    return one(rank) if rank is not None else [one(d) for d in range(world)]


def reference_combine_rows(topk_idx: Any, topk_weights: Any, rows: Any) -> Any:
    """The combine of one rank's tokens from the expert outputs of each (token, slot): rows
    [n, top-k, hidden] BF16 (unused slots ignored). Sums w * row over the used slots in slot order
    with fp32 fused multiply-adds (fma_fp32), rounds to BF16 once (nearest even); [n, hidden] BF16."""
    n, k, h = rows.shape
    acc = torch.zeros(n, h, dtype=torch.float32)
    idx, w, y = topk_idx.cpu(), topk_weights.cpu(), rows.cpu().float()
    for j in range(k):
        used = (idx[:, j] >= 0).unsqueeze(1)
        acc = torch.where(used, fma_fp32(w[:, j:j + 1].expand(n, h), y[:, j], acc), acc)
    return acc.to(torch.bfloat16)


def reference_combine(inputs: Sequence[tuple], expert_outs: Sequence[Any], rank: int, *, num_experts: int) -> Any:
    """What rank `rank`'s combine returns: inputs as for reference_dispatch (topk_idx and
    topk_weights are used), expert_outs[d] rank d's expert output [local_experts, rows_per_expert,
    hidden] BF16 in the dispatch layout. [num_tokens of rank, hidden] BF16."""
    world = len(inputs)
    L = num_experts // world
    idx, w = inputs[rank][2].cpu(), inputs[rank][3].cpu()
    row = _placements([inp[2] for inp in inputs], num_experts)[rank]
    n, k = idx.shape
    hidden = expert_outs[0].shape[2]
    rows = torch.zeros(n, k, hidden, dtype=torch.bfloat16)
    for t, j in torch.nonzero(idx >= 0).tolist():
        e = int(idx[t, j])
        rows[t, j] = expert_outs[e // L][e % L, int(row[t, j])].cpu()
    return reference_combine_rows(idx, w, rows)
