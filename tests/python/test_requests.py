"""Interned remote regions (add_remote / remove_remote), destinations given as RemoteMr or MrDesc,
explicit shard counts, and peer groups (group scatter, group barrier)."""

import time

import numpy as np
import pytest

import fabric_lib as fl
from roles import source_bytes, wait_for


@pytest.fixture
def pair():
    """(a, b): two engines in this process; a writes into b."""
    with fl.TransferEngine() as a, fl.TransferEngine() as b:
        yield a, b


def test_add_remote_is_idempotent(pair):
    a, b = pair
    _, d1 = b.register_tensor(np.zeros(4096, np.uint8))
    _, d2 = b.register_tensor(np.zeros(4096, np.uint8))
    r1 = a.add_remote(d1)
    assert isinstance(r1, fl.RemoteMr)
    assert a.add_remote(d1) == r1
    assert a.add_remote(fl.MrDesc.from_bytes(d1.to_bytes())) == r1  # an equal descriptor
    assert hash(a.add_remote(d1)) == hash(r1)
    assert len({r1, a.add_remote(d1)}) == 1
    r2 = a.add_remote(d2)
    assert r2 != r1 and len({r1, r2}) == 2
    assert repr(r1) == f"RemoteMr(slot={r1.slot}, generation={r1.generation}, engine={r1.engine})"
    assert r1.engine == a.register_tensor(np.zeros(16, np.uint8))[0].engine  # a's, not b's


def test_removed_remote_is_not_found_and_can_be_interned_again(pair):
    a, b = pair
    src = source_bytes(4096)
    dst = np.zeros(4096, np.uint8)
    hs, _ = a.register_tensor(src)
    _, dd = b.register_tensor(dst)
    r = a.add_remote(dd)
    a.remove_remote(r)
    calls = []
    with pytest.raises(fl.FabricError, match="not found"):
        a.submit_single_write(len=16, src=hs, dst=r, on_done=calls.append)
    with pytest.raises(fl.FabricError, match="not found"):
        a.submit_barrier(dsts=[r], imm=1, on_done=calls.append)
    with pytest.raises(fl.FabricError, match="not found"):
        a.submit_scatter(src=hs, slices=[fl.ScatterSlice(16, 0, r)], on_done=calls.append)
    with pytest.raises(fl.FabricError, match="not found"):
        a.add_peer_group([r])
    with pytest.raises(fl.FabricError, match="not found"):
        a.remove_remote(r)
    time.sleep(0.1)
    assert calls == []

    r2 = a.add_remote(dd)  # a fresh handle; the stale one stays stale
    assert r2 != r
    landed, flag = fl.DoneFlag(), fl.DoneFlag()
    b.expect_imm_count(6, 1, landed)
    a.submit_single_write(len=4096, src=hs, dst=r2, on_done=flag, imm=6)
    assert flag.wait(30) and flag.ok and landed.wait(30) and landed.ok
    assert np.array_equal(dst, src)


def test_mr_desc_is_accepted_wherever_a_destination_is(pair):
    a, b = pair
    src = source_bytes(1 << 16)
    dst = np.zeros(1 << 16, np.uint8)
    hs, _ = a.register_tensor(src)
    _, dd = b.register_tensor(dst)
    landed = fl.DoneCounter()
    b.expect_imm_count(11, 1, landed)  # single write
    b.expect_imm_count(12, 4, landed)  # paged writes: one per page
    b.expect_imm_count(13, 2, landed)  # scatter: one per slice
    b.expect_imm_count(14, 2, landed)  # barrier: one per destination
    done = fl.DoneCounter()
    a.submit_single_write(len=1000, src=hs, dst=dd, on_done=done, imm=11)
    a.submit_paged_writes(page_len=1024, src=hs, src_pages=fl.Pages([1, 2, 3, 4], 1024),
                          dst=dd, dst_pages=fl.Pages([8, 9, 10, 11], 1024), on_done=done, imm=12)
    a.submit_scatter(src=hs, slices=[fl.ScatterSlice(500, 20000, dd, 20000),
                                     (500, 30000, dd, 30000)], on_done=done, imm=13)
    a.submit_barrier(dsts=[dd, a.add_remote(dd)], imm=14, on_done=done)
    assert done.wait(4, 30) and done.failed == 0
    assert landed.wait(4, 30) and landed.failed == 0
    assert np.array_equal(dst[:1000], src[:1000])
    assert np.array_equal(dst[8192:12288], src[1024:5120])
    assert np.array_equal(dst[20000:20500], src[20000:20500])
    assert np.array_equal(dst[30000:30500], src[30000:30500])
    # Every submit above interned the same descriptor: one region, one peer.
    assert a.peer_count == 1
    r = a.add_remote(dd)
    a.remove_remote(r)
    with pytest.raises(fl.FabricError, match="not found"):
        a.remove_remote(r)


