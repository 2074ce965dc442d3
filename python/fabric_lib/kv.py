"""KV-cache transfer between prefill and decode instances (disaggregated serving).

A prefill rank writes each layer of a prompt's KV cache into the decode ranks' pages the moment
the layer is computed; decode ranks count each layer's immediates and complete the request when
every layer (and the extras: last-token hidden state, logits) has landed. Prefill and decode
tensor parallelism may differ. The C++ core is include/fabric/kv/transfer.h; this module adds
tensors and membership:

- KvReceiver / KvSender: one rank's cache (per layer a K and a V tensor, torch or numpy, host or
  CUDA) and its endpoint. Memory is registered once.
- Decoder / Prefiller: a rank that announces itself in a Directory (directory.py: etcd with
  leases, or a torch TCPStore), finds the other side there, and carries the one admit message per
  request over engine messages. Instances come and go: Prefiller.refresh() adds decode groups that
  appeared and removes those whose entries expired (their peers and regions go with them).

Ids: a request id is unique among the decode rank's requests in flight (24 bits are used). A
request that failed retires its id for late_writes_s; retry it under a new id.
"""

from __future__ import annotations

import queue
import struct
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from . import _fabric_lib as _c
from ._fabric_lib import KV_EXTRAS_LAYER, KV_MAX_LAYERS, KvLayout, PageOrder, kv_layer_imm, kv_read_admit

__all__ = [
    "KV_EXTRAS_LAYER", "KV_MAX_LAYERS", "KvLayout", "PageOrder", "KvReceiver", "KvSender", "Decoder",
    "Prefiller", "PrefillRequest", "make_layout", "kv_layer_imm",
]

# Engine messages between the roles: a request's admit message, or the decode side's word that a
# request failed (the prefill ranks stop sending it).
_ADMIT = b"Q"
_CANCEL = b"C"
_MESSAGE_BYTES = 16384  # an admit message is 35 bytes + 4 per page: up to ~4,000 pages


def make_layout(*, num_layers: int, num_pages: int, page_tokens: int, kv_heads: int, head_dim: int,
                dtype_bytes: int = 2, order: PageOrder = PageOrder.TOKEN_MAJOR,
                interleaved: bool = False) -> KvLayout:
    """A KvLayout; interleaved: K and V of a page next to each other ([pages, 2, ...])."""
    l = KvLayout()
    l.num_layers, l.num_pages, l.page_tokens = num_layers, num_pages, page_tokens
    l.kv_heads, l.head_dim, l.dtype_bytes, l.order = kv_heads, head_dim, dtype_bytes, order
    l.page_stride = 2 * l.page_bytes if interleaved else 0
    return l


def _addresses(tensors: Sequence[Any], what: str) -> tuple[list[int], Optional[int]]:
    from . import _buffer_address  # late: __init__ imports this module

    ptrs, devices = [], set()
    for t in tensors:
        ptr, _, dev = _buffer_address(t)
        ptrs.append(ptr)
        devices.add(dev)
    if len(devices) > 1:
        raise ValueError(f"{what}: every tensor must be on one device, got {sorted(map(str, devices))}")
    return ptrs, (devices.pop() if devices else None)


class _Endpoint:
    """The tensors of one rank, kept referenced for the endpoint's life."""

    def __init__(self, engine: Any, layout: KvLayout, k: Sequence[Any], v: Sequence[Any], *,
                 group: int, tp_size: int, tp_rank: int, total_heads: int, extras: Any = None,
                 extra_slots: int = 0) -> None:
        k_ptrs, dev_k = _addresses(k, "k")
        v_ptrs, dev_v = _addresses(v, "v")
        if dev_k != dev_v:
            raise ValueError("k and v must be on the same device")
        extras_ptr, extra_bytes = 0, 0
        if extras is not None:
            from . import _buffer_address

            extras_ptr, nbytes, dev_x = _buffer_address(extras)
            if dev_x != dev_k:
                raise ValueError("extras must be on the device of k and v")
            if extra_slots <= 0 or nbytes % extra_slots:
                raise ValueError(f"extras of {nbytes} bytes do not split into {extra_slots} slots")
            extra_bytes = nbytes // extra_slots
        self._keep = (list(k), list(v), extras)
        self.engine = engine
        self.layout = layout
        self.group, self.tp_size, self.tp_rank, self.total_heads = group, tp_size, tp_rank, total_heads
        self._args = dict(group=group, tp_size=tp_size, tp_rank=tp_rank, total_heads=total_heads,
                          cuda_device=dev_k, extras=extras_ptr,
                          extra_slots=extra_slots if extras is not None else 0, extra_bytes=extra_bytes)
        self._k, self._v = k_ptrs, v_ptrs


