"""DeepEP's low-latency API over fabric_lib.moe.AllToAll: code written against deep_ep.Buffer
changes one import (`from fabric_lib.moe.deep_ep import Buffer`) and runs over any NIC the
TransferEngine drives (EFA, ConnectX, tcp and shm for tests) with NVLink inside a node.

    buffer = Buffer(group, num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(T, H, W, E),
                    low_latency_mode=True)
    recv_x, recv_count, handle, event, hook = buffer.low_latency_dispatch(
        x, topk_idx, T, E, use_fp8=True, round_scale=False, use_ue8m0=False,
        async_finish=False, return_recv_hook=False)
    y = experts(recv_x, recv_count)            # [L, W * T, H] BF16, rows past recv_count ignored
    out, event, hook = buffer.low_latency_combine(y, topk_idx, topk_weights, handle)

What it returns, as DeepEP does:
- recv_x: with use_fp8, (values [L, W*T, H] float8_e4m3fn, scales [L, W*T, H/128] float32 whose
  last two dimensions are column-major, or with use_ue8m0 int32 [L, W*T, H/512] of four packed
  UE8M0 exponents, column-major too); else values [L, W*T, H] bfloat16. L = E / W local experts.
- recv_count [L] int32 (MOE_INVALID_COUNT in every entry after a failed receive).
- handle: a tuple (src_info [L, W*T] int32: each row's token index in its source rank (rows past
  recv_count stale), layout_range [L, W] int64: (first row << 32) | rows (DeepEP's pack2(count, begin)) of each source rank's
  rows of each expert (written by the receive half itself; a view of the buffer set, as recv_x),
  T, H, E), with the AllToAll's own handle in `.moe`. Rows of one expert come from the source
  ranks in rank order (DeepEP's come in arrival order: layout_range describes both).
- event: an EventOverlap (current_stream_wait(), a context manager) recorded after the call.
- hook: with return_recv_hook, the call only sends, and hook() receives (dispatch: fills recv_x
  and recv_count; combine: fills out); without it, a no-op.

Two dispatches may be in flight (two buffer sets, as DeepEP's two low-latency buffers): dispatch
A, dispatch B, combine A, combine B. Dispatches alternate the sets, and one never combined is
dropped when its set is next taken, as DeepEP's (a late combine of it raises). One AllToAll per
dispatch dtype is built at the first dispatch of that dtype (collective, as every low-latency call
is), so use_fp8 may change from call to call; a call with other dimensions raises. The AllToAlls
meet under a job named by the group's global ranks: two EP groups of one world never mix.

Differences, each raising where the argument would change behaviour:
- zero_copy=True reads the expert outputs from the tensor get_next_low_latency_combine_buffer
  returned for the handle (one per buffer set, fixed). The combine reads its input in place
  either way (there is no staging copy to save).
- use_logfmt=True (LogFMT combine): NotImplementedError.
- dispatch_wait_recv_cost_stats / combine_wait_recv_cost_stats (int64 [num_ranks]): the wait for
  each source rank's rows is added in nanoseconds (DeepEP adds GPU clock cycles), once per
  receive and source (DeepEP once per local expert and source).
- use_ue8m0 without round_scale: ValueError (as DeepEP).
- DeepEP's normal (high-throughput) mode (dispatch, combine, get_dispatch_layout and the
  intranode_* / internode_* calls): NotImplementedError. set_num_sms is accepted and, as in
  DeepEP, does not touch the low-latency calls.
- async_finish: accepted; the kernels run on the caller's current stream (there is no separate
  communication stream), so the event is complete when the stream reaches it.
- topk_idx at combine is checked for shape only: the routing is kept from the dispatch.
- Constructor: DeepEP's keywords; allow_mnnvl=True, use_fabric=True, enable_shrink=True on a
  machine with CUDA (shrink mode runs on the host kernels only for now) and an mpi4py comm raise
  NotImplementedError at construction, and a keyword neither DeepEP nor this Buffer has raises
  TypeError naming it. explicitly_destroy as DeepEP's (destroy() only then).
- Shrink mode (enable_shrink=True): a rank missing after timeout_s is masked on the ranks that
  waited for it (DeepEP masks on its kernels' timeout alike); low_latency_query_mask_buffer,
  low_latency_update_mask_buffer, low_latency_clean_mask_buffer and clean_low_latency_buffer (a
  barrier through the group's store that masks who does not arrive) as DeepEP's.
- num_nvl_bytes / num_rdma_bytes / num_qps_per_rank: accepted and not needed (buffers are sized
  from the dispatch's dimensions). allow_nvlink_for_low_latency_mode=False puts every rank on a
  node of its own (every row through the proxy and the NIC).
- use_fp8: the send half quantizes each token (as DeepEP's kernels do, no torch kernels), with
  scales amax / 448 (fabric_lib.moe.quantize_fp8_tokens) or with round_scale powers of two
  (quantize_fp8_tokens_pow2); bit for bit what those functions give, not DeepEP's own rounding.
- The scales copy into DeepEP's column-major layout (one torch kernel; the UE8M0 packing two)
  and src_info (source index modulo T, one kernel) follow each receive: their cost is the shim's,
  reported by bench/moe_bench.py against the native API.

CPU tensors run the host kernels (tests, CPU decode); CUDA tensors the CUDA kernels.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

import torch

from . import MOE_INVALID_COUNT, AllToAll
from . import host_wait as _host_wait

__all__ = ["Buffer", "EventOverlap", "topk_idx_t"]

# DeepEP's dtype of expert indices (its extension's topk_idx_t: int64 unless built for int32): what
# low_latency_dispatch takes as topk_idx, so `idx.to(deep_ep.topk_idx_t)` works unchanged.
topk_idx_t = torch.int64

# DeepEP's constructor keywords (deep_ep/buffers/legacy.py), in its order.
_DEEP_EP_KEYWORDS = ("group", "num_nvl_bytes", "num_rdma_bytes", "low_latency_mode", "num_qps_per_rank",
                     "allow_nvlink_for_low_latency_mode", "allow_mnnvl", "use_fabric", "explicitly_destroy",
                     "enable_shrink", "comm")
# What the Buffer passes on to AllToAll (the rest of AllToAll's arguments come from the dispatch).
_ALL_TO_ALL_OPTIONS = frozenset({"private_rows", "timeout_s", "job", "proxy_busy_poll", "init_timeout_s",
                                 "num_sms", "rdma_buffers"})


def _group_id(group: Any) -> str:
    """A name of the group its members agree on: its global ranks ("r0-1-2-3"; a digest when long)."""
    import hashlib

    import torch.distributed as dist

    try:
        ranks = dist.get_process_group_ranks(group)
    except (AttributeError, ValueError, RuntimeError):  # older torch, or the default group
        ranks = list(range(dist.get_world_size(group)))
    text = "-".join(map(str, ranks))
    return "r" + text if len(text) <= 40 else "h" + hashlib.sha1(text.encode()).hexdigest()[:16]


class EventOverlap:
    """DeepEP's EventOverlap: a CUDA event recorded on the current stream after a call (None on
    the CPU, where every call is complete when it returns)."""

    def __init__(self, event: Optional[Any] = None) -> None:
        self.event = event

    def current_stream_wait(self) -> None:
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.current_stream_wait()


def _event(device: torch.device) -> EventOverlap:
    if device.type != "cuda":
        return EventOverlap()
    e = torch.cuda.Event()
    e.record()
    return EventOverlap(e)


def _no_hook() -> None:
    return None


class LowLatencyHandle(tuple):
    """DeepEP's low-latency handle (src_info, layout_range, num_max_dispatch_tokens_per_rank,
    hidden, num_experts); `.moe` is the AllToAll's handle of the dispatch."""

    moe: Any = None


