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
  Decoder.wait_paired() returns once an admit can be begun; a request the prefill side refuses
  anyway (Prefiller.begin) is told to the decode ranks, whose request ends at once with the cause.

Ids: a request id is unique among the decode rank's requests in flight (24 bits are used). A
request that failed retires its id for late_writes_s; retry it under a new id.
"""

from __future__ import annotations

import logging
import queue
import struct
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from . import _fabric_lib as _c
from ._fabric_lib import KV_EXTRAS_LAYER, KV_MAX_LAYERS, KvLayout, PageOrder, kv_layer_imm, kv_read_admit

__all__ = [
    "KV_EXTRAS_LAYER", "KV_MAX_LAYERS", "KvLayout", "PageOrder", "KvReceiver", "KvSender", "Decoder",
    "Prefiller", "PrefillRequest", "make_layout", "kv_layer_imm",
]

log = logging.getLogger(__name__)

# Engine messages between the roles, a kind byte first:
_ADMIT = b"Q"   # decode rank 0 -> prefill ranks: u16 n, its address (n bytes), the admit message
_CANCEL = b"C"  # decode rank 0 -> prefill ranks: u64 request: the decode side failed it, stop sending
_REFUSE = b"R"  # prefill rank -> decode ranks: u64 decode group, u64 request, the cause (UTF-8)
_MESSAGE_BYTES = 16384  # an admit message is ~35 bytes + 4 per page + an address: up to ~4,000 pages
_REASON_BYTES = 2048  # a refusal's cause is cut there


class _Inbox:
    """The KV roles' messages on one engine: one set of receive buffers, each message handed to
    the handlers of its kind. Shared, because an engine gives a message to any of its receive
    buffers: a Prefiller and a Decoder on one engine must not take each other's messages."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._handlers: dict[bytes, list[Callable[[bytes], Any]]] = {}
        self.buffers = 0

    def on_message(self, msg: bytes) -> None:  # the engine's callback thread
        with self._lock:
            handlers = list(self._handlers.get(msg[:1], ()))
        for handler in handlers:
            try:
                handler(msg[1:])
            except Exception:  # noqa: BLE001 - a malformed message must not stop the others
                log.exception("fabric_lib.kv: a %r message could not be handled", msg[:1])

    def add(self, kind: bytes, handler: Callable[[bytes], Any]) -> None:
        with self._lock:
            self._handlers.setdefault(kind, []).append(handler)

    def remove(self, kind: bytes, handler: Callable[[bytes], Any]) -> None:
        with self._lock:
            if handler in self._handlers.get(kind, []):
                self._handlers[kind].remove(handler)


_inboxes: "weakref.WeakKeyDictionary[Any, _Inbox]" = weakref.WeakKeyDictionary()
_inboxes_lock = threading.Lock()


def _inbox(engine: Any, buffers: int) -> _Inbox:
    """The engine's inbox, with at least `buffers` receive buffers posted."""
    with _inboxes_lock:
        box = _inboxes.setdefault(engine, _Inbox())
        if box.buffers < buffers:  # a second pool with the same handler: any buffer will do
            engine.submit_recvs(_MESSAGE_BYTES, buffers - box.buffers, box.on_message)
            box.buffers = buffers
        return box


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
        self.late_writes_s = late_writes_s

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

    def fail(self, request: int, reason: str) -> bool:
        """Ends a request in flight now: its on_done gets a cancelled status with `reason` (its
        prefill side refused it: nothing will land). False when unknown or already ended."""
        return self._rx.fail(request, reason)

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


def _describe(what: str, group: int, ranks: dict[int, tuple[int, bytes, bytes]]) -> str:
    """What the directory holds of a group, for an error: 'decode group 11 has ranks [0] of 2 in
    the directory'."""
    if not ranks:
        return f"{what} group {group} is not in the directory"
    sizes = sorted({v[0] for v in ranks.values()})
    if len(sizes) > 1:
        return f"{what} group {group}'s ranks in the directory disagree on its TP size ({sizes})"
    return f"{what} group {group} has ranks {sorted(ranks)} of {sizes[0]} in the directory"


