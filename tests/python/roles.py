"""Roles that tests run in a second process. Each reports back over its pipe; "ok" means every
check passed, anything else is the failure."""

import asyncio
import time
import traceback

import numpy as np

import fabric_lib as fl

SEED = 1234
PAGE = 4096
N_PAGES = 64
PAGE_RANGE = 256


def wait_for(pred, timeout=30.0):
    """Polls pred until it is true (True) or timeout seconds have passed (False)."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def source_bytes(n, seed=SEED):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def page_maps():
    rng = np.random.default_rng(SEED + 1)
    src = rng.permutation(PAGE_RANGE)[:N_PAGES]
    dst = rng.permutation(PAGE_RANGE)[:N_PAGES]
    return src, dst


def _report(conn, fn):
    try:
        fn()
        conn.send("ok")
    except Exception:  # noqa: BLE001 - the failure goes back to the test
        conn.send(traceback.format_exc())


def receiver(conn, provider, host_ipc=False):
    """Two engines: the first receives single, paged, scatter, barrier and messages; the second
    only scatter and barrier (so scatter and barrier reach two peers). host_ipc: both engines
    offer the host_ipc local domain."""
    import torch

    def run():
        nics = [""] if provider == "shm" else ["127.0.0.1"]
        with fl.TransferEngine(provider=provider, nics=nics, host_ipc=host_ipc) as a, \
             fl.TransferEngine(provider=provider, nics=nics, host_ipc=host_ipc) as b:
            single = np.zeros(1 << 20, dtype=np.uint8)
            paged = torch.zeros(PAGE_RANGE * PAGE, dtype=torch.uint8)
            side = bytearray(8192)
            hs, ds = a.register_tensor(single)
            hp, dp = a.register_tensor(paged)
            hb, db = b.register_tensor(side)
            messages = []
            a.submit_recvs(1024, 8, messages.append)
            conn.send((a.main_address(), ds, dp, db))

            flag, counter, called = fl.DoneFlag(), fl.DoneCounter(), []
            a.expect_imm_count(1, fl.single_write_imm_count(300000, a.nic_count), flag)
            a.expect_imm_count(2, N_PAGES, counter)
            a.expect_imm_count(3, 1, lambda status: called.append(status.ok))  # scatter
            b.expect_imm_count(3, 1, counter)
            a.expect_imm_count(4, 1, counter)  # barrier
            b.expect_imm_count(4, 1, counter)
            assert flag.wait(60), "single write immediates"
            assert counter.wait(4, 60), "paged/scatter/barrier immediates"
            assert flag.ok and counter.failed == 0

            src = source_bytes(1 << 20)
            assert np.array_equal(single[1000:301000], src[0:300000]), "single write data"
            smap, dmap = page_maps()
            got = paged.numpy().reshape(PAGE_RANGE, PAGE)
            want = src[: PAGE_RANGE * PAGE].reshape(PAGE_RANGE, PAGE)
            assert np.array_equal(got[dmap], want[smap]), "paged write data"
            assert bytes(side[100:600]) == src[5000:5500].tobytes(), "scatter data (second peer)"
            assert np.array_equal(single[500000:500500], src[6000:6500]), "scatter data (first peer)"
            assert conn.recv() == "sent"
            for _ in range(1000):
                if len(messages) == 3 and called:
                    break
                import time
                time.sleep(0.01)
            assert called == [True], called
            assert sorted(messages) == [b"one", b"three", b"two"], messages
            a.dereg_mr(hp)

    _report(conn, run)


def async_receiver(conn):
    async def main():
        with fl.TransferEngine() as e:
            buf = np.zeros(65536, dtype=np.uint8)
            h, d = e.register_tensor(buf)
            conn.send(d)
            await asyncio.wait_for(e.imm_count_reached(9, 2), 60)
            assert np.array_equal(buf[:1000], source_bytes(1000)), "async write data"
            assert e.imm_count(9) == 0

    _report(conn, lambda: asyncio.run(main()))


def idle_target(conn):
    """Registers a buffer, hands out its descriptor, and keeps the engine alive until told."""
    def run():
        with fl.TransferEngine() as e:
            buf = np.zeros(1 << 20, dtype=np.uint8)
            _, d = e.register_tensor(buf)
            conn.send(d)
            conn.recv()

    _report(conn, run)


def gated_sender(conn, desc, addr, gate_name, n):
    """Connects to `desc`'s engine, reports "ready", then waits for byte 0 of the shared-memory
    block `gate_name` to turn 1 (the test sets it while holding its GIL) and only then sends: a
    message to `addr`, one WRITE with immediate 1, `n` with immediate 2, one with immediate 3."""
    from multiprocessing import shared_memory
    import time

    def run():
        gate = shared_memory.SharedMemory(name=gate_name)
        try:
            with fl.TransferEngine() as e:
                buf = np.zeros(4096, dtype=np.uint8)
                h, _ = e.register_tensor(buf)
                warm = fl.DoneFlag()  # connect now, so the gated writes need nothing but the worker
                dst = e.add_remote(desc)
                e.submit_single_write(len=64, src=h, dst=dst, on_done=warm)
                assert warm.wait(30) and warm.ok, "warm-up write"
                conn.send("ready")
                deadline = time.monotonic() + 60
                while gate.buf[0] != 1:
                    assert time.monotonic() < deadline, "the gate never opened"
                    time.sleep(0.0005)
                sent = fl.DoneCounter()
                e.submit_send(addr, b"hello", sent)
                e.submit_single_write(len=64, src=h, dst=dst, dst_offset=64, on_done=sent, imm=1)
                for i in range(n):
                    e.submit_single_write(len=64, src=h, dst=dst, dst_offset=128 + 64 * (i % 32),
                                          on_done=sent, imm=2)
                e.submit_single_write(len=64, src=h, dst=dst, dst_offset=64, on_done=sent, imm=3)
                assert sent.wait(n + 3, 60) and sent.failed == 0, (sent.done, sent.failed)
                # Exit only once the receiver has looked (the writes' data must stay reachable).
                assert conn.recv() == "done"
        finally:
            gate.close()

    _report(conn, run)


def hold_shm_engine(conn):
    """Opens a one-NIC shm engine, says so, and waits to be killed with it open."""
    engine = fl.TransferEngine(provider="shm", nics=[""])
    conn.send("ready")
    time.sleep(600)
    engine.close()
