"""Membership and discovery for instances that come and go (KV-cache prefill and decode ranks).

An instance announces itself with ``register(key, value)`` (value: for example its serialized fabric
address), peers find it with ``list(prefix)``, and the entry goes away when the instance calls
``unregister``/``close`` or, if it dies without doing so, about ``ttl_s`` seconds after it stopped
refreshing the entry. Two backends:

* ``EtcdDirectory``: etcd v3 through its JSON gateway over plain HTTP (etcd 3.4 and later serve it
  at ``/v3/...``). Entries are put under one etcd lease per directory object, kept alive by a
  background thread; etcd itself drops the entries once the lease expires.
* ``StoreDirectory``: any ``torch.distributed.Store``-like object (``TCPStore``, ``FileStore``,
  ``PrefixStore`` ...). Stores have no leases, so each entry carries a heartbeat timestamp that a
  background thread refreshes, and readers skip entries whose heartbeat is too old.

Only the standard library is used; torch is never imported here (the store is duck-typed).
"""

from __future__ import annotations

import base64
import json
import logging
import math
import threading
import time
import urllib.error
import urllib.request

__all__ = ["Directory", "EtcdDirectory", "StoreDirectory", "DirectoryError"]

log = logging.getLogger(__name__)

# Every HTTP request is bounded: a hung or unreachable etcd must not hang the caller.
HTTP_TIMEOUT_S = 5.0


class DirectoryError(RuntimeError):
    """A directory backend call failed (etcd unreachable, HTTP error, store error)."""


class Directory:
    """Base class: a set of live ``key -> value`` entries shared between processes.

    ``register(key, value)`` announces an entry; it stays visible while this object is open (a
    background thread keeps it alive), and disappears on ``unregister(key)``, on ``close()``, or
    about ``ttl_s`` after this process stops refreshing it (crash, SIGKILL, lost network).
    Registering a key again replaces its value. ``list(prefix)`` returns the live entries whose key
    starts with ``prefix``. Keys are ``str``, values ``bytes``. Usable as a context manager
    (``__exit__`` calls ``close``). Subclasses implement the four methods.
    """

    def register(self, key: str, value: bytes) -> None:
        """Announce ``key -> value``; it stays while this process keeps it alive."""
        raise NotImplementedError

    def unregister(self, key: str) -> None:
        """Withdraw an entry this object registered (a no-op for keys it did not register)."""
        raise NotImplementedError

    def list(self, prefix: str) -> dict[str, bytes]:
        """Live entries (of every process) whose key starts with ``prefix``."""
        raise NotImplementedError

    def close(self) -> None:
        """Unregister everything this object registered and stop its threads. Idempotent."""
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check_value(key: str, value: bytes) -> bytes:
    if not isinstance(key, str):
        raise TypeError(f"directory key must be str, not {type(key).__name__}")
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise TypeError(f"directory value must be bytes, not {type(value).__name__}")
    return bytes(value)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _prefix_end(prefix: bytes) -> bytes:
    """etcd's range_end for "every key starting with prefix": prefix with its last byte + 1
    (trailing 0xff bytes dropped first, since they cannot be incremented). b"\\0" means "to the end
    of the key space", which is what an empty or all-0xff prefix needs."""
    p = bytearray(prefix)
    while p and p[-1] == 0xFF:
        p.pop()
    if not p:
        return b"\0"
    p[-1] += 1
    return bytes(p)


