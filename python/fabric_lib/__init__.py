"""fabric-lib: RDMA point-to-point transfers for LLM systems.

One-sided WRITEs carrying 32-bit immediates, counted on the receiver whatever their order, over
1 to 4 NICs. The calls mirror the C++ API (docs/api.md); on top of it this package adds tensor and
buffer registration, page lists from any integer sequence, and asyncio awaitables.
detect_topology() reads the host's GPUs, RDMA NICs and cores from sysfs.
"""

from __future__ import annotations

import asyncio
import atexit
import ctypes
import sys
import weakref
from typing import Any, Iterable, Optional, Union

import numpy as np

from . import _fabric_lib as _c
from ._fabric_lib import (
    DoneCounter,
    DoneFlag,
    Engine as _Engine,
    FabricError,
    FabricTimeoutError,
    GpuCounter,
    GroupSlice,
    ImmExpectation,
    ImmReservation,
    MrDesc,
    MrHandle,
    NetAddr,
    NicAffinity,
    NicStats,
    Pages as _Pages,
    PeerGroupHandle,
    RemoteMr,
    ScatterSlice,
    Status,
    TopoGpu,
    TopoNic,
    TopoNumaNode,
    Topology,
    UvmWatcher,
    detect_topology,
    gpu_stream_wait,
    remove_shm_endpoints_of,
    single_write_imm_count,
)

__all__ = [
    "DoneCounter", "DoneFlag", "FabricError", "FabricTimeoutError", "GpuCounter", "GroupSlice", "ImmExpectation", "ImmReservation",
    "MrDesc",
    "MrHandle", "NetAddr", "NicAffinity", "NicStats", "Pages", "PeerGroupHandle", "RemoteMr",
    "ScatterSlice", "Status", "TopoGpu", "TopoNic", "TopoNumaNode", "Topology", "TransferEngine",
    "UvmWatcher", "detect_topology", "gpu_stream_wait", "remove_shm_endpoints_of",
    "single_write_imm_count",
]

# Wherever a destination is expected: an interned region, or a descriptor that the call interns
# with add_remote (idempotent: the same descriptor is interned once).
Dst = Union[RemoteMr, MrDesc]


def _as_page_indices(indices: Any) -> np.ndarray:
    """Any integer sequence (list, numpy array, torch tensor) as a contiguous uint32 array."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(indices, torch.Tensor):
        if indices.is_floating_point() or indices.is_complex() or indices.dtype == torch.bool:
            raise TypeError(f"page indices must be integers, got a tensor of {indices.dtype}")
        indices = indices.detach().cpu().numpy()
    arr = np.asarray(indices)
    if arr.size == 0:
        return np.zeros(0, dtype=np.uint32)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"page indices must be integers, got {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"page indices must be one-dimensional, got shape {arr.shape}")
    bad = np.flatnonzero((arr < 0) | (arr > 0xFFFFFFFF))
    if bad.size:
        raise ValueError(f"page indices must lie in [0, 2**32): indices[{bad[0]}] is {arr[bad[0]]}")
    return np.ascontiguousarray(arr, dtype=np.uint32)


class Pages(_Pages):
    """Page i lives at offset + stride * indices[i]; indices is any integer sequence."""

    def __init__(self, indices: Any, stride: int, offset: int = 0) -> None:
        super().__init__(_as_page_indices(indices), stride, offset)


def _buffer_address(obj: Any) -> tuple[int, int, Optional[int]]:
    """(address, byte length, CUDA device or None) of a contiguous, writable buffer: torch tensor
    (CPU or CUDA), numpy array, bytearray or any writable buffer-protocol object."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        if not obj.is_contiguous():
            raise ValueError("the tensor is not contiguous: register tensor.contiguous() instead")
        if obj.device.type not in ("cpu", "cuda"):
            raise FabricError(f"unsupported: {obj.device} tensors (CPU and CUDA only)")
        device = obj.device.index if obj.device.type == "cuda" else None
        return obj.data_ptr(), obj.numel() * obj.element_size(), device
    if isinstance(obj, np.ndarray):
        if not obj.flags["C_CONTIGUOUS"]:
            raise ValueError("the array is not C-contiguous: register np.ascontiguousarray(a)")
        if not obj.flags["WRITEABLE"]:
            raise ValueError("the array is read-only; remote peers write into registered memory")
        return obj.ctypes.data, obj.nbytes, None
    view = memoryview(obj)
    if not view.contiguous:
        raise ValueError("the buffer is not contiguous")
    if view.readonly:
        raise ValueError("the buffer is read-only; remote peers write into registered memory")
    if view.nbytes == 0:
        raise ValueError("the buffer is empty")
    return ctypes.addressof(ctypes.c_char.from_buffer(view)), view.nbytes, None