def pack_ue8m0(scales: torch.Tensor) -> torch.Tensor:
    """Power-of-two fp32 scales [..., G] (positive, G a multiple of 4) as int32 [..., G / 4]: the
    exponent byte of four consecutive scales, the first in the lowest byte (DeepEP's UE8M0
    packing). Two kernels: the exponent bytes, then four of them read as one little-endian int32."""
    exp = (scales.contiguous().view(torch.int32) >> 23).to(torch.uint8)  # the sign bit is 0
    return exp.view(torch.int32)


def _column_major(shape: tuple, dtype: Any, device: torch.device) -> torch.Tensor:
    """A [L, M, G] tensor whose last two dimensions are column-major (DeepEP's TMA layout)."""
    L, M, G = shape
    return torch.empty(L, G, M, dtype=dtype, device=device).transpose(1, 2)


class Buffer:
    """deep_ep.Buffer's low-latency half over a fabric_lib AllToAll (module docstring).

    DeepEP's constructor, keyword for keyword (deep_ep/buffers/legacy.py): group, num_nvl_bytes,
    num_rdma_bytes, low_latency_mode, num_qps_per_rank, allow_nvlink_for_low_latency_mode,
    allow_mnnvl, use_fabric, explicitly_destroy, enable_shrink, comm. What this Buffer cannot do
    raises here, at construction, naming the keyword (allow_mnnvl=True, use_fabric=True,
    enable_shrink=True with CUDA, a comm instead of a group); a keyword DeepEP does not have and this Buffer
    does not take raises TypeError naming it. explicitly_destroy as DeepEP: with True, destroy()
    must be called (and may be called only then); with False, the resources go with the Buffer.

    group: the torch.distributed process group of the expert-parallel ranks (None: the default
    group); its store carries the construction. engine: the fabric_lib TransferEngine the
    inter-node rows go through (None: one is opened, and closed with the Buffer: where CUDA is
    available it serves the current GPU with cuda_ipc=True and the regions between nodes are in
    GPU memory, rdma_buffers="device", as DeepEP's; else the engine's defaults). With an engine
    given, rdma_buffers stays "host" unless passed (the Buffer cannot tell whether the engine
    reaches GPU memory). node_size: ranks per NVLink domain (None: LOCAL_WORLD_SIZE, else min(world, 8)).
    host_wait: how this rank's host thread waits for the GPU where CUDA is available (the current
    context's scheduling flag, fabric_lib.moe.host_wait): "auto" (blocking-sync where the group's
    ranks on this host, three busy threads each, outnumber its cores; else CUDA's spin), "spin",
    "yield" or "blocking-sync"; the mode taken is `host_wait` on the Buffer (None without CUDA).
    The other keywords go to AllToAll (private_rows, timeout_s, num_sms, proxy_busy_poll, ...)."""

    def __init__(self, group: Any = None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = True, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 use_fabric: bool = False, explicitly_destroy: bool = False, enable_shrink: bool = False,
                 comm: Any = None, *, engine: Any = None, node_size: Optional[int] = None,
                 store: Any = None, host_wait: str = "auto", **all_to_all_options: Any) -> None:
        import torch.distributed as dist

        self._destroyed = True  # until construction succeeds: __del__ has nothing to release
        unknown = sorted(set(all_to_all_options) - _ALL_TO_ALL_OPTIONS)
        if unknown:
            raise TypeError(f"Buffer() got unknown keyword argument(s) {', '.join(map(repr, unknown))}: it takes "
                            f"DeepEP's ({', '.join(_DEEP_EP_KEYWORDS)}), engine, node_size, store, host_wait, and the "
                            f"AllToAll options ({', '.join(sorted(_ALL_TO_ALL_OPTIONS))})")
        _host_wait.choose(host_wait, 1)  # an unknown mode raises here, on every machine
        if allow_mnnvl:
            raise NotImplementedError("allow_mnnvl: multi-node NVLink domains are not supported (node_size <= 8)")
        if use_fabric:
            raise NotImplementedError("use_fabric: fabric (cuMem) memory for the NVLink buffers is not supported; "
                                      "node-mates map each other's buffers through CUDA IPC")
        if enable_shrink and torch.cuda.is_available() and engine is None:
            raise NotImplementedError("enable_shrink: shrink mode (masking a failed rank) runs on the host kernels "
                                      "only for now; the CUDA kernels do not mask a rank yet")
        if comm is not None:
            raise NotImplementedError("comm: an mpi4py communicator is not supported; pass the torch.distributed "
                                      "group of the expert-parallel ranks")
        self.group = group if group is not None else dist.group.WORLD
        self.rank, self.group_size = dist.get_rank(self.group), dist.get_world_size(self.group)
        if node_size is None:
            node_size = int(os.environ.get("LOCAL_WORLD_SIZE", min(self.group_size, 8)))
        if not allow_nvlink_for_low_latency_mode:
            node_size = 1
        if node_size < 1 or self.group_size % node_size:
            raise ValueError(f"node_size {node_size} must divide the group's {self.group_size} ranks")
        self.node_size = node_size
        self.low_latency_mode = low_latency_mode
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self._store = store if store is not None else dist.distributed_c10d._get_default_store()
        self._own_engine = engine is None
        self._options = dict(all_to_all_options)
        if engine is None:
            import fabric_lib as fl

            if torch.cuda.is_available():
                # As DeepEP's buffers, the regions between nodes live in GPU memory, written GPU to
                # GPU: the engine serves this GPU and reaches same-host peers through CUDA IPC.
                engine = fl.TransferEngine(cuda_device=torch.cuda.current_device(), cuda_ipc=True)
                self._options.setdefault("rdma_buffers", "device")
            else:
                engine = fl.TransferEngine()
        self.engine = engine
        self.host_wait = self._set_host_wait(host_wait)
        # The jobs of this Buffer's AllToAlls: unique to its group (the group's global ranks name
        # it) and to its place among that group's Buffers, so two EP groups of one world, or two
        # Buffers of one group, never meet under one name in the shared store.
        if "job" not in self._options:
            group_id = _group_id(self.group)
            n = self._store.add(f"fabric-lib/deep_ep/{group_id}/buffers/{self.rank}", 1)
            self._options["job"] = f"deep_ep.{group_id}.{n}"
        self.enable_shrink = enable_shrink
        if enable_shrink:
            self._options["shrink"] = True
        self._masked: set = set()  # shrink mode: the ranks masked in any of this Buffer's AllToAlls
        self._cleans = 0  # clean_low_latency_buffer calls (each a barrier of its own)
        self._a2as: dict = {}  # use_fp8 -> AllToAll, built at the first dispatch of that dtype
        self._dims: Optional[tuple] = None
        self._scales: dict = {}  # (use_fp8, buffer set, ue8m0) -> DeepEP-layout scales tensor
        self._combine_inputs: dict = {}  # (use_fp8, buffer set) -> zero-copy combine input
        self.explicitly_destroy = explicitly_destroy
        self._destroyed = False

    def _set_host_wait(self, mode: str) -> Optional[str]:
        """Applies host_wait to the current CUDA context; the mode taken (None without CUDA).
        "auto" counts the group's ranks on this host (a collective, as the rest of construction)."""
        import socket

        import torch.distributed as dist

        if not torch.cuda.is_available():
            return None
        ranks_on_host = 1
        if mode == "auto":
            hosts: list = [None] * self.group_size
            dist.all_gather_object(hosts, socket.gethostname(), group=self.group)
            ranks_on_host = hosts.count(socket.gethostname())
        taken = _host_wait.choose(mode, ranks_on_host)
        torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device()))  # the context is current
        _host_wait.apply(taken)
        return taken

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """Bytes of RDMA-registered memory two buffer sets take per rank at these dimensions (FP8
        rows of hidden + hidden / 32 + 16 bytes, BF16 combine rows): informational, as the
        AllToAll sizes its own buffers."""
        T, H, W = num_max_dispatch_tokens_per_rank, hidden, num_ranks
        row = H + H // 32 + 16
        per_set = num_experts // max(W, 1) * W * T * row + 8 * T * 2 * H + 4 * W * num_experts
        return 2 * per_set

    # ---- construction at the first dispatch ----

    def _all_to_all(self, x: torch.Tensor, topk_idx: torch.Tensor, T: int, E: int, use_fp8: bool) -> AllToAll:
        """The AllToAll of this dtype: one per dispatch dtype, each built (collectively, as every
        rank makes the same calls) at the first dispatch of that dtype (in shrink mode both at the
        first dispatch), so use_fp8 may change from call to call as DeepEP allows; the other
        dimensions are the Buffer's."""
        dims = (T, E, x.shape[1], topk_idx.shape[1], x.device)
        if self._dims is not None and dims != self._dims:
            raise ValueError(f"low_latency_dispatch with (tokens per rank, experts, hidden, top-k) = {dims[:4]} on "
                             f"{dims[4]}, but this Buffer was built for {self._dims[:4]} on {self._dims[4]}: use one "
                             f"Buffer per shape")
        # Shrink mode builds both at the first dispatch: a construction is collective, and a rank
        # may be gone by the time the other dtype is first asked for.
        for fp8 in ((use_fp8, not use_fp8) if self.enable_shrink else (use_fp8,)):
            if fp8 in self._a2as:
                continue
            options = dict(self._options, job=f"{self._options['job']}.{'fp8' if fp8 else 'bf16'}")
            a2a = AllToAll(self.engine, rank=self.rank, world_size=self.group_size, node_size=self.node_size,
                           num_experts=E, experts_per_token=topk_idx.shape[1], hidden=x.shape[1], max_tokens=T,
                           dispatch_dtype="fp8" if fp8 else "bf16", device=x.device, store=self._store,
                           **options)
            self._a2as[fp8] = a2a
            self._dims = dims
            for r in self._masked:
                a2a.set_masked(r, True)
        return self._a2as[use_fp8]

    # ---- dispatch ----

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False) -> tuple:
        """DeepEP's low_latency_dispatch: x [num_tokens, hidden] BF16, topk_idx [num_tokens,
        top-k] int64 (-1: unused). Returns (recv_x, recv_count, handle, event, hook) (module
        docstring)."""
        if use_ue8m0 and not round_scale:
            raise ValueError("use_ue8m0 needs round_scale=True (UE8M0 holds power-of-two scales only)")
        if (round_scale or use_ue8m0) and not use_fp8:
            raise ValueError("round_scale / use_ue8m0 are for use_fp8=True")
        if x.dtype != torch.bfloat16:
            raise TypeError(f"x must be torch.bfloat16, got {x.dtype}")
        if use_ue8m0 and x.shape[1] % 512:
            raise ValueError(f"use_ue8m0 needs hidden {x.shape[1]} to be a multiple of 512 (four scales per int32)")
        a2a = self._all_to_all(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8)
        a2a._wait_ns(dispatch_wait_recv_cost_stats, "dispatch_wait_recv_cost_stats")  # checked before anything is sent
        h = a2a.dispatch_send(x, topk_idx, round_scale=use_fp8 and round_scale)  # quantized by the send half
        rx, rs, counts, src = a2a.views(h)
        scales = self._scales_tensor((use_fp8, h.buffer, use_ue8m0), rs) if use_fp8 else None
        W, T, L = self.group_size, num_max_dispatch_tokens_per_rank, a2a.local_experts
        src_info = torch.empty(L, W * T, dtype=torch.int32, device=x.device)
        layout_range = a2a.runs(h)  # filled by the receive half

        def receive() -> None:
            a2a.dispatch_recv(h, wait_ns=dispatch_wait_recv_cost_stats)
            self._share_masks()
            if scales is not None:
                scales.copy_(pack_ue8m0(rs) if use_ue8m0 else rs)
            torch.remainder(src, T, out=src_info)
            if cumulative_local_expert_recv_stats is not None:
                cumulative_local_expert_recv_stats.add_(counts.clamp(min=0))

        hook: Callable[[], None] = _no_hook
        if return_recv_hook:
            hook = receive
        else:
            receive()
        handle = LowLatencyHandle((src_info, layout_range, T, x.shape[1], num_experts))
        handle.moe, handle.a2a, handle.use_fp8 = h, a2a, use_fp8
        recv_x = (rx, scales) if use_fp8 else rx
        return recv_x, counts, handle, _event(x.device) if async_finish else EventOverlap(), hook

    def _scales_tensor(self, key: tuple, rs: torch.Tensor) -> torch.Tensor:
        """The DeepEP-layout scales of a buffer set (key: use_fp8, set, ue8m0), allocated once
        (fixed for CUDA graphs)."""
        ue8m0 = key[2]
        if key not in self._scales:
            L, M, G = rs.shape
            self._scales[key] = _column_major((L, M, G // 4 if ue8m0 else G), torch.int32 if ue8m0 else torch.float32,
                                              rs.device)
        return self._scales[key]

    # ---- combine ----

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: tuple, use_logfmt: bool = False, zero_copy: bool = False,
                            async_finish: bool = False, return_recv_hook: bool = False,
                            out: Optional[torch.Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[torch.Tensor] = None) -> tuple:
        """DeepEP's low_latency_combine: x [L, W*T, hidden] BF16 expert outputs in the dispatch's
        layout, topk_weights [num_tokens, top-k] float32; returns (combined_x [num_tokens, hidden]
        BF16, event, hook)."""
        if use_logfmt:
            raise NotImplementedError("use_logfmt (LogFMT combine) is not supported: combine is BF16")
        h, a2a = self._dispatch_of(handle)
        if tuple(topk_idx.shape) != (h.num_tokens, a2a.topk):
            raise ValueError(f"topk_idx must have shape [{h.num_tokens}, {a2a.topk}] (the dispatch's), "
                             f"got {list(topk_idx.shape)}")
        if zero_copy:
            # DeepEP's zero copy: the expert outputs were written into the buffer
            # get_next_low_latency_combine_buffer returned; x is checked for shape only.
            key = (handle.use_fp8, h.buffer)
            if key not in self._combine_inputs:
                raise ValueError("zero_copy=True: write the expert outputs into "
                                 "get_next_low_latency_combine_buffer(handle) first")
            if tuple(x.shape) != tuple(self._combine_inputs[key].shape):
                raise ValueError(f"x must have shape {list(self._combine_inputs[key].shape)}, got {list(x.shape)}")
            x = self._combine_inputs[key]
        out = a2a._combine_out(topk_weights, h, out)  # checked before anything is sent
        a2a._wait_ns(combine_wait_recv_cost_stats, "combine_wait_recv_cost_stats")
        a2a.combine_send(x, h)

        def receive() -> None:
            a2a.combine_recv(topk_weights, h, out, wait_ns=combine_wait_recv_cost_stats)
            self._share_masks()

        hook: Callable[[], None] = _no_hook
        if return_recv_hook:
            hook = receive
        else:
            receive()
        return out, _event(x.device) if async_finish else EventOverlap(), hook

    def _dispatch_of(self, handle: Any) -> tuple:
        """(the AllToAll handle, the AllToAll) of a handle low_latency_dispatch returned."""
        h, a2a = getattr(handle, "moe", None), getattr(handle, "a2a", None)
        if h is None or a2a is None or self._a2as.get(getattr(handle, "use_fp8", None)) is not a2a:
            raise TypeError("handle must be the one low_latency_dispatch of this Buffer returned")
        return h, a2a

    def get_next_low_latency_combine_buffer(self, handle: tuple) -> torch.Tensor:
        """DeepEP's: the tensor [local experts, W * T, hidden] BF16 the expert outputs of this
        dispatch may be written into, for low_latency_combine(..., zero_copy=True). One per
        buffer set (fixed addresses, for CUDA graphs). The combine reads it in place: there is no
        staging copy, with or without zero_copy."""
        h, a2a = self._dispatch_of(handle)
        key = (handle.use_fp8, h.buffer)
        if key not in self._combine_inputs:
            self._combine_inputs[key] = torch.empty(a2a.local_experts, a2a.rows_per_expert, a2a.hidden,
                                                    dtype=torch.bfloat16, device=a2a.device)
        return self._combine_inputs[key]

    # ---- the rest of DeepEP's surface ----

    num_sms = 20  # DeepEP's: the normal kernels' SMs (the low-latency kernels do not read it)

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """As DeepEP: sets the normal (high-throughput) kernels' SM count, which the low-latency
        calls do not use; the AllToAll's grid cap is its num_sms option."""
        Buffer.num_sms = new_num_sms

    def get_comm_stream(self) -> Any:
        """The stream the calls run on: the caller's current stream (there is no other)."""
        return torch.cuda.current_stream() if torch.cuda.is_available() else None

    def _normal_mode(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("DeepEP's normal (high-throughput) mode is not supported: fabric_lib.moe.deep_ep "
                                  "covers the low-latency calls (low_latency_dispatch / low_latency_combine)")

    get_dispatch_layout = dispatch = combine = internode_dispatch = internode_combine = _normal_mode
    intranode_dispatch = intranode_combine = _normal_mode


    # ---- shrink mode (enable_shrink=True) ----

    def _share_masks(self) -> None:
        """A rank one of this Buffer's AllToAlls masked is masked in all of them (shrink mode)."""
        if not self.enable_shrink:
            return
        for a2a in self._a2as.values():
            self._masked.update(a2a.masked_ranks())
        for a2a in self._a2as.values():
            for r in self._masked - set(a2a.masked_ranks()):
                a2a.set_masked(r, True)

    def _require_shrink(self, what: str) -> None:
        if not self.enable_shrink:
            raise RuntimeError(f"{what} needs a Buffer built with enable_shrink=True (as in DeepEP)")

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """DeepEP's: masks (mask=True) or unmasks `rank_to_mask` on this rank: nothing is sent to
        or awaited from a masked rank, and combine leaves out the slots its experts held."""
        self._require_shrink("low_latency_update_mask_buffer")
        if not 0 <= rank_to_mask < self.group_size:
            raise ValueError(f"rank_to_mask {rank_to_mask} is not a rank of this group of {self.group_size}")
        self._share_masks()
        (self._masked.add if mask else self._masked.discard)(rank_to_mask)
        for a2a in self._a2as.values():
            a2a.set_masked(rank_to_mask, mask)

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """DeepEP's: mask_status [num_ranks] torch.int gets 1 for each masked rank, 0 otherwise."""
        self._require_shrink("low_latency_query_mask_buffer")
        if mask_status.dtype != torch.int or tuple(mask_status.shape) != (self.group_size,):
            raise ValueError(f"mask_status must be a torch.int tensor of shape [{self.group_size}], "
                             f"got {mask_status.dtype} {list(mask_status.shape)}")
        self._share_masks()
        status = torch.zeros(self.group_size, dtype=torch.int)
        status[sorted(self._masked)] = 1
        mask_status.copy_(status)

    def low_latency_clean_mask_buffer(self) -> None:
        """DeepEP's: unmasks every rank on this rank."""
        self._require_shrink("low_latency_clean_mask_buffer")
        for r in sorted(self._masked):
            for a2a in self._a2as.values():
                a2a.set_masked(r, False)
        self._masked.clear()

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """DeepEP's: nothing needs zeroing here (every receive waits for this step's flags, never
        for zeroed memory), so this is DeepEP's barrier alone: every rank of the group (not masked)
        arrives, through the group's store, within timeout_s. A rank that does not is masked in
        shrink mode; without it, the call raises naming it."""
        import datetime

        self._share_masks()
        self._cleans += 1
        job, timeout = self._options["job"], float(self._options.get("timeout_s", 10.0))
        key = lambda r: f"fabric-lib/deep_ep/{job}/clean/{self._cleans}/{r}"  # noqa: E731
        self._store.set(key(self.rank), b"1")
        waiting = [r for r in range(self.group_size) if r != self.rank and r not in self._masked]
        try:
            self._store.wait([key(r) for r in waiting], datetime.timedelta(seconds=timeout))
            return
        except Exception:  # noqa: BLE001 - the store says only that it timed out; find out who
            missing = [r for r in waiting if not self._store.check([key(r)])]
        if not missing:
            return
        if not self.enable_shrink:
            raise TimeoutError(f"clean_low_latency_buffer on rank {self.rank}: ranks {missing} did not arrive "
                               f"within {timeout} s (dead or stalled?)")
        for r in missing:
            self.low_latency_update_mask_buffer(r, True)

    def check(self) -> None:
        """Raises FabricError for the first failure seen (a CUDA kernel's timed-out wait)."""
        for a2a in self._a2as.values():
            a2a.check()

    def destroy(self) -> None:
        """Frees the AllToAll (and the engine this Buffer opened). As DeepEP, only for a Buffer
        built with explicitly_destroy=True (the others release theirs when they go)."""
        if not self.explicitly_destroy:
            raise RuntimeError("destroy() is for a Buffer built with explicitly_destroy=True (as in DeepEP); "
                               "this one releases its resources when it is garbage-collected")
        self._release()

    def __del__(self) -> None:
        if getattr(self, "_destroyed", True):
            return
        if self.explicitly_destroy:
            import warnings

            warnings.warn("a deep_ep Buffer built with explicitly_destroy=True was not destroy()ed", ResourceWarning)
        try:
            self._release()
        except Exception:  # noqa: BLE001 - nothing to report to from a finalizer
            pass

    def _release(self) -> None:
        self._destroyed = True
        # This rank's clean_low_latency_buffer keys, but the last: a slower rank may still be
        # about to read that one (it read the earlier ones before it set its last).
        for n in range(1, self._cleans):
            try:
                self._store.delete_key(f"fabric-lib/deep_ep/{self._options['job']}/clean/{n}/{self.rank}")
            except Exception:  # noqa: BLE001 - the store may be gone with its master; nothing to free then
                pass
        for a2a in self._a2as.values():
            a2a.close()
        self._a2as = {}
        if self._own_engine and self.engine is not None:
            self.engine.close()
            self.engine = None