class EtcdDirectory(Directory):
    """Directory over etcd v3's JSON gateway (``POST <endpoint>/v3/...``).

    One lease (TTL ``ttl_s``, rounded up to whole seconds as etcd wants) per object, granted on
    the first ``register``; every key is put under it. A daemon thread sends a keep-alive every
    ``ttl/3``; if the process dies, the keep-alives stop and etcd deletes the keys when the lease
    runs out. If the lease is ever lost while the process lives (etcd unreachable for longer than
    the TTL, etcd restarted), the thread grants a new one and puts the keys again.
    ``close()`` revokes the lease, which deletes all of this object's keys at once.

    Keys live in etcd under ``prefix + key``; ``list`` returns them without ``prefix``. etcd's rule
    for a key put by several processes applies: the last put wins, and an ``unregister`` deletes
    the key whoever put it last.
    """

    def __init__(self, endpoint: str = "http://127.0.0.1:2379", prefix: str = "/fabric/", ttl_s: float = 5.0):
        if ttl_s <= 0:
            raise ValueError("ttl_s must be positive")
        self.endpoint = endpoint.rstrip("/")
        self.prefix = prefix
        self.ttl_s = ttl_s
        self.request_timeout_s = HTTP_TIMEOUT_S  # per HTTP request; an attribute so tests can lower it
        self._lock = threading.Lock()  # guards _entries and _lease (keep-alive thread vs. callers)
        self._entries: dict[str, bytes] = {}  # what this object registered, to put again on a new lease
        self._lease: str | None = None  # etcd lease ID (a decimal string, as the gateway returns it)
        self._lease_ttl = 0  # seconds, as granted (etcd may raise it to its minimum TTL)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False

    # -- HTTP ---------------------------------------------------------------------------------

    def _call(self, path: str, body: dict) -> dict:
        """POST body as JSON to /v3/<path>; returns the decoded reply or raises DirectoryError."""
        url = f"{self.endpoint}/v3/{path}"
        req = urllib.request.Request(
            url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
        )
        try:
            with urllib.request.urlopen(req, timeout=self.request_timeout_s) as resp:
                text = resp.read().decode()
        except urllib.error.HTTPError as e:
            # The gateway puts gRPC's error text in a JSON body: {"error": ..., "message": ..., "code": n}.
            detail = e.read().decode(errors="replace").strip()
            raise DirectoryError(f"etcd {self.endpoint}: {path} failed: HTTP {e.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as e:  # refused, unresolvable, timed out
            reason = getattr(e, "reason", e)
            raise DirectoryError(f"etcd {self.endpoint}: {path} failed: {reason}") from None
        # A streaming call (lease/keepalive) answers with one JSON object per line; we send one
        # request, so the first line is our answer.
        line = text.strip().splitlines()[0] if text.strip() else "{}"
        try:
            reply = json.loads(line)
        except ValueError:
            raise DirectoryError(f"etcd {self.endpoint}: {path}: reply is not JSON: {line[:200]!r}") from None
        # Errors inside a streamed reply come with HTTP 200: {"error": {...}}.
        if isinstance(reply, dict) and "error" in reply:
            raise DirectoryError(f"etcd {self.endpoint}: {path} failed: {reply['error']}")
        return reply

    def _key(self, key: str) -> str:
        return _b64((self.prefix + key).encode())

    # -- lease --------------------------------------------------------------------------------

    def _grant_locked(self) -> None:
        """Grant a fresh lease and put every registered entry under it (caller holds _lock)."""
        reply = self._call("lease/grant", {"TTL": max(1, math.ceil(self.ttl_s))})
        if "ID" not in reply:
            raise DirectoryError(f"etcd {self.endpoint}: lease/grant: no lease ID in reply {reply}")
        self._lease = reply["ID"]  # int64 fields come back as JSON strings
        self._lease_ttl = int(reply.get("TTL", math.ceil(self.ttl_s)))
        for key, value in self._entries.items():
            self._put_locked(key, value)

    def _put_locked(self, key: str, value: bytes) -> None:
        self._call("kv/put", {"key": self._key(key), "value": _b64(value), "lease": self._lease})

    def _keepalive_loop(self) -> None:
        # Period ttl/3: two keep-alives can be lost before the lease runs out.
        period = max(0.1, min(self.ttl_s, self._lease_ttl or self.ttl_s) / 3)
        while not self._stop.wait(period):
            lease = self._lease
            try:
                reply = self._call("lease/keepalive", {"ID": lease})
                # For an unknown (expired, revoked) lease the gateway does not fail: it answers
                # {"result": {"ID": ...}} with no TTL, i.e. TTL 0.
                if int(reply.get("result", {}).get("TTL", 0)) > 0:
                    continue
                with self._lock:
                    if self._stop.is_set() or self._lease != lease:
                        continue
                    log.warning("etcd %s: lease %s was lost; granting a new one", self.endpoint, lease)
                    self._grant_locked()
            except DirectoryError as e:
                # etcd briefly unreachable: keep trying; the entries come back if the lease expired.
                log.warning("directory keep-alive: %s", e)

    # -- Directory ----------------------------------------------------------------------------

    def register(self, key: str, value: bytes) -> None:
        value = _check_value(key, value)
        with self._lock:
            if self._closed:
                raise DirectoryError("register on a closed EtcdDirectory")
            if self._lease is None:
                self._grant_locked()  # lazily: a list-only user never holds a lease
            self._put_locked(key, value)
            self._entries[key] = value
            if self._thread is None:
                self._thread = threading.Thread(target=self._keepalive_loop, name="etcd-keepalive", daemon=True)
                self._thread.start()

    def unregister(self, key: str) -> None:
        with self._lock:
            if self._entries.pop(key, None) is not None:
                self._call("kv/deleterange", {"key": self._key(key)})

    def list(self, prefix: str) -> dict[str, bytes]:
        start = (self.prefix + prefix).encode()
        reply = self._call("kv/range", {"key": _b64(start), "range_end": _b64(_prefix_end(start))})
        out = {}
        for kv in reply.get("kvs", []):  # absent, not [], when nothing matches
            key = base64.b64decode(kv["key"]).decode()
            out[key[len(self.prefix) :]] = base64.b64decode(kv.get("value", ""))  # empty values are omitted
        return out

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.request_timeout_s)
        with self._lock:
            lease, self._lease = self._lease, None
            self._entries.clear()
        if lease is not None:
            self._call("lease/revoke", {"ID": lease})  # deletes every key put under the lease