# The constructor's keywords, in order (python/src/bindings.cpp), and their types where a mistake is
# common enough to name it before nanobind's generic "incompatible function arguments".
_ENGINE_KEYWORDS = ("provider", "nics", "poll", "callback_poll", "transfer_timeout_s", "max_in_flight_per_nic",
                    "max_message_size", "worker_cpu", "reorder", "reorder_seed", "cuda_device", "cuda_ipc",
                    "host_ipc", "topology", "gpus", "metrics_port", "metrics_address")


def _check_engine_arguments(args: tuple, kwargs: dict) -> None:
    if len(args) > len(_ENGINE_KEYWORDS):
        raise TypeError(f"TransferEngine() takes at most {len(_ENGINE_KEYWORDS)} arguments ({len(args)} given)")
    given = dict(zip(_ENGINE_KEYWORDS, args))
    for k, v in kwargs.items():
        if k not in _ENGINE_KEYWORDS:
            raise TypeError(f"TransferEngine() got an unknown argument {k!r} (it takes {', '.join(_ENGINE_KEYWORDS)})")
        if k in given:
            raise TypeError(f"TransferEngine() got {k} twice (by position and by name)")
        given[k] = v
    nics = given.get("nics")
    if nics is not None and (isinstance(nics, (str, bytes)) or not all(isinstance(n, str) for n in nics)):
        raise TypeError(f"TransferEngine(nics=...) must be a list of strings, one per NIC (e.g. ['127.0.0.2', "
                        f"'127.0.0.3']), got {nics!r}")
    for k in ("provider", "poll", "callback_poll"):
        if given.get(k) is not None and not isinstance(given[k], str):
            raise TypeError(f"TransferEngine({k}=...) must be a str, got {type(given[k]).__name__}")
    for k in ("transfer_timeout_s",):
        v = given.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise TypeError(f"TransferEngine({k}=...) must be a number of seconds, got {type(v).__name__}")
    for k in ("max_in_flight_per_nic", "max_message_size"):
        v = given.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
            raise ValueError(f"TransferEngine({k}=...) must be a positive int, got {v!r}")