def _wait(ready: Callable[[], Optional[str]], timeout_s: float, what: str) -> None:
    """Polls ready() (None once ready, else what is missing) until timeout_s; then
    FabricTimeoutError (a TimeoutError, as every timeout of the library)."""
    deadline = time.monotonic() + timeout_s
    delay = 0.01
    while True:
        missing = ready()
        if missing is None:
            return
        left = deadline - time.monotonic()
        if left <= 0:
            raise _c.FabricTimeoutError(f"timeout: {what}: not paired after {timeout_s:g} s: {missing}")
        time.sleep(min(delay, left))  # membership changes in ms to s: back off to 0.1 s polls
        delay = min(2 * delay, 0.1)


class Decoder:
    """A decode rank in a directory. Rank 0 of the decode group sends each request's admit
    message to the prefill group it picks; every rank admits the same requests. A prefill rank
    that refuses a request says so, and the request ends at once with its cause."""

    def __init__(self, engine: Any, receiver: KvReceiver, directory: Any, *,
                 cluster: str = "default", recv_buffers: int = 16) -> None:
        self.engine, self.receiver, self.directory, self.cluster = engine, receiver, directory, cluster
        self._key = _decode_key(cluster, receiver.group, receiver.tp_rank)
        self._address = engine.main_address().to_bytes()
        # Refusals of requests this rank has not admitted yet (rank 0 admits first and the prefill
        # side may answer before the other ranks admit): request -> (expiry, cause).
        self._early: dict[int, tuple[float, str]] = {}
        self._lock = threading.Lock()
        self._inbox = _inbox(engine, recv_buffers)
        self._inbox.add(_REFUSE, self._on_refuse)  # before the entry: a prefill rank may answer at once
        directory.register(self._key, _pack(receiver.tp_size, self._address, receiver.descriptor()))

    def _on_refuse(self, body: bytes) -> None:  # the engine's callback thread
        group, request = struct.unpack_from("<QQ", body)
        if group != self.receiver.group:
            return  # another decode group's rank on this engine
        cause = body[16:].decode(errors="replace")
        if self.receiver.fail(request, cause):
            return
        # Not admitted here yet (or ended already): the next admit of it ends at once. Kept for
        # late_writes_s, the time a failed id stays retired on rank 0.
        now = time.monotonic()
        with self._lock:
            self._early = {r: e for r, e in self._early.items() if e[0] > now}
            self._early[request] = (now + self.receiver.late_writes_s, cause)
        if self.receiver.fail(request, cause):  # it was admitted between the two calls
            with self._lock:
                self._early.pop(request, None)

    def prefill_groups(self) -> dict[int, list[Any]]:
        """Prefill groups with every rank present: {group: [NetAddr of rank 0, 1, ...]}."""
        groups = _groups(self.directory.list(f"kv/{self.cluster}/prefill/"))
        return {g: [_c.NetAddr.from_bytes(r[i][1]) for i in range(len(r))]
                for g, r in groups.items() if _complete(r)}

    def wait_paired(self, prefill_group: int, *, timeout_s: float = 30.0) -> None:
        """Returns once requests can be admitted for `prefill_group`: every rank of it and of
        this rank's own decode group is in the directory (a prefill rank adds a decode group it
        has not added yet when that group's first request comes, see Prefiller.begin). Raises
        FabricTimeoutError (a TimeoutError) naming what is missing after timeout_s."""
        def missing() -> Optional[str]:
            prefill = _groups(self.directory.list(f"kv/{self.cluster}/prefill/")).get(prefill_group, {})
            if not _complete(prefill):
                return _describe("prefill", prefill_group, prefill)
            own = _groups(self.directory.list(f"kv/{self.cluster}/decode/")).get(self.receiver.group, {})
            if not _complete(own):
                return _describe("this rank's decode", self.receiver.group, own)
            return None

        _wait(missing, timeout_s, f"Decoder.wait_paired(prefill_group={prefill_group}), cluster "
                                  f"{self.cluster!r}")

    def admit(self, request: int, pages: Sequence[int], *, prefill_group: int,
              extra_slot: Optional[int] = None, timeout_s: float = 30.0,
              on_layer: Optional[Callable[[int], Any]] = None, landed: Any = None,
              on_done: Optional[Callable[[Any], Any]] = None) -> None:
        """Admits a request into `pages` for prefill group `prefill_group` (from prefill_groups).
        on_done(status) (a callable, on the callback thread) fires once every layer and the extras
        landed, or on the first error: a timeout names the layer, a prefill rank's refusal its
        cause (at once). The pages are the caller's again either way. On an error rank 0 also
        tells the prefill ranks to stop sending it."""
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
        with self._lock:
            early = self._early.pop(request, None)
        if early is not None and early[0] > time.monotonic():
            self.receiver.fail(request, early[1])  # refused before this rank admitted it
            return
        if self.receiver.tp_rank == 0:
            envelope = _ADMIT + struct.pack("<H", len(self._address)) + self._address
            for addr in ranks:
                self.engine.submit_send(addr, envelope + msg, None)

    def close(self) -> None:
        self._inbox.remove(_REFUSE, self._on_refuse)
        self.directory.unregister(self._key)