class StoreDirectory(Directory):
    """Directory over a ``torch.distributed.Store``-like object (``set/get/add/check``; ``multi_get``
    is used when present).

    Layout under ``prefix`` (all processes must use the same prefix and ttl):

    * ``prefix + "count"``: the number of slots ever allocated. ``store.add(count, 1)`` is atomic,
      so concurrent registrants in any number of processes each get a distinct slot number.
    * ``prefix + "slot/<n>"``: one entry, JSON ``{"k": key, "v": base64 value, "t": heartbeat,
      "live": bool}``. Only the process that allocated slot n writes it.

    ``register`` takes a slot (reusing one of this object's own freed slots if it has one) and
    writes the record; a daemon thread rewrites this object's records with a new ``time.time()``
    every ``ttl/3``. ``unregister``/``close`` overwrite the record with ``live: false``. Slot keys
    are never deleted, so a reader that saw a key with ``check`` can ``get`` it without blocking
    (``get`` on a missing key waits for the store's timeout). The cost: slots of dead processes
    stay behind (a few dozen bytes each) and ``list`` reads every slot ever allocated under the
    prefix, which is fine for the hundreds of instances a cluster churns through, not for millions.

    ``list`` returns entries that are live and whose heartbeat is younger than ``ttl_s``. This
    compares the writer's ``time.time()`` with the reader's, so it assumes the processes share a
    host or have synchronized clocks (NTP keeps skew far below a ttl of seconds); a writer whose
    clock is ahead by more than ``ttl_s`` survives its death by that much, one behind by more than
    ``ttl_s`` is never seen. If the same key is live in several slots (an instance restarted before
    its old entry aged out), the newest slot wins.
    """

    def __init__(self, store, ttl_s: float = 5.0, prefix: str = "fabric/"):
        if ttl_s <= 0:
            raise ValueError("ttl_s must be positive")
        self.store = store
        self.ttl_s = ttl_s
        self.prefix = prefix
        # One lock around this object's store calls: the heartbeat thread must not rewrite a
        # record as live after unregister marked it dead, and a store client need not be
        # thread-safe.
        self._lock = threading.Lock()
        self._slots: dict[str, int] = {}  # key -> slot this object writes it in
        self._values: dict[str, bytes] = {}
        self._free: list[int] = []  # own slots marked dead, reused before allocating new ones
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False

    def _op(self, what: str, fn, *args):
        """Run a store call, turning any store exception into DirectoryError."""
        try:
            return fn(*args)
        except Exception as e:
            raise DirectoryError(f"store {type(self.store).__name__} (prefix {self.prefix!r}): {what} failed: {e}") from e

    def _slot_key(self, n: int) -> str:
        return f"{self.prefix}slot/{n}"

    def _write_locked(self, key: str, live: bool) -> None:
        record = {"k": key, "t": time.time(), "live": live}
        if live:
            record["v"] = _b64(self._values[key])
        self._op("set", self.store.set, self._slot_key(self._slots[key]), json.dumps(record))

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):  # ttl/3: two beats can be late before expiry
            with self._lock:
                if self._stop.is_set():
                    return
                try:
                    for key in self._slots:
                        self._write_locked(key, live=True)
                except DirectoryError as e:
                    log.warning("directory heartbeat: %s", e)  # keep beating; the store may come back

    def register(self, key: str, value: bytes) -> None:
        value = _check_value(key, value)
        with self._lock:
            if self._closed:
                raise DirectoryError("register on a closed StoreDirectory")
            if key not in self._slots:
                if self._free:
                    self._slots[key] = self._free.pop()
                else:
                    self._slots[key] = int(self._op("add", self.store.add, self.prefix + "count", 1))
            self._values[key] = value
            self._write_locked(key, live=True)
            if self._thread is None:
                self._thread = threading.Thread(target=self._heartbeat_loop, name="store-heartbeat", daemon=True)
                self._thread.start()

    def unregister(self, key: str) -> None:
        with self._lock:
            if key in self._slots:
                self._write_locked(key, live=False)
                self._free.append(self._slots.pop(key))
                del self._values[key]

    def list(self, prefix: str) -> dict[str, bytes]:
        with self._lock:
            count = int(self._op("add", self.store.add, self.prefix + "count", 0))
            keys = [self._slot_key(n) for n in range(1, count + 1)]
            if keys and hasattr(self.store, "multi_get") and self._op("check", self.store.check, keys):
                raw = self._op("multi_get", self.store.multi_get, keys)  # one round trip
            else:
                # A slot counted but not written yet (its registrant is between add and set, or
                # died there) is skipped: get() on it would block for the store's timeout.
                raw = [self._op("get", self.store.get, k) if self._op("check", self.store.check, [k]) else None for k in keys]
        now = time.time()
        out = {}
        for data in raw:  # slot order: a later slot overrides an earlier one with the same key
            if data is None:
                continue
            try:
                record = json.loads(bytes(data))
            except ValueError:
                continue  # not ours: someone else wrote under our prefix
            key = record.get("k")
            if not isinstance(key, str) or not key.startswith(prefix):
                continue
            if record.get("live") and now - float(record.get("t", 0)) < self.ttl_s:
                out[key] = base64.b64decode(record["v"])
        return out

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        with self._lock:
            for key in list(self._slots):
                self._write_locked(key, live=False)
                self._free.append(self._slots.pop(key))
            self._values.clear()
