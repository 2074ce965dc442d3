"""fabric-top against a real engine's own metrics endpoint (EngineConfig's metrics port): the
rows show exactly the WRITEs and bytes the test moved between two scrapes."""

import numpy as np

import fabric_lib as fl
from fabric_lib import top
from test_top import FakeClock, closed_port


def test_a_real_engines_endpoint_shows_what_it_moved():
    writes, size = 10, 65536
    src, dst = np.ones(writes * size, np.uint8), np.zeros(writes * size, np.uint8)
    for attempt in range(5):  # the free port may be taken by someone else before the engine binds it
        port = closed_port()
        try:
            a = fl.TransferEngine(metrics_port=port)
            break
        except fl.FabricError:
            if attempt == 4:
                raise
    with a, fl.TransferEngine() as b:
        hs, _ = a.register_tensor(src)
        _, dd = b.register_tensor(dst)
        clock = FakeClock()
        t = top.Top([str(port)], clock=clock, sleep=clock.sleep)
        try:
            t.start()
            done = fl.DoneCounter()
            for i in range(writes):
                a.submit_single_write(len=size, src=hs, dst=dd, src_offset=i * size,
                                      dst_offset=i * size, on_done=done)
            assert done.wait(writes, timeout=60) and done.failed == 0
            f = t.step()  # one second later on the fake clock
        finally:
            t.close()
    assert f.ok and (dst == 1).all()
    # 10 WRITEs of 64 KiB in the second between the two scrapes: on the one NIC, to the one peer,
    # 10 transfers on the worker. Exact: the rows' numbers, before any formatting.
    nic, peer, worker = f.tables["NIC"], f.tables["PEER"], f.tables["WORKER"]
    assert [r.key[1] for r in nic] == ["0"], f.text  # rail 0 (no local domain)
    assert [c.value for c in nic[0].cells[:2]] == [writes, writes * size], f.text
    assert len(peer) == 1 and [c.value for c in peer[0].cells[:2]] == [writes, writes * size], f.text
    assert len(worker) == 1 and worker[0].cells[0].value == writes, f.text
    assert nic[0].cells[2].value == 0 and peer[0].cells[2].value == 0  # nothing left in flight
    assert "655.36 kB/s" in f.text
