"""KV-cache transfer between prefill and decode processes that find each other in etcd (or a torch
TCPStore): TP 2 -> 1,
1 -> 2, 2 -> 2 and 1 -> 1 at once with random request lengths and page allocations, every byte
and extra checked; a decode rank killed mid-request; a prefill rank killed mid-request; new
instances joining; 500 requests with flat memory."""

import os
import signal
import time
import uuid

import numpy as np
import pytest

import kv_roles as R

def _start(peer, fn, **cfg):
    conn, proc = peer(fn, cfg)
    assert conn.poll(60), "the rank did not start"
    msg = conn.recv()
    assert msg == "ready", msg
    return conn, proc


def _ask(conn, cmd, timeout=60):
    conn.send(cmd)
    assert conn.poll(timeout), f"no answer to {cmd!r}"
    reply = conn.recv()
    assert not (isinstance(reply, str) and reply.startswith("error")), reply
    return reply


def _wait_for(pred, timeout=30.0, step=0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(step)
    return pred()


def _stop(ranks):
    for conn, proc in ranks:
        if proc.is_alive():
            conn.send("stop")
    for conn, proc in ranks:
        if proc.is_alive():
            assert conn.poll(30)
            assert conn.recv() == "bye"


class _Decode:
    """A decode group (its ranks' pipes) and its free pages, the same on every rank."""

    def __init__(self, ranks, seed):
        self.ranks = ranks
        self.free = list(range(R.PAGES))
        self.rng = np.random.default_rng(seed)

    def admit(self, request, n_pages, prefill_group, extras, timeout_s=30.0):
        order = self.rng.permutation(len(self.free))[:n_pages]
        pages = [int(self.free[i]) for i in order]
        for p in pages:
            self.free.remove(p)
        for conn, _ in self.ranks:
            assert _ask(conn, ("admit", request, pages, prefill_group, extras, timeout_s)) == "admitted"
        return pages

    def wait(self, request, pages, timeout_s=60.0):
        results = [_ask(conn, ("wait", request, timeout_s), timeout_s + 30) for conn, _ in self.ranks]
        self.free.extend(pages)
        return results

    def paired(self, groups, timeout_s=30.0):
        """Every rank can admit for every prefill group in `groups` (Decoder.wait_paired)."""
        for group in groups:
            for conn, _ in self.ranks:
                reply = _ask(conn, ("paired", group, timeout_s), timeout_s + 30)
                assert reply == "paired", reply
        return True


def _cfg(etcd, provider, **kw):
    return dict(etcd=etcd, provider=provider, cluster=uuid.uuid4().hex, ttl_s=2.0, layer_sleep_s=0.0, **kw)


@pytest.fixture
def tcpstore_port():
    """A torch TCPStore served by the test process (the single-job alternative to etcd)."""
    dist = pytest.importorskip("torch.distributed")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield store.port
    del store


@pytest.mark.parametrize("provider,directory", [("tcp;ofi_rxm", "etcd"), ("shm", "etcd"),
                                                ("tcp;ofi_rxm", "tcpstore")])
def test_two_prefill_and_two_decode_groups_move_every_byte_whatever_their_tp(peer, etcd_endpoint, request,
                                                                             provider, directory):
    base = _cfg(etcd_endpoint, provider)
    if directory == "tcpstore":
        base["tcpstore"] = request.getfixturevalue("tcpstore_port")
    prefill = [_start(peer, R.prefill_main, **base, group=1, tp_size=2, tp_rank=r) for r in range(2)]
    prefill.append(_start(peer, R.prefill_main, **base, group=2, tp_size=1, tp_rank=0))
    x = _Decode([_start(peer, R.decode_main, **base, group=11, tp_size=1, tp_rank=0)], seed=1)
    y = _Decode([_start(peer, R.decode_main, **base, group=12, tp_size=2, tp_rank=r) for r in range(2)], seed=2)
    assert x.paired({1, 2}) and y.paired({1, 2})
    rng = np.random.default_rng(7)
    request = 100
    for _ in range(6):  # rounds of four requests in flight at once, one per (decode, prefill) pair
        batch = []
        for dec in (x, y):
            for group in (1, 2):
                request += 1
                pages = dec.admit(request, int(rng.integers(1, 7)), group, extras=bool(request % 2))
                batch.append((dec, request, pages))
        for dec, req, pages in batch:
            for status, message in dec.wait(req, pages):
                assert status == "ok", f"request {req}: {message}"
    for conn, _ in prefill:
        s = _wait_for(lambda c=conn: (lambda st: st if st["in_flight"] == 0 else None)(_ask(c, "stats")))
        assert s and s["failed"] == 0 and s["free"] == R.PAGES, s
    _stop(prefill + x.ranks + y.ranks)


def test_a_decode_rank_killed_mid_request_fails_the_prefill_side_and_leaves_nothing(peer, etcd_endpoint):
    base = _cfg(etcd_endpoint, "tcp;ofi_rxm")
    prefill = _start(peer, R.prefill_main, **dict(base, layer_sleep_s=0.4), group=1, tp_size=1, tp_rank=0)
    doomed = _Decode([_start(peer, R.decode_main, **base, group=11, tp_size=1, tp_rank=0)], seed=3)
    assert doomed.paired({1})
    assert _wait_for(lambda: _ask(prefill[0], "stats")["peers"] == 0 or True)
    doomed.admit(1, 4, 1, extras=True)
    time.sleep(0.6)  # layer 0 is out, layers 1..3 are not
    os.kill(doomed.ranks[0][1].pid, signal.SIGKILL)
    doomed.ranks[0][1].join()
    # Its writes fail, its lease expires, the prefiller lets its group go: nothing of it stays.
    s = _wait_for(lambda: (lambda st: st if st["failed"] == 1 and st["in_flight"] == 0 and st["peers"] == 0
                           else None)(_ask(prefill[0], "stats")), timeout=45)
    assert s, _ask(prefill[0], "stats")
    assert s["free"] == R.PAGES
    # A new decode rank of the same group joins and is served.
    fresh = _Decode([_start(peer, R.decode_main, **base, group=11, tp_size=1, tp_rank=0)], seed=4)
    assert fresh.paired({1})
    pages = fresh.admit(2, 3, 1, extras=True)
    assert fresh.wait(2, pages) == [("ok", "")]
    _stop([prefill] + fresh.ranks)


def test_a_prefill_rank_killed_mid_request_fails_the_request_at_its_timeout(peer, etcd_endpoint):
    base = _cfg(etcd_endpoint, "tcp;ofi_rxm")
    doomed = _start(peer, R.prefill_main, **dict(base, layer_sleep_s=0.5), group=1, tp_size=1, tp_rank=0)
    dec = _Decode([_start(peer, R.decode_main, **base, group=11, tp_size=1, tp_rank=0)], seed=5)
    assert dec.paired({1})
    pages = dec.admit(1, 5, 1, extras=False, timeout_s=3.0)
    time.sleep(0.8)
    os.kill(doomed[1].pid, signal.SIGKILL)
    doomed[1].join()
    [(status, message)] = dec.wait(1, pages)
    assert status == "failed" and "did not land" in message, message
    assert _ask(dec.ranks[0][0], "stats")["in_flight"] == 0
    # Its entry expires; a new prefill group joins and serves the next request.
    fresh = _start(peer, R.prefill_main, **base, group=2, tp_size=1, tp_rank=0)
    assert _wait_for(lambda: _ask(dec.ranks[0][0], "groups") == [2], timeout=30)
    assert dec.paired({2})
    pages = dec.admit(2, 5, 2, extras=True)
    assert dec.wait(2, pages) == [("ok", "")]
    _stop([fresh] + dec.ranks)


def test_five_hundred_requests_keep_memory_flat(peer, etcd_endpoint):
    base = _cfg(etcd_endpoint, "tcp;ofi_rxm")
    prefill = _start(peer, R.prefill_main, **base, group=1, tp_size=1, tp_rank=0)
    dec = _Decode([_start(peer, R.decode_main, **base, group=11, tp_size=1, tp_rank=0)], seed=6)
    assert dec.paired({1})
    rng = np.random.default_rng(9)
    rss = {}
    for round_ in range(50):
        batch = [(r, dec.admit(r, int(rng.integers(1, 5)), 1, extras=bool(r % 3)))
                 for r in range(round_ * 10 + 1, round_ * 10 + 11)]
        for r, pages in batch:
            assert dec.wait(r, pages) == [("ok", "")], r
        if round_ in (9, 49):
            rss[round_] = (_ask(prefill[0], "stats")["rss_kib"], _ask(dec.ranks[0][0], "stats")["rss_kib"])
    grew = [b - a for a, b in zip(rss[9], rss[49])]
    assert max(grew) < 4096, f"RSS grew by {grew} KiB (prefill, decode) from request 100 to 500"
    s = _ask(prefill[0], "stats")
    assert s["in_flight"] == 0 and s["failed"] == 0 and s["sent"] == 500, s
    _stop([prefill] + dec.ranks)