class TransferEngine(_Engine):
    """A transfer engine: see docs/api.md for every call's semantics.

    Construction: TransferEngine(provider=None, nics=None, poll=None, callback_poll=None,
    transfer_timeout_s=30.0, ...). What is left out comes from the environment as in C++
    (FABRIC_PROVIDER, FABRIC_NICS, FABRIC_POLL, FABRIC_CUDA_DEVICE, FABRIC_CUDA_IPC,
    FABRIC_HOST_IPC), else from the provider: "tcp;ofi_rxm" on 127.0.0.1, shm with no address,
    efa on the NICs detect_topology() gives the GPU, verbs on the first device; poll "adaptive".
    Each entry of `nics` is a source address ("127.0.0.2"), a libfabric domain name with an
    address ("domain@node"), a verbs device name, or "" for the provider's default; 1 to 4
    entries (an empty list raises FabricError, as zero NICs is invalid).
    Usable as a context manager (close() on exit). Same-host peers: cuda_ipc=True (with
    cuda_device) writes GPU memory through CUDA IPC; host_ipc=True writes host memory with one
    kernel copy by the initiator (process_vm_writev): both engines must enable it, and not both
    local domains on one engine (docs/api.md, "Same-host host memory").

    One engine for every GPU of the host: TransferEngine(topology=detect_topology()) (or with
    gpus=[...] for some of them) starts one worker per GPU with the NICs and cores the topology
    gave it; the other arguments configure the rest (and the NICs, where the host has none).
    Regions go to their GPU's worker; expect_imm_count and the barriers take cuda_device= to name
    the GPU whose worker counts or sends.

    Writes name their destination by a RemoteMr (add_remote(desc), once) or directly by an MrDesc,
    which the call interns (add_remote is idempotent, so repeated submits reuse one region); the
    submit_* calls take keyword arguments.

    on_done arguments accept None, a DoneFlag, a DoneCounter, or a callable(status: Status) that
    runs on the engine's callback thread with the GIL held (exceptions go to sys.unraisablehook).
    DoneFlag and DoneCounter are set by the engine's worker without the GIL: they keep counting
    while Python code holds it. A DoneFlag is one-shot (reset() re-arms it) and keeps the Status
    it ended with (flag.status); a DoneCounter keeps its first failure (counter.error).

    Handles (MrHandle, RemoteMr, PeerGroupHandle, ImmExpectation) belong to the engine that made
    them: another engine refuses them. Errors raise FabricError with .code ("invalid argument",
    "not found", "timeout", ...); every timeout raises FabricTimeoutError, which is also a
    TimeoutError.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _check_engine_arguments(args, kwargs)
        super().__init__(*args, **kwargs)
        self._registered: dict[MrHandle, Any] = {}
        _live_engines.add(self)

    def __enter__(self) -> "TransferEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- memory ----

    def register_tensor(self, obj: Any, imms: Optional[ImmReservation] = None) -> tuple[MrHandle, MrDesc]:
        """Registers a torch tensor (CPU or CUDA), numpy array or writable buffer; keeps it alive
        until dereg_mr. imms: the ImmReservation whose range WRITEs into it use."""
        ptr, nbytes, cuda_device = _buffer_address(obj)
        handle, desc = self.reg_mr(ptr, nbytes, cuda_device, imms)
        self._registered[handle] = obj
        return handle, desc

    def register_tensors(self, objs: Iterable[Any], imms: Optional[ImmReservation] = None,
                         prefault: bool = False) -> list[tuple[MrHandle, MrDesc]]:
        """Registers many tensors or buffers (as register_tensor) in one reg_mrs call: one round
        trip per worker, all or none (a bad one, or a failure part-way, registers nothing).
        prefault: populate host pages first, so the first WRITE into them does not fault them in."""
        objs = list(objs)
        regions = [_buffer_address(o) for o in objs]
        registered = self.reg_mrs(regions, imms, prefault)
        for obj, (handle, _) in zip(objs, registered):
            self._registered[handle] = obj
        return registered

    def dereg_mr(self, handle: MrHandle) -> None:
        """Ends local and remote access (see Engine.dereg_mr) and drops register_tensor's reference."""
        super().dereg_mr(handle)
        self._registered.pop(handle, None)

    # ---- immediate namespaces ----

    def reserve_imms(self, holder: str, bits: int = 28, base: Optional[int] = None) -> ImmReservation:
        """A range of this engine's immediate space for one user (2**bits values, the highest free
        block or at base): register its regions with imms= and count their WRITEs' immediates
        through it, in local values. Raises FabricError for a range another holder overlaps (naming
        it). The engine's own expect_imm_count, imm_count and discard_imm_count refuse its values."""
        return _c.ImmReservation(self, holder, bits, base)

    # ---- GPU signals (CUDA builds, an engine with cuda_device) ----

    def alloc_uvm_watcher(self, callback: Any = None,
                          cuda_device: Optional[int] = None) -> UvmWatcher:
        """A word of pinned, device-mapped memory: kernels (also in CUDA graphs) write it at
        watcher.device_ptr; callback(old, new) runs on the engine's watcher thread, under the GIL,
        on every change it sees (fast changes may coalesce). callback=None: none runs; wait for
        values with wait_uvm_watcher (no GIL taken per change, microseconds instead of tens)."""
        return _c.alloc_uvm_watcher(self, callback, cuda_device)

    def wait_uvm_watcher(self, watcher: UvmWatcher, at_least: int,
                         timeout_s: Optional[float] = None) -> int:
        """Blocks, with the GIL released, until the watcher's word reads at_least or more (it spins
        on the word, then yields, then sleeps); returns the value read. Raises TimeoutError after
        timeout_s (None: no limit), FabricError if the engine closes meanwhile. The watcher must
        be this engine's, and not be freed while a wait on it runs."""
        return _c.wait_uvm_watcher(self, watcher, at_least, timeout_s)

    def free_uvm_watcher(self, watcher: UvmWatcher) -> None:
        """Stops watching and frees the word (also allowed from inside its callback)."""
        _c.free_uvm_watcher(self, watcher)

    def alloc_gpu_counter(self, cuda_device: Optional[int] = None) -> GpuCounter:
        """A completion counter: pass it as on_done (it counts successes) or as a KV request's
        `landed`; kernels wait on counter.device_ptr, streams with gpu_stream_wait."""
        return _c.alloc_gpu_counter(self, cuda_device)

    def wait_gpu_counter(self, counter: GpuCounter, at_least: int,
                         timeout_s: Optional[float] = None) -> int:
        """Blocks, with the GIL released, until the counter reaches at_least; returns its value.
        Raises TimeoutError after timeout_s (None: no limit), FabricError if the engine closes
        meanwhile. The counter must be this engine's, and not be freed while a wait on it runs."""
        return _c.wait_gpu_counter(self, counter, at_least, timeout_s)

    def free_gpu_counter(self, counter: GpuCounter) -> None:
        """Frees the counter; no transfer or kernel may still use it."""
        _c.free_gpu_counter(self, counter)

    # ---- asyncio ----

    def _future(self) -> tuple[asyncio.Future, Any]:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def settle(status: Status) -> None:
            if fut.done():
                return
            if status.ok:
                fut.set_result(None)
            else:
                fut.set_exception(_c._error_of(status))

        def on_done(status: Status) -> None:  # runs on the engine's callback thread
            loop.call_soon_threadsafe(settle, status)

        return fut, on_done

    async def write(self, *, len: int, src: MrHandle, dst: Dst, src_offset: int = 0,
                    dst_offset: int = 0, imm: Optional[int] = None, nic: Optional[int] = None,
                    num_shards: Optional[int] = None) -> None:
        """submit_single_write, awaited until every WRITE completed locally."""
        fut, on_done = self._future()
        self.submit_single_write(len=len, src=src, src_offset=src_offset, dst=dst,
                                 dst_offset=dst_offset, on_done=on_done, imm=imm, nic=nic,
                                 num_shards=num_shards)
        await fut

    async def paged_write(self, *, page_len: int, src: MrHandle, src_pages: _Pages, dst: Dst,
                          dst_pages: _Pages, imm: Optional[int] = None,
                          nic: Optional[int] = None) -> None:
        """submit_paged_writes, awaited until every WRITE completed locally."""
        fut, on_done = self._future()
        self.submit_paged_writes(page_len=page_len, src=src, src_pages=src_pages, dst=dst,
                                 dst_pages=dst_pages, on_done=on_done, imm=imm, nic=nic)
        await fut

    async def scatter(self, *, src: MrHandle, slices: Iterable[ScatterSlice],
                      imm: Optional[int] = None, nic: Optional[int] = None) -> None:
        """submit_scatter, awaited until every WRITE completed locally."""
        fut, on_done = self._future()
        self.submit_scatter(src=src, slices=slices, on_done=on_done, imm=imm, nic=nic)
        await fut

    async def group_scatter(self, *, group: PeerGroupHandle, src: MrHandle,
                            slices: Iterable[GroupSlice], imm: Optional[int] = None,
                            nic: Optional[int] = None) -> None:
        """submit_group_scatter, awaited until every WRITE completed locally."""
        fut, on_done = self._future()
        self.submit_group_scatter(group=group, src=src, slices=slices, on_done=on_done, imm=imm,
                                  nic=nic)
        await fut

    async def barrier(self, *, dsts: Iterable[Dst], imm: int, nic: Optional[int] = None) -> None:
        """submit_barrier, awaited until every zero-byte WRITE completed locally."""
        fut, on_done = self._future()
        self.submit_barrier(dsts=dsts, imm=imm, on_done=on_done, nic=nic)
        await fut

    async def group_barrier(self, *, group: PeerGroupHandle, imm: int,
                            nic: Optional[int] = None) -> None:
        """submit_group_barrier, awaited until every zero-byte WRITE completed locally."""
        fut, on_done = self._future()
        self.submit_group_barrier(group=group, imm=imm, on_done=on_done, nic=nic)
        await fut

    async def send(self, dst: NetAddr, data: bytes) -> None:
        """submit_send, awaited until the message completed locally."""
        fut, on_done = self._future()
        self.submit_send(dst, bytes(data), on_done)
        await fut

    async def imm_count_reached(self, imm: int, count: int,
                                timeout_s: Optional[float] = None) -> None:
        """Awaits until immediate `imm` has been received `count` times (early arrivals count);
        with timeout_s, raises FabricTimeoutError if that does not happen in time. Cancelling the
        await (task.cancel(), asyncio.wait_for) cancels the expectation too: what it had seen
        stays counted for the next expectation of `imm`, and nothing later is consumed by it."""
        fut, on_done = self._future()
        expectation = self.expect_imm_count(imm, count, on_done, timeout_s=timeout_s)
        try:
            await fut
        except asyncio.CancelledError:
            if not self.closed:
                self.cancel_imm_expectation(expectation)
            raise



# Engines still open when the interpreter exits are closed by the hook below.
_live_engines: "weakref.WeakSet[TransferEngine]" = weakref.WeakSet()


def _close_engines_at_exit() -> None:
    """Closes every engine left open, before CPython finalizes (atexit hooks run first) and frees
    the memory they registered. An engine thread that takes the GIL during finalization is ended
    by pthread_exit, which aborts the process (issue 28), so first the engines' threads stop
    entering Python (_begin_exit returns once the calls under way ended): callbacks still due are
    dropped, as no code is left to wait for them."""
    _c._begin_exit()
    for engine in list(_live_engines):
        engine.close()


atexit.register(_close_engines_at_exit)
