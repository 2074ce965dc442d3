"""fabric_lib.directory: EtcdDirectory against a private etcd (the etcd_endpoint fixture) and
StoreDirectory over torch.distributed.TCPStore. Every test runs on both backends where it makes sense.

directory.py is pure Python; it is loaded by path so these tests run without the compiled extension
(fabric_lib/__init__.py imports it)."""

import datetime
import importlib.util
import json
import os
import signal
import socket
import threading
import time
import urllib.request
import uuid

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "python", "fabric_lib", "directory.py")
_spec = importlib.util.spec_from_file_location("fabric_lib_directory", _PATH)
directory = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(directory)

TTL = 2.0  # short, so the expiry tests take seconds


def wait_until(pred, timeout):
    """Polls pred every 50 ms; True once it holds, False after timeout seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tcpstore_client(port):
    import torch.distributed as dist

    # A short store timeout: a get() that would block (a bug) fails in seconds, not the default 5 min.
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10))


# Children for the killed-process test (spawned: they import this module by name).
def etcd_child(conn, endpoint, prefix, key):
    d = directory.EtcdDirectory(endpoint, prefix=prefix, ttl_s=TTL)
    d.register(key, b"child")
    conn.send("registered")
    time.sleep(120)  # until SIGKILL


def store_child(conn, port, prefix, key):
    d = directory.StoreDirectory(_tcpstore_client(port), ttl_s=TTL, prefix=prefix)
    d.register(key, b"child")
    conn.send("registered")
    time.sleep(120)


class Backend:
    """make(**kw) opens a directory on a fresh connection; child is (fn, *args) for peer()."""

    def __init__(self, name, make, child):
        self.name, self.make, self.child = name, make, child


@pytest.fixture(params=["etcd", "store"])
def backend(request):
    prefix = f"/test-{uuid.uuid4().hex[:8]}/"  # one namespace per test: they share one etcd
    opened = []
    if request.param == "etcd":
        endpoint = request.getfixturevalue("etcd_endpoint")

        def make(ttl_s=TTL):
            d = directory.EtcdDirectory(endpoint, prefix=prefix, ttl_s=ttl_s)
            opened.append(d)
            return d

        b = Backend("etcd", make, lambda key: (etcd_child, endpoint, prefix, key))
        b.endpoint = endpoint
    else:
        pytest.importorskip("torch")
        import torch.distributed as dist

        master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

        def make(ttl_s=TTL):
            d = directory.StoreDirectory(_tcpstore_client(master.port), ttl_s=ttl_s, prefix=prefix)
            opened.append(d)
            return d

        b = Backend("store", make, lambda key: (store_child, master.port, prefix, key))
        b.master = master
    b.prefix = prefix
    yield b
    for d in opened:
        d.close()


def test_register_list_unregister(backend):
    d = backend.make()
    d.register("prefill/0", b"addr-p0")
    d.register("prefill/1", b"\x00\xff binary")
    d.register("decode/0", b"")  # empty value: etcd's gateway omits the field
    assert d.list("prefill/") == {"prefill/0": b"addr-p0", "prefill/1": b"\x00\xff binary"}
    assert d.list("") == {"prefill/0": b"addr-p0", "prefill/1": b"\x00\xff binary", "decode/0": b""}
    assert d.list("nothing/") == {}

    d.register("prefill/0", b"addr-p0-v2")  # registering again replaces the value
    assert d.list("prefill/0") == {"prefill/0": b"addr-p0-v2"}

    d.unregister("prefill/0")
    d.unregister("never-registered")  # a no-op
    assert d.list("prefill/") == {"prefill/1": b"\x00\xff binary"}

    d.register("prefill/0", b"back")  # a key can come back after unregister
    assert d.list("prefill/0") == {"prefill/0": b"back"}
    with pytest.raises(TypeError):
        d.register("k", "not bytes")


def test_two_directories_see_each_other(backend):
    a, b = backend.make(), backend.make()
    a.register("prefill/a", b"A")
    b.register("decode/b", b"B")
    assert a.list("") == b.list("") == {"prefill/a": b"A", "decode/b": b"B"}
    a.unregister("prefill/a")
    assert b.list("") == {"decode/b": b"B"}


def test_entries_outlive_ttl_while_alive(backend):
    """The keep-alive/heartbeat thread keeps an entry past its ttl."""
    a, b = backend.make(), backend.make()
    a.register("prefill/a", b"A")
    time.sleep(TTL * 1.5)
    assert b.list("") == {"prefill/a": b"A"}


def test_killed_process_expires_after_ttl(backend, peer):
    conn, proc = peer(*backend.child("prefill/child"))
    try:
        assert conn.poll(60), "child did not register"  # spawn + import torch can take a while
        assert conn.recv() == "registered"
        d = backend.make()
        assert d.list("") == {"prefill/child": b"child"}
        os.kill(proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        proc.join(10)
        # Gone after at most ttl (+ etcd's expiry granularity and polling slack) ...
        assert wait_until(lambda: d.list("") == {}, TTL + 3), "entry of a killed process did not expire"
        elapsed = time.monotonic() - killed
        # ... and not at once: the expiry is the ttl's doing (last refresh was <= ttl/3 before the kill).
        assert elapsed > TTL / 3, f"entry vanished {elapsed:.2f} s after the kill, before its ttl could run out"
    finally:
        if proc.is_alive():
            proc.kill()


def test_close_removes_entries_at_once(backend):
    a, b = backend.make(), backend.make()
    a.register("prefill/a", b"A")
    a.register("prefill/a2", b"A2")
    b.register("decode/b", b"B")
    assert len(b.list("")) == 3
    a.close()
    assert b.list("") == {"decode/b": b"B"}
    a.close()  # idempotent
    with pytest.raises(directory.DirectoryError):
        a.register("again", b"x")


def test_context_manager(backend):
    b = backend.make()
    with backend.make() as a:
        a.register("prefill/a", b"A")
        assert b.list("") == {"prefill/a": b"A"}
    assert b.list("") == {}


# -- errors -------------------------------------------------------------------------------------


def test_etcd_bad_endpoint_raises_quickly():
    endpoint = f"http://127.0.0.1:{_free_port()}"  # nothing listens there: connection refused
    d = directory.EtcdDirectory(endpoint)
    start = time.monotonic()
    with pytest.raises(directory.DirectoryError) as e:
        d.register("k", b"v")
    assert endpoint in str(e.value) and "lease/grant" in str(e.value)
    with pytest.raises(directory.DirectoryError) as e:
        d.list("")
    assert endpoint in str(e.value) and "kv/range" in str(e.value)
    assert time.monotonic() - start < 2
    d.close()


def test_etcd_silent_endpoint_times_out():
    """A server that accepts but never answers: the request timeout bounds the call."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(4)
        endpoint = f"http://127.0.0.1:{srv.getsockname()[1]}"
        d = directory.EtcdDirectory(endpoint)
        d.request_timeout_s = 0.5
        start = time.monotonic()
        with pytest.raises(directory.DirectoryError, match="kv/range"):
            d.list("")
        assert time.monotonic() - start < 3