def test_num_shards_delivers_exactly_that_many_immediates(pair):
    a, b = pair
    n = 90000
    src = source_bytes(n)
    dst = np.zeros(n, np.uint8)
    hs, _ = a.register_tensor(src)
    _, dd = b.register_tensor(dst)
    assert fl.single_write_imm_count(n, 1, num_shards=3) == 3
    landed, flag = fl.DoneFlag(), fl.DoneFlag()
    b.expect_imm_count(21, 3, landed)
    a.submit_single_write(len=n, src=hs, dst=dd, on_done=flag, imm=21, num_shards=3)
    assert flag.wait(30) and flag.ok and landed.wait(30) and landed.ok
    assert np.array_equal(dst, src)
    assert a.nic_stats()[0].writes_posted == 3
    time.sleep(0.2)  # a fourth immediate would have arrived by now
    assert b.imm_count(21) == 0
    assert b.nic_stats()[0].imms_received == 3
    with pytest.raises(fl.FabricError, match="num_shards"):
        a.submit_single_write(len=n, src=hs, dst=dd, num_shards=0)


def test_group_scatter_and_group_barrier():
    with fl.TransferEngine() as tx, fl.TransferEngine() as p, fl.TransferEngine() as q:
        src = source_bytes(8192)
        hs, _ = tx.register_tensor(src)
        bufs = [np.zeros(4096, np.uint8), np.zeros(4096, np.uint8), np.zeros(4096, np.uint8)]
        engines = [p, q, p]  # two members owned by one engine
        descs = [e.register_tensor(buf)[1] for e, buf in zip(engines, bufs)]
        group = tx.add_peer_group([descs[0], tx.add_remote(descs[1]), descs[2]])
        assert isinstance(group, fl.PeerGroupHandle) and group.size == 3 and len(group) == 3

        scattered, fenced = fl.DoneCounter(), fl.DoneCounter()
        p.expect_imm_count(31, 2, scattered)  # members 0 and 2
        q.expect_imm_count(31, 1, scattered)
        p.expect_imm_count(32, 2, fenced)
        q.expect_imm_count(32, 1, fenced)
        done = fl.DoneCounter()
        tx.submit_group_scatter(group=group, src=hs,
                                slices=[fl.GroupSlice(1000, 0, 10), (2000, 1000, 20),
                                        fl.GroupSlice(len=0, src_offset=0, dst_offset=0)],
                                on_done=done, imm=31)
        assert done.wait(1, 30) and done.failed == 0
        assert scattered.wait(2, 30) and scattered.failed == 0
        assert np.array_equal(bufs[0][10:1010], src[0:1000])
        assert np.array_equal(bufs[1][20:2020], src[1000:3000])
        assert not bufs[2].any()  # a zero-length slice moves nothing, but carries its immediate
        assert not bufs[0][1010:].any() and not bufs[1][2020:].any()

        tx.submit_group_barrier(group=group, imm=32, on_done=done)
        assert done.wait(2, 30) and done.failed == 0
        assert fenced.wait(2, 30) and fenced.failed == 0
        time.sleep(0.1)
        assert p.imm_count(31) == q.imm_count(31) == p.imm_count(32) == q.imm_count(32) == 0

        calls = []
        with pytest.raises(fl.FabricError, match="invalid argument: .*2 slices for a group of 3"):
            tx.submit_group_scatter(group=group, src=hs, slices=[(1, 0, 0), (1, 0, 0)],
                                    on_done=calls.append)
        with pytest.raises(fl.FabricError, match="out of bounds"):
            tx.submit_group_scatter(group=group, src=hs, slices=[(1, 0, 4096), (1, 0, 0), (1, 0, 0)],
                                    on_done=calls.append)
        with pytest.raises(TypeError, match="GroupSlice"):
            tx.submit_group_scatter(group=group, src=hs, slices=[(1, 0)] * 3, on_done=calls.append)
        time.sleep(0.1)
        assert calls == []