class KvReceiver(_Endpoint):
    """A decode rank's cache. k[i], v[i]: layer i's K and V tensors (V may be K + one page, for
    interleaved layouts); extras: a buffer of extra_slots equal slots (or None)."""

    def __init__(self, engine: Any, layout: KvLayout, k: Sequence[Any], v: Sequence[Any], *,
                 group: int, tp_size: int = 1, tp_rank: int = 0, total_heads: int,
                 extras: Any = None, extra_slots: int = 0, late_writes_s: float = 60.0,
                 imm_base: Optional[int] = None) -> None:
        super().__init__(engine, layout, k, v, group=group, tp_size=tp_size, tp_rank=tp_rank,
                         total_heads=total_heads, extras=extras, extra_slots=extra_slots)
        self._rx = _c.KvReceiver(engine, layout, self._k, self._v, late_writes_s=late_writes_s,
                                 imm_base=imm_base, **self._args)

    def descriptor(self) -> bytes:
        return self._rx.descriptor()

    def admit(self, request: int, pages: Sequence[int], *, prefill_size: int = 1,
              extra_slot: Optional[int] = None, timeout_s: float = 30.0,
              on_layer: Optional[Callable[[int], Any]] = None, landed: Any = None,
              on_done: Any = None) -> bytes:
        """Arms the request; returns its admit message. landed: a GpuCounter counting layers
        (and the extras) landed, for decode kernels."""
        return self._rx.admit(request=request, pages=list(pages), prefill_size=prefill_size,
                              extra_slot=extra_slot, timeout_s=timeout_s, on_layer=on_layer,
                              landed=landed, on_done=on_done)

    @property
    def in_flight(self) -> int:
        return self._rx.in_flight

    def close(self) -> None:
        self._rx.close()


class KvSender(_Endpoint):
    """A prefill rank's cache (as KvReceiver) and the writes of its requests."""

    def __init__(self, engine: Any, layout: KvLayout, k: Sequence[Any], v: Sequence[Any], *,
                 group: int, tp_size: int = 1, tp_rank: int = 0, total_heads: int,
                 extras: Any = None, extra_slots: int = 0) -> None:
        super().__init__(engine, layout, k, v, group=group, tp_size=tp_size, tp_rank=tp_rank,
                         total_heads=total_heads, extras=extras, extra_slots=extra_slots)
        self._tx = _c.KvSender(engine, layout, self._k, self._v, **self._args)

    def add_decoder(self, descriptor: bytes) -> None:
        self._tx.add_decoder(descriptor)

    def remove_decoder(self, group: int) -> bool:
        return self._tx.remove_decoder(group)

    def begin(self, admit: bytes, src_pages: Sequence[int], *, extra_slot: Optional[int] = None,
              on_sent: Any = None) -> None:
        self._tx.begin(admit, list(src_pages), extra_slot=extra_slot, on_sent=on_sent)

    def layer_done(self, request: int, layer: int) -> None:
        self._tx.layer_done(request, layer)

    def extras_done(self, request: int) -> None:
        self._tx.extras_done(request)

    def cancel(self, request: int) -> bool:
        return self._tx.cancel(request)

    def gpu_trigger(self) -> Any:
        """The UvmWatcher whose word the prefill kernels increment after each layer and after the
        extras (CUDA builds, engines with cuda_device)."""
        return self._tx.gpu_trigger()

    def begin_forward(self, requests: Sequence[int]) -> None:
        self._tx.begin_forward(list(requests))

    def trigger_reached(self, value: int) -> None:
        self._tx.trigger_reached(value)

    @property
    def in_flight(self) -> int:
        return self._tx.in_flight

    def close(self) -> None:
        self._tx.close()


