"""Errors as Python exceptions; callbacks that raise; shutdown with work pending; threads."""

import sys
import threading
import time

import numpy as np
import pytest

import fabric_lib as fl
import roles


from roles import wait_for


def test_bad_offsets_raise_and_complete_nothing():
    with fl.TransferEngine() as e:
        src, dst = np.zeros(4096, np.uint8), np.zeros(4096, np.uint8)
        hs, _ = e.register_tensor(src)
        _, dd = e.register_tensor(dst)
        calls = []
        with pytest.raises(fl.FabricError, match="out of bounds"):
            e.submit_single_write(len=4097, src=hs, dst=dd, on_done=calls.append)
        with pytest.raises(fl.FabricError, match="out of bounds"):
            e.submit_paged_writes(page_len=1024, src=hs, src_pages=fl.Pages([0, 4], 1024), dst=dd,
                                  dst_pages=fl.Pages([0, 1], 1024), on_done=calls.append)
        with pytest.raises(fl.FabricError, match="NICs"):
            e.submit_single_write(len=1, src=hs, dst=dd, on_done=calls.append, nic=3)
        with pytest.raises(TypeError, match="on_done"):
            e.submit_single_write(len=1, src=hs, dst=dd, on_done=42)
        with pytest.raises(TypeError, match="RemoteMr or an MrDesc"):
            e.submit_single_write(len=1, src=hs, dst=hs, on_done=calls.append)
        with pytest.raises(TypeError, match="RemoteMr or an MrDesc"):
            e.submit_barrier(dsts=[dd, "not a region"], imm=1, on_done=calls.append)
        with pytest.raises(TypeError, match="RemoteMr or an MrDesc"):
            fl.ScatterSlice(1, 0, None)
        time.sleep(0.1)
        assert calls == []


def test_callback_exceptions_are_reported_not_swallowed(monkeypatch):
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda info: seen.append(info.exc_value))
    with fl.TransferEngine() as e:
        buf = np.zeros(4096, np.uint8)
        h, d = e.register_tensor(buf)

        def bad(status):
            raise ValueError("a bug in user code")

        e.submit_single_write(len=16, src=h, dst=d, dst_offset=16, on_done=bad)
        assert wait_for(lambda: seen)
        ok = fl.DoneFlag()
        e.submit_single_write(len=16, src=h, dst=d, dst_offset=32, on_done=ok)  # the engine survived
        assert ok.wait(30) and ok.ok
    assert isinstance(seen[0], ValueError) and "a bug in user code" in str(seen[0])


def test_close_with_pending_transfers_fails_them(peer):
    conn, proc = peer(roles.idle_target)
    dead_desc = conn.recv()
    conn.send("exit")
    proc.join(30)  # the target is gone: nothing will complete
    statuses, flag = [], fl.DoneFlag()
    e = fl.TransferEngine(transfer_timeout_s=60)
    buf = np.zeros(1 << 20, np.uint8)
    h, _ = e.register_tensor(buf)
    for _ in range(5):
        e.submit_single_write(len=1 << 20, src=h, dst=dead_desc, on_done=statuses.append)
    e.submit_single_write(len=1 << 20, src=h, dst=dead_desc, on_done=flag)
    e.expect_imm_count(77, 1, statuses.append)
    e.close()
    assert e.closed
    assert flag.done and not flag.ok
    assert len(statuses) == 6 and not any(s.ok for s in statuses)
    assert any(s.code == "shutdown" for s in statuses)
    with pytest.raises(fl.FabricError, match="closed"):
        e.main_address()


def test_callbacks_may_submit_and_other_threads_keep_running():
    with fl.TransferEngine() as e:
        buf = np.zeros(1 << 16, np.uint8)
        h, d = e.register_tensor(buf)
        chained = fl.DoneFlag()

        def first(status):
            assert status.ok
            e.submit_single_write(len=16, src=h, dst=d, dst_offset=64, on_done=chained)  # from the callback thread

        ticks = []
        stop = threading.Event()

        def tick():
            while not stop.is_set():
                ticks.append(1)
                time.sleep(0.001)

        t = threading.Thread(target=tick)
        t.start()
        e.submit_single_write(len=16, src=h, dst=d, on_done=first)
        assert chained.wait(30) and chained.ok  # waits with the GIL released
        stop.set()
        t.join()
        assert ticks  # the other Python thread ran meanwhile


def test_nic_list_must_not_be_empty():
    """docs/api.md: zero NICs is kInvalidArgument. An explicit empty list used to open one NIC."""
    with pytest.raises(fl.FabricError, match=r"invalid argument: TransferEngine\(nics=...\) must list 1 to 4 NICs, it lists 0"):
        fl.TransferEngine(nics=[])
    with pytest.raises(fl.FabricError, match="it lists 5"):
        fl.TransferEngine(nics=["127.0.0.1"] * 5)
    with fl.TransferEngine() as e:  # left out: one NIC
        assert e.nic_count == 1