def test_etcd_http_error_is_directory_error(etcd_endpoint):
    d = directory.EtcdDirectory(etcd_endpoint)
    with pytest.raises(directory.DirectoryError, match="HTTP 404"):
        d._call("no/such/call", {})


def test_etcd_lost_lease_is_regranted(etcd_endpoint):
    """If the lease goes away while the process lives, the keep-alive thread puts the keys back."""
    prefix = f"/test-{uuid.uuid4().hex[:8]}/"
    with directory.EtcdDirectory(etcd_endpoint, prefix=prefix, ttl_s=TTL) as d:
        d.register("prefill/a", b"A")
        old = d._lease
        body = json.dumps({"ID": old}).encode()
        urllib.request.urlopen(etcd_endpoint + "/v3/lease/revoke", data=body, timeout=5).read()
        assert d.list("") == {}  # revoking deleted the key
        assert wait_until(lambda: d.list("") == {"prefill/a": b"A"}, TTL + 3)
        assert d._lease != old


def test_store_error_is_directory_error():
    class BrokenStore:
        def __getattr__(self, name):
            def fail(*args):
                raise RuntimeError("connection reset")

            return fail

    d = directory.StoreDirectory(BrokenStore())
    with pytest.raises(directory.DirectoryError, match="connection reset"):
        d.register("k", b"v")
    with pytest.raises(directory.DirectoryError, match="add failed"):
        d.list("")


