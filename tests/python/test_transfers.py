"""Two processes over loopback: every call moves the right bytes; asyncio; messages."""

import asyncio

import numpy as np
import pytest
import torch

import fabric_lib as fl
import roles


def nics_for(provider):
    return [""] if provider == "shm" else ["127.0.0.1"]


@pytest.mark.parametrize("provider,host_ipc", [("tcp;ofi_rxm", False), ("shm", False), ("tcp;ofi_rxm", True)],
                         ids=["tcp", "shm", "tcp-host_ipc"])
def test_every_call_with_numpy_and_torch(peer, provider, host_ipc):
    """host_ipc: every WRITE goes through the host_ipc local domain (the last entry of nic_stats),
    none over the NIC; messages stay on NIC 0."""
    conn, proc = peer(roles.receiver, provider, host_ipc)
    with fl.TransferEngine(provider=provider, nics=nics_for(provider), host_ipc=host_ipc) as e:
        src_np = roles.source_bytes(1 << 20)
        src_t = torch.from_numpy(src_np.copy())
        h_np, _ = e.register_tensor(src_np)
        h_t, _ = e.register_tensor(src_t)
        addr, d_single, d_paged, d_side = conn.recv()

        r_single = e.add_remote(d_single)  # interned once; d_paged and d_side are passed as MrDesc
        flag = fl.DoneFlag()
        e.submit_single_write(len=300000, src=h_np, dst=r_single, dst_offset=1000, on_done=flag, imm=1)
        smap, dmap = roles.page_maps()
        counter = fl.DoneCounter()
        e.submit_paged_writes(page_len=roles.PAGE, src=h_t,
                              src_pages=fl.Pages(torch.from_numpy(smap), roles.PAGE),
                              dst=d_paged, dst_pages=fl.Pages(dmap, roles.PAGE), on_done=counter, imm=2)
        statuses = []
        e.submit_scatter(src=h_np, slices=[fl.ScatterSlice(500, 6000, r_single, 500000),
                                           fl.ScatterSlice(len=500, src_offset=5000, dst=d_side, dst_offset=100)],
                         on_done=statuses.append, imm=3)
        assert flag.wait(60) and flag.ok
        assert counter.wait(1, 60) and counter.done == 1 and counter.failed == 0
        barrier = fl.DoneFlag()
        e.submit_barrier(dsts=[r_single, d_side], imm=4, on_done=barrier)
        assert barrier.wait(60) and barrier.ok
        sent = fl.DoneCounter()
        for m in (b"one", b"two", b"three"):
            e.submit_send(addr, m, sent)
        assert sent.wait(3, 60) and sent.failed == 0
        conn.send("sent")
        assert conn.recv() == "ok"
        assert len(statuses) == 1 and statuses[0].ok
        stats = e.nic_stats()
        carrier = stats[-1] if host_ipc else stats[0]
        assert carrier.nic == "host_ipc" or not host_ipc
        assert carrier.writes_posted >= 1 + roles.N_PAGES + 2 + 2
        assert stats[0].sends_posted == 3  # messages go on NIC 0 either way
        if host_ipc:
            assert stats[0].writes_posted == 0
    proc.join(30)
    assert proc.exitcode == 0


def test_asyncio_write_and_imm_wait(peer):
    conn, proc = peer(roles.async_receiver)

    async def main():
        with fl.TransferEngine() as e:
            src = roles.source_bytes(1000)
            h, _ = e.register_tensor(src)
            dst = await asyncio.get_running_loop().run_in_executor(None, conn.recv)
            await asyncio.wait_for(e.write(len=1000, src=h, dst=dst, imm=9), 60)
            await asyncio.wait_for(e.barrier(dsts=[e.add_remote(dst)], imm=9), 60)
            with pytest.raises(fl.FabricError, match="out of bounds"):
                await e.write(len=1001, src=h, dst=dst, dst_offset=65000)

    asyncio.run(main())
    assert conn.recv() == "ok"
    proc.join(30)
    assert proc.exitcode == 0


def test_a_thousand_messages_each_once():
    received = []
    with fl.TransferEngine() as rx, fl.TransferEngine() as tx:
        rx.submit_recvs(64, 16, received.append)
        done = fl.DoneCounter()
        for i in range(1000):
            tx.submit_send(rx.main_address(), i.to_bytes(4, "little"), done)
        assert done.wait(1000, 60) and done.failed == 0
        for _ in range(6000):
            if len(received) == 1000:
                break
            import time
            time.sleep(0.005)
    assert sorted(int.from_bytes(m, "little") for m in received) == list(range(1000))
