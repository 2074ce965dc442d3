"""Expectations that time out or are cancelled, removing peers, the dropped-immediate counter, and
what a killed process's shm endpoints leave behind."""

import os

import numpy as np
import pytest

import fabric_lib as fl
import roles
from roles import wait_for


def test_expectations_time_out_and_cancel():
    with fl.TransferEngine() as e:
        statuses = []
        e.expect_imm_count(7, 2, statuses.append, timeout_s=0.2)
        assert wait_for(lambda: statuses)
        assert statuses[0].code == "timeout" and "arrived 0 of the 2" in statuses[0].message

        cancelled = []
        x = e.expect_imm_count(8, 1, cancelled.append)
        assert isinstance(x, fl.ImmExpectation) and x.imm == 8
        assert e.cancel_imm_expectation(x)
        assert not e.cancel_imm_expectation(x)
        assert wait_for(lambda: cancelled) and cancelled[0].code == "cancelled"


def test_removed_peers_are_forgotten_and_reachable_again():
    with fl.TransferEngine() as a, fl.TransferEngine() as b:
        src = np.arange(4096, dtype=np.uint8)
        dst = np.zeros(4096, np.uint8)
        hs, _ = a.register_tensor(src)
        _, dd = b.register_tensor(dst)
        assert a.peer_count == 0
        for _ in range(3):
            dst[:] = 0
            flag = fl.DoneFlag()
            landed = fl.DoneFlag()
            b.expect_imm_count(5, 1, landed)
            r = a.add_remote(dd)  # resolves the owner: the peer is held from here
            assert a.peer_count == 1
            a.submit_single_write(len=4096, src=hs, dst=r, on_done=flag, imm=5)
            assert flag.wait(30) and flag.ok and landed.wait(30) and landed.ok
            assert (dst == src).all()
            assert a.peer_count == 1
            a.remove_peer(dd.owner)
            assert a.peer_count == 0
            # The peer's interned regions went with it: the handle is stale, and the next
            # add_remote of the same descriptor reaches the owner afresh.
            with pytest.raises(fl.FabricError, match="not found"):
                a.submit_single_write(len=16, src=hs, dst=r, on_done=None)
        assert a.nic_stats()[0].imms_dropped == 0


def test_a_killed_processs_shm_files_are_removed_once_it_is_gone(peer):
    conn, p = peer(roles.hold_shm_engine)
    assert conn.recv() == "ready"
    prefix = f"fabric-{os.stat('/proc/self/ns/pid').st_ino}.{p.pid}-"

    def files():
        return [f for f in os.listdir("/dev/shm") if f.startswith(prefix)]

    # Two endpoints per shm NIC: the one peers write to and the one our WRITEs go out on.
    assert len(files()) == 2, "one file per shm endpoint while the engine is open"
    assert fl.remove_shm_endpoints_of(p.pid) == 0, "a live process's files are left alone"
    p.kill()
    p.join()
    assert len(files()) == 2, "SIGKILL leaves the files behind"
    assert fl.remove_shm_endpoints_of(p.pid) == 2
    assert files() == []