@dataclass
class PrefillRequest:
    """A request a decode group admitted: its id, the number of pages, and the admit message."""
    request: int
    decode_group: int
    pages: int
    extra_slot: Optional[int]
    admit: bytes
    reply: bytes = field(default=b"", repr=False)  # the admitting decode rank's address: refusals go there


class Prefiller:
    """A prefill rank in a directory: receives admit messages, tracks the decode groups."""

    def __init__(self, engine: Any, sender: KvSender, directory: Any, *, cluster: str = "default",
                 recv_buffers: int = 64) -> None:
        self.engine, self.sender, self.directory, self.cluster = engine, sender, directory, cluster
        self._requests: "queue.Queue[PrefillRequest]" = queue.Queue()
        self._decoders: dict[int, dict[int, bytes]] = {}  # group -> rank -> descriptor added
        # The last directory view (group -> rank -> entry), and the groups that could not be added
        # (group -> (their descriptors, why)): not tried again until an entry changes.
        self._seen: dict[int, dict[int, tuple[int, bytes, bytes]]] = {}
        self._unusable: dict[int, tuple[dict[int, bytes], str]] = {}
        # The three above; reentrant: remove_decoder fires on_sent callbacks on this thread, and
        # one may call begin.
        self._lock = threading.RLock()
        # One refresh at a time: a view listed earlier must not undo what a later one added.
        self._refreshing = threading.Lock()
        self._watch: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._inbox = _inbox(engine, recv_buffers)
        self._inbox.add(_ADMIT, self._on_admit)
        self._inbox.add(_CANCEL, self._on_cancel)
        self._key = _prefill_key(cluster, sender.group, sender.tp_rank)
        directory.register(self._key, _pack(sender.tp_size, engine.main_address().to_bytes()))

    def _on_admit(self, body: bytes) -> None:  # the engine's callback thread
        (n,) = struct.unpack_from("<H", body)
        reply, admit = body[2:2 + n], body[2 + n:]
        group, request, _, extra_slot, pages = kv_read_admit(admit)
        self._requests.put(PrefillRequest(request, group, len(pages), extra_slot, admit, reply))

    def _on_cancel(self, body: bytes) -> None:
        if len(body) == 8:
            self.sender.cancel(struct.unpack("<Q", body)[0])

    def refresh(self) -> tuple[list[int], list[int]]:
        """Adds decode groups that are complete in the directory and removes those with a rank
        gone (their requests in flight end cancelled). Returns (added, removed) group ids. A
        group that cannot be added (its layout does not match this rank's, say) is skipped, and
        named by begin's refusal of its requests."""
        with self._refreshing:
            groups = _groups(self.directory.list(f"kv/{self.cluster}/decode/"))
            added, removed = [], []
            with self._lock:
                self._seen = groups
                for g in list(self._decoders):
                    seen = groups.get(g, {})
                    if any(seen.get(r, (0, b"", b""))[2] != d for r, d in self._decoders[g].items()):
                        self.sender.remove_decoder(g)  # a rank left or restarted
                        del self._decoders[g]
                        removed.append(g)
                for g, ranks in groups.items():
                    descriptors = {r: v[2] for r, v in ranks.items()}
                    if g in self._decoders or not _complete(ranks):
                        continue
                    if g in self._unusable and self._unusable[g][0] == descriptors:
                        continue
                    try:
                        for r in sorted(ranks):
                            self.sender.add_decoder(ranks[r][2])
                    except Exception as e:  # noqa: BLE001 - this group only; the others are added
                        self.sender.remove_decoder(g)  # the ranks added before the one refused
                        self._unusable[g] = (descriptors, f"decode group {g} could not be added: {e}")
                        continue
                    self._unusable.pop(g, None)
                    self._decoders[g] = descriptors
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

    def wait_paired(self, decode_group: Optional[int] = None, *, timeout_s: float = 30.0) -> list[int]:
        """Refreshes until decode group `decode_group` (None: any decode group) is added; returns
        the decode groups added. Raises FabricTimeoutError (a TimeoutError) naming what is
        missing after timeout_s."""
        def missing() -> Optional[str]:
            self.refresh()
            with self._lock:
                if decode_group is None:
                    return None if self._decoders else "no decode group is complete in the directory"
                return None if decode_group in self._decoders else self._why_not(decode_group)

        _wait(missing, timeout_s, f"Prefiller.wait_paired(decode_group={decode_group}), cluster "
                                  f"{self.cluster!r}")
        with self._lock:
            return sorted(self._decoders)

    def next_request(self, timeout: Optional[float] = None) -> Optional[PrefillRequest]:
        """The next admitted request, or None after timeout seconds."""
        try:
            return self._requests.get(timeout=timeout)
        except queue.Empty:
            return None

    def begin(self, req: PrefillRequest, src_pages: Sequence[int], *,
              extra_slot: Optional[int] = None, on_sent: Any = None) -> None:
        """KvSender.begin for an admitted request. A decode group not added yet (its rank admitted
        before this rank's watch saw it) is looked up in the directory once more first. A request
        refused all the same (its group incomplete or unusable, or begin's own error) is told to
        its decode ranks, whose request ends at once with the cause, and raised here."""
        looking_up = False
        try:
            with self._lock:
                looking_up = req.decode_group not in self._decoders
            if looking_up:
                self.refresh()
                looking_up = False
            self.sender.begin(req.admit, src_pages, extra_slot=extra_slot, on_sent=on_sent)
        except Exception as e:
            with self._lock:
                if looking_up:
                    cause = f"decode group {req.decode_group} could not be looked up: {e}"
                elif req.decode_group not in self._decoders:  # what the directory shows, then begin's words
                    cause = f"{self._why_not(req.decode_group)} ({e})"
                else:
                    cause = str(e)
            reason = f"prefill group {self.sender.group} rank {self.sender.tp_rank} refused it: {cause}"
            self._refuse(req, reason)
            if hasattr(e, "add_note"):  # Python 3.11+
                e.add_note(reason)
            raise

    def _why_not(self, group: int) -> str:
        """Why decode group `group` is not added (caller holds _lock)."""
        if group in self._unusable:
            return self._unusable[group][1]
        return _describe("decode", group, self._seen.get(group, {}))

    def _refuse(self, req: PrefillRequest, reason: str) -> None:
        """Tells the decode ranks of `req` that this rank refused it (best effort: the admitting
        rank, and every rank of its group in the directory)."""
        with self._lock:
            ranks = self._seen.get(req.decode_group, {})
            targets = {req.reply} | {v[1] for v in ranks.values()}
        msg = (_REFUSE + struct.pack("<QQ", req.decode_group, req.request)
               + reason.encode()[:_REASON_BYTES])
        for addr in targets - {b""}:
            try:
                self.engine.submit_send(_c.NetAddr.from_bytes(addr), msg, None)
            except Exception:  # noqa: BLE001 - a decode rank gone has nobody to tell
                log.warning("fabric_lib.kv: could not tell a decode rank of group %d that request %d "
                            "was refused", req.decode_group, req.request, exc_info=True)

    def close(self) -> None:
        self._stop.set()
        if self._watch:
            self._watch.join(timeout=5)
        self._inbox.remove(_ADMIT, self._on_admit)
        self._inbox.remove(_CANCEL, self._on_cancel)
        self.directory.unregister(self._key)
