"""The KV pairing race (issue 47, item 6). A decode rank that admits before the prefill rank's view
of the directory has its group is served: Prefiller.begin looks once more. A request the prefill
side refuses all the same ends on the decode side at once, naming the cause, not at its timeout.
wait_paired waits for the other side and times out with an error that says what is missing.

One process: engines on loopback and an in-memory directory, with no watch thread, so nothing
here depends on a refresh period. Waits are bounded by a third of the admit's timeout."""

import threading

import numpy as np
import pytest

import fabric_lib as fl
from fabric_lib import kv
from fabric_lib.directory import Directory

LAYERS, PAGES, PAGE_TOKENS, HEAD_DIM, TOTAL_HEADS = 2, 8, 4, 8, 4
EXTRA_SLOTS, EXTRA_BYTES = 4, 64
ADMIT_TIMEOUT_S = 30.0
PROMPT_S = ADMIT_TIMEOUT_S / 3  # "at once": well under the admit's timeout, on a loaded machine


class MemoryDirectory(Directory):
    """A Directory over a dict that every object made by view() shares (one process, no TTL)."""

    def __init__(self, entries=None):
        self.entries = {} if entries is None else entries
        self.mine = set()

    def view(self):
        return MemoryDirectory(self.entries)

    def register(self, key, value):
        self.entries[key] = bytes(value)
        self.mine.add(key)

    def unregister(self, key):
        if key in self.mine:
            self.mine.discard(key)
            self.entries.pop(key, None)

    def list(self, prefix):
        return {k: v for k, v in list(self.entries.items()) if k.startswith(prefix)}

    def close(self):
        for key in list(self.mine):
            self.unregister(key)


class Outcome:
    """An on_done(status) that a test waits on."""

    def __init__(self):
        self.event, self.status = threading.Event(), None

    def __call__(self, status):
        self.status = status
        self.event.set()

    def wait(self, timeout=PROMPT_S):
        assert self.event.wait(timeout), f"the request did not end within {timeout} s"
        return self.status