# ---- membership ----

def _decode_key(cluster: str, group: int, rank: int) -> str:
    return f"kv/{cluster}/decode/{group}/{rank}"


def _prefill_key(cluster: str, group: int, rank: int) -> str:
    return f"kv/{cluster}/prefill/{group}/{rank}"


def _pack(tp_size: int, addr: bytes, tail: bytes = b"") -> bytes:
    return struct.pack("<II", tp_size, len(addr)) + addr + tail


def _unpack(value: bytes) -> tuple[int, bytes, bytes]:
    tp_size, n = struct.unpack_from("<II", value)
    return tp_size, value[8:8 + n], value[8 + n:]


def _groups(entries: dict[str, bytes]) -> dict[int, dict[int, tuple[int, bytes, bytes]]]:
    """{group: {rank: (tp_size, addr, tail)}} of directory entries ".../<group>/<rank>"."""
    out: dict[int, dict[int, tuple[int, bytes, bytes]]] = {}
    for key, value in entries.items():
        try:
            group, rank = (int(x) for x in key.rsplit("/", 2)[-2:])
            out.setdefault(group, {})[rank] = _unpack(value)
        except (ValueError, struct.error):
            continue  # not ours, or torn: skipped, as an instance not yet there
    return out


def _complete(ranks: dict[int, tuple[int, bytes, bytes]]) -> bool:
    sizes = {v[0] for v in ranks.values()}
    return len(sizes) == 1 and sorted(ranks) == list(range(sizes.pop()))


class Decoder:
    """A decode rank in a directory. Rank 0 of the decode group sends each request's admit
    message to the prefill group it picks; every rank admits the same requests."""

    def __init__(self, engine: Any, receiver: KvReceiver, directory: Any, *,
                 cluster: str = "default") -> None:
        self.engine, self.receiver, self.directory, self.cluster = engine, receiver, directory, cluster
        self._key = _decode_key(cluster, receiver.group, receiver.tp_rank)
        directory.register(self._key, _pack(receiver.tp_size, engine.main_address().to_bytes(),
                                            receiver.descriptor()))

    def prefill_groups(self) -> dict[int, list[Any]]:
        """Prefill groups with every rank present: {group: [NetAddr of rank 0, 1, ...]}."""
        groups = _groups(self.directory.list(f"kv/{self.cluster}/prefill/"))
        return {g: [_c.NetAddr.from_bytes(r[i][1]) for i in range(len(r))]
                for g, r in groups.items() if _complete(r)}

    def admit(self, request: int, pages: Sequence[int], *, prefill_group: int,
              extra_slot: Optional[int] = None, timeout_s: float = 30.0,
              on_layer: Optional[Callable[[int], Any]] = None, landed: Any = None,
              on_done: Optional[Callable[[Any], Any]] = None) -> None:
        """Admits a request into `pages` for prefill group `prefill_group` (from prefill_groups).
        on_done(status) (a callable, on the callback thread) fires once every layer and the extras
        landed, or on the first error (a timeout names the layer): the pages are the caller's
        again either way. On an error rank 0 also tells the prefill ranks to stop sending it."""
        ranks = self.prefill_groups().get(prefill_group)
        if ranks is None:
            raise KeyError(f"prefill group {prefill_group} is not (completely) in the directory")
        def done(status: Any) -> None:
            if not status.ok and self.receiver.tp_rank == 0:
                for addr in ranks:  # best effort: the prefill ranks stop sending it
                    try:
                        self.engine.submit_send(addr, _CANCEL + struct.pack("<Q", request), None)
                    except Exception:  # noqa: BLE001 - a prefiller gone is fine here
                        pass
            if callable(on_done):
                on_done(status)

        msg = self.receiver.admit(request, pages, prefill_size=len(ranks), extra_slot=extra_slot,
                                  timeout_s=timeout_s, on_layer=on_layer, landed=landed,
                                  on_done=done)
        if self.receiver.tp_rank == 0:
            for addr in ranks:
                self.engine.submit_send(addr, _ADMIT + msg, None)

    def close(self) -> None:
        self.directory.unregister(self._key)