def test_store_server_gone_raises_quickly():
    pytest.importorskip("torch")
    import torch.distributed as dist

    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    d = directory.StoreDirectory(_tcpstore_client(master.port))
    d.register("k", b"v")
    del master  # stops the store's server
    start = time.monotonic()
    with pytest.raises(directory.DirectoryError, match="failed"):
        while time.monotonic() - start < 5:  # the first call after the server closed raises
            d.list("")
    assert time.monotonic() - start < 5
    with pytest.raises(directory.DirectoryError):
        d.close()  # stops the heartbeat thread, then fails to mark the entry dead
    assert not d._thread.is_alive()


# -- StoreDirectory specifics ------------------------------------------------------------------


@pytest.fixture
def tcpstore():
    pytest.importorskip("torch")
    import torch.distributed as dist

    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield master


def test_store_concurrent_registrants(tcpstore):
    """Many registrants at once (each with its own connection) get distinct slots; none is lost."""
    dirs = [directory.StoreDirectory(_tcpstore_client(tcpstore.port), ttl_s=TTL) for _ in range(8)]
    go = threading.Barrier(len(dirs))

    def reg(i):
        go.wait(10)
        dirs[i].register(f"prefill/{i}", str(i).encode())

    threads = [threading.Thread(target=reg, args=(i,)) for i in range(len(dirs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    want = {f"prefill/{i}": str(i).encode() for i in range(len(dirs))}
    assert dirs[0].list("") == want
    assert sorted(s for d in dirs for s in d._slots.values()) == list(range(1, len(dirs) + 1))
    for d in dirs:
        d.close()
    assert directory.StoreDirectory(tcpstore).list("") == {}


def test_store_unwritten_slot_does_not_block(tcpstore):
    """A slot counted but never written (registrant died between add and set) is skipped at once."""
    d = directory.StoreDirectory(_tcpstore_client(tcpstore.port), ttl_s=TTL)
    d.register("a", b"A")
    tcpstore.add("fabric/count", 1)  # the hole
    d.register("b", b"B")
    start = time.monotonic()
    assert d.list("") == {"a": b"A", "b": b"B"}
    assert time.monotonic() - start < 1
    d.close()


def test_store_slots_are_reused(tcpstore):
    d = directory.StoreDirectory(_tcpstore_client(tcpstore.port), ttl_s=TTL)
    for i in range(5):
        d.register("k", b"%d" % i)
        d.unregister("k")
    assert tcpstore.add("fabric/count", 0) == 1
    d.close()


def test_store_same_key_newest_slot_wins(tcpstore):
    old, new = (directory.StoreDirectory(_tcpstore_client(tcpstore.port), ttl_s=TTL) for _ in range(2))
    old.register("prefill/0", b"old")
    new.register("prefill/0", b"new")  # e.g. a restarted instance, before the old entry aged out
    assert old.list("") == {"prefill/0": b"new"}
    new.close()
    assert old.list("") == {"prefill/0": b"old"}
    old.close()


def test_store_stale_heartbeat_is_hidden(tcpstore):
    """A record whose heartbeat is older than ttl is not listed (clock-based expiry)."""
    tcpstore.add("fabric/count", 1)
    record = {"k": "prefill/stale", "v": "eA==", "t": time.time() - 10 * TTL, "live": True}
    tcpstore.set("fabric/slot/1", json.dumps(record))
    fresh = dict(record, k="prefill/fresh", t=time.time())
    tcpstore.add("fabric/count", 1)
    tcpstore.set("fabric/slot/2", json.dumps(fresh))
    assert directory.StoreDirectory(tcpstore, ttl_s=TTL).list("") == {"prefill/fresh": b"x"}