def test_async_group_calls(pair):
    import asyncio

    a, b = pair
    src = source_bytes(4096)
    dst = np.zeros(4096, np.uint8)
    hs, _ = a.register_tensor(src)
    _, dd = b.register_tensor(dst)
    group = a.add_peer_group([dd])
    landed = fl.DoneCounter()
    b.expect_imm_count(41, 1, landed)
    b.expect_imm_count(42, 1, landed)

    async def main():
        await asyncio.wait_for(a.group_scatter(group=group, src=hs, slices=[(4096, 0, 0)], imm=41), 30)
        await asyncio.wait_for(a.group_barrier(group=group, imm=42), 30)
        await asyncio.wait_for(a.scatter(src=hs, slices=[(16, 0, dd, 0)]), 30)
        await asyncio.wait_for(a.paged_write(page_len=16, src=hs, src_pages=fl.Pages([0], 16),
                                             dst=dd, dst_pages=fl.Pages([0], 16)), 30)

    asyncio.run(main())
    assert landed.wait(2, 30) and landed.failed == 0
    assert np.array_equal(dst, src)


def test_pages_own_their_indices(pair):
    a, b = pair
    src = source_bytes(4 * 1024)
    dst = np.zeros(4 * 1024, np.uint8)
    hs, _ = a.register_tensor(src)
    _, dd = b.register_tensor(dst)
    idx = np.array([3, 2, 1, 0], dtype=np.uint32)
    src_pages = fl.Pages(idx, 1024)
    idx[:] = 0  # the Pages copied the indices when built
    del idx
    assert src_pages.indices == [3, 2, 1, 0]
    landed, flag = fl.DoneFlag(), fl.DoneFlag()
    b.expect_imm_count(51, 4, landed)
    a.submit_paged_writes(page_len=1024, src=hs, src_pages=src_pages, dst=dd,
                          dst_pages=fl.Pages(range(4), 1024), on_done=flag, imm=51)
    assert flag.wait(30) and flag.ok and landed.wait(30) and landed.ok
    want = src.reshape(4, 1024)[[3, 2, 1, 0]].reshape(-1)
    assert np.array_equal(dst, want)
    assert wait_for(lambda: b.imm_count(51) == 0)


@pytest.mark.parametrize("provider", ["tcp;ofi_rxm", "shm"])
def test_connect_writes_nothing_and_counts_nothing(provider):
    with fl.TransferEngine(provider=provider) as a, fl.TransferEngine(provider=provider) as b:
        src, dst = source_bytes(4096), np.zeros(4096, np.uint8)
        hs, _ = a.register_tensor(src)
        _, dd = b.register_tensor(dst)
        a.connect(dd)  # interns it
        r = a.add_remote(dd, connect=True)
        assert not dst.any() and b.imm_count(0) == 0
        assert sum(n.imms_received for n in b.nic_stats()) == 0
        landed = fl.DoneFlag()
        b.expect_imm_count(3, 1, landed)
        a.submit_single_write(len=4096, src=hs, dst=r, imm=3)
        assert landed.wait(30) and landed.ok and (dst == src).all()
        with pytest.raises(TypeError, match="connect must be True or False"):
            a.add_remote(dd, connect=1)