@dataclass
class PrefillRequest:
    """A request a decode group admitted: its id, the number of pages, and the admit message."""
    request: int
    decode_group: int
    pages: int
    extra_slot: Optional[int]
    admit: bytes


class Prefiller:
    """A prefill rank in a directory: receives admit messages, tracks the decode groups."""

    def __init__(self, engine: Any, sender: KvSender, directory: Any, *, cluster: str = "default",
                 recv_buffers: int = 64) -> None:
        self.engine, self.sender, self.directory, self.cluster = engine, sender, directory, cluster
        self._requests: "queue.Queue[PrefillRequest]" = queue.Queue()
        self._decoders: dict[int, dict[int, bytes]] = {}  # group -> rank -> descriptor added
        self._lock = threading.Lock()
        self._watch: Optional[threading.Thread] = None
        self._stop = threading.Event()
        engine.submit_recvs(_MESSAGE_BYTES, recv_buffers, self._on_message)
        self._key = _prefill_key(cluster, sender.group, sender.tp_rank)
        directory.register(self._key, _pack(sender.tp_size, engine.main_address().to_bytes()))

    def _on_message(self, msg: bytes) -> None:  # the engine's callback thread
        kind, body = msg[:1], msg[1:]
        if kind == _ADMIT:
            group, request, _, extra_slot, pages = kv_read_admit(body)
            self._requests.put(PrefillRequest(request, group, len(pages), extra_slot, body))
        elif kind == _CANCEL and len(body) == 8:
            self.sender.cancel(struct.unpack("<Q", body)[0])

    def refresh(self) -> tuple[list[int], list[int]]:
        """Adds decode groups that are complete in the directory and removes those with a rank
        gone (their requests in flight end cancelled). Returns (added, removed) group ids."""
        groups = _groups(self.directory.list(f"kv/{self.cluster}/decode/"))
        added, removed = [], []
        with self._lock:
            for g in list(self._decoders):
                seen = groups.get(g, {})
                if any(seen.get(r, (0, b"", b""))[2] != d for r, d in self._decoders[g].items()):
                    self.sender.remove_decoder(g)  # a rank left or restarted
                    del self._decoders[g]
                    removed.append(g)
            for g, ranks in groups.items():
                if g in self._decoders or not _complete(ranks):
                    continue
                for r in sorted(ranks):
                    self.sender.add_decoder(ranks[r][2])
                self._decoders[g] = {r: v[2] for r, v in ranks.items()}
                added.append(g)
        return added, removed

    def watch(self, interval_s: float = 0.5) -> None:
        """refresh() every interval_s on a daemon thread, until close()."""

        def loop() -> None:
            while not self._stop.wait(interval_s):
                try:
                    self.refresh()
                except Exception:  # noqa: BLE001 - a directory hiccup: try again next round
                    pass

        self._watch = threading.Thread(target=loop, name="kv-prefiller-watch", daemon=True)
        self._watch.start()

    def next_request(self, timeout: Optional[float] = None) -> Optional[PrefillRequest]:
        """The next admitted request, or None after timeout seconds."""
        try:
            return self._requests.get(timeout=timeout)
        except queue.Empty:
            return None

    def begin(self, req: PrefillRequest, src_pages: Sequence[int], *,
              extra_slot: Optional[int] = None, on_sent: Any = None) -> None:
        self.sender.begin(req.admit, src_pages, extra_slot=extra_slot, on_sent=on_sent)

    def close(self) -> None:
        self._stop.set()
        if self._watch:
            self._watch.join(timeout=5)
        self.directory.unregister(self._key)