class Rank:
    """An engine and one rank's cache (K and V per layer, extras)."""

    def __init__(self, tp_size, layers=LAYERS):
        self.engine = fl.TransferEngine(provider="tcp;ofi_rxm", nics=["127.0.0.1"])
        self.layout = kv.make_layout(num_layers=layers, num_pages=PAGES, page_tokens=PAGE_TOKENS,
                                     kv_heads=TOTAL_HEADS // tp_size, head_dim=HEAD_DIM)
        n = self.layout.tensor_bytes
        self.k = [np.zeros(n, np.uint8) for _ in range(layers)]
        self.v = [np.zeros(n, np.uint8) for _ in range(layers)]
        self.extras = np.zeros(EXTRA_SLOTS * EXTRA_BYTES, np.uint8)

    def args(self, group, tp_size, tp_rank):
        return dict(group=group, tp_size=tp_size, tp_rank=tp_rank, total_heads=TOTAL_HEADS,
                    extras=self.extras, extra_slots=EXTRA_SLOTS)

    def page(self, tensors, layer, page):
        pb = self.layout.page_bytes
        return tensors[layer][page * pb:(page + 1) * pb]


@pytest.fixture
def cluster():
    """make_decoder(group, tp_size, tp_rank) and make_prefiller(group): ranks in one directory,
    each with its own engine; everything is closed at the end."""
    directory = MemoryDirectory()
    closers = []

    def make_decoder(group=11, tp_size=1, tp_rank=0, layers=LAYERS):
        r = Rank(tp_size, layers)
        rx = kv.KvReceiver(r.engine, r.layout, r.k, r.v, late_writes_s=5.0, **r.args(group, tp_size, tp_rank))
        dec = kv.Decoder(r.engine, rx, directory.view(), cluster="t")
        closers.append((dec, r))
        return dec, r

    def make_prefiller(group=1):
        r = Rank(1)
        tx = kv.KvSender(r.engine, r.layout, r.k, r.v, **r.args(group, 1, 0))
        pf = kv.Prefiller(r.engine, tx, directory.view(), cluster="t")  # no watch(): never refreshed
        closers.append((pf, r))
        return pf, r

    yield make_decoder, make_prefiller
    for role, r in reversed(closers):
        role.close()
    for role, r in reversed(closers):
        r.engine.close()


def test_an_admit_before_the_prefiller_refreshed_is_served(cluster):
    make_decoder, make_prefiller = cluster
    pf, p = make_prefiller()
    dec, d = make_decoder()  # joins after the prefiller's last (here: no) refresh
    rng = np.random.default_rng(3)
    for t in p.k + p.v:
        t[:] = rng.integers(0, 256, t.size, dtype=np.uint8)
    done = Outcome()
    dec.admit(5, [3, 1], prefill_group=1, timeout_s=ADMIT_TIMEOUT_S, on_done=done)  # no sleep before it
    req = pf.next_request(timeout=PROMPT_S)
    assert req is not None and req.decode_group == 11
    pf.begin(req, [0, 2])  # used to raise "decode group 11 was never added"
    for layer in range(LAYERS):
        pf.sender.layer_done(5, layer)
    pf.sender.extras_done(5)
    status = done.wait()
    assert status.ok, status.message
    for layer in range(LAYERS):
        for src, dst in ((0, 3), (2, 1)):
            for tensors_p, tensors_d in ((p.k, d.k), (p.v, d.v)):
                assert (d.page(tensors_d, layer, dst) == p.page(tensors_p, layer, src)).all()


def test_a_request_refused_for_an_incomplete_decode_group_ends_at_once_naming_it(cluster):
    make_decoder, make_prefiller = cluster
    pf, _ = make_prefiller()
    dec, _ = make_decoder(group=12, tp_size=2, tp_rank=0)  # rank 1 of group 12 never comes
    done = Outcome()
    dec.admit(7, [0, 1, 2], prefill_group=1, timeout_s=ADMIT_TIMEOUT_S, on_done=done)
    req = pf.next_request(timeout=PROMPT_S)
    with pytest.raises(fl.FabricError) as refused:
        pf.begin(req, [0, 1, 2])
    cause = "decode group 12 has ranks [0] of 2 in the directory"
    assert cause in "\n".join([str(refused.value), *getattr(refused.value, "__notes__", [])])
    status = done.wait()  # used to wait ADMIT_TIMEOUT_S, then blame a sender
    assert not status.ok
    assert "KV request 7: prefill group 1 rank 0 refused it" in status.message, status.message
    assert cause in status.message, status.message
    assert dec.receiver.in_flight == 0


def test_a_request_begin_refuses_ends_on_every_decode_rank_even_one_that_admits_later(cluster):
    make_decoder, make_prefiller = cluster
    pf, _ = make_prefiller()
    ranks = [make_decoder(group=13, tp_size=2, tp_rank=q)[0] for q in range(2)]
    outcomes = [Outcome(), Outcome()]
    # Rank 0 admits (and sends the admit message); rank 1 admits only after the refusal came.
    ranks[0].admit(9, [4, 5], prefill_group=1, extra_slot=2, timeout_s=ADMIT_TIMEOUT_S, on_done=outcomes[0])
    req = pf.next_request(timeout=PROMPT_S)
    with pytest.raises(fl.FabricError, match="extra slot"):
        pf.begin(req, [0, 1])  # admitted with extras, and prefill rank 0 names no slot of its own
    first = outcomes[0].wait()
    ranks[1].admit(9, [4, 5], prefill_group=1, extra_slot=2, timeout_s=ADMIT_TIMEOUT_S, on_done=outcomes[1])
    second = outcomes[1].wait()
    for status in (first, second):
        assert not status.ok and "refused it" in status.message and "extra slot" in status.message, status.message
    assert [r.receiver.in_flight for r in ranks] == [0, 0]


def test_a_decode_group_whose_layout_does_not_match_is_refused_with_the_reason(cluster):
    make_decoder, make_prefiller = cluster
    pf, _ = make_prefiller()
    dec, _ = make_decoder(group=14, layers=LAYERS + 1)
    done = Outcome()
    dec.admit(3, [0], prefill_group=1, timeout_s=ADMIT_TIMEOUT_S, on_done=done)
    with pytest.raises(fl.FabricError):
        pf.begin(pf.next_request(timeout=PROMPT_S), [0])
    status = done.wait()
    assert not status.ok and "decode group 14 could not be added" in status.message, status.message
    assert "layout differs" in status.message, status.message


def test_wait_paired_returns_once_the_other_side_is_there(cluster):
    make_decoder, make_prefiller = cluster
    pf, _ = make_prefiller()
    dec, _ = make_decoder()
    dec.wait_paired(1, timeout_s=PROMPT_S)
    assert pf.wait_paired(11, timeout_s=PROMPT_S) == [11]
    assert pf.wait_paired(timeout_s=PROMPT_S) == [11]


def test_wait_paired_times_out_with_a_clear_error_when_nobody_comes(cluster):
    make_decoder, make_prefiller = cluster
    dec, _ = make_decoder(group=15, tp_size=2, tp_rank=0)
    with pytest.raises(TimeoutError, match=r"prefill group 4 is not in the directory") as nobody:
        dec.wait_paired(4, timeout_s=0.3)
    assert isinstance(nobody.value, fl.FabricTimeoutError) and nobody.value.code == "timeout"
    pf, _ = make_prefiller(group=4)
    with pytest.raises(TimeoutError, match=r"this rank's decode group 15 has ranks \[0\] of 2"):
        dec.wait_paired(4, timeout_s=0.3)  # the prefill group is there, this group's rank 1 is not
    with pytest.raises(TimeoutError, match=r"Prefiller.wait_paired\(decode_group=15\).*decode group 15 has "
                                           r"ranks \[0\] of 2 in the directory"):
        pf.wait_paired(15, timeout_s=0.3)
    with pytest.raises(TimeoutError, match="decode group 99 is not in the directory"):
        pf.wait_paired(99, timeout_s=0.3)
