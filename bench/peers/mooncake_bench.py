"""Mooncake Transfer Engine driver for bench/compare.sh: the fabric-demo workload between two
engines in two processes (the initiator here, the target spawned), P2PHANDSHAKE metadata (no
metadata server), protocol tcp, one batch (batch_transfer_async_write) per round, two rounds in
flight (get_batch_transfer_status waits for round r - 2); the target verifies every byte.

  mooncake_bench.py [--page-kib 64] [--pages 512] [--rounds 128] [--protocol tcp]

Timed: from the first batch submitted to the last one completed, on the initiator, as fabric-demo.
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workload as wl  # noqa: E402


def engine(a):
    from mooncake.engine import TransferEngine
    e = TransferEngine()
    if e.initialize("127.0.0.1", "P2PHANDSHAKE", a.protocol, "") != 0:
        raise RuntimeError(f"TransferEngine.initialize(127.0.0.1, P2PHANDSHAKE, {a.protocol}) failed")
    return e


def target(a, conn):
    e = engine(a)
    dst = np.zeros(2 * a.pages * a.page, np.uint8)
    if e.register_memory(dst.ctypes.data, dst.nbytes) != 0:
        raise RuntimeError("register_memory failed")
    conn.send((f"127.0.0.1:{e.get_rpc_port()}", dst.ctypes.data))
    # A batch completes on the initiator once the target has applied it (tcp framing v2 acknowledges
    # each WRITE after its last byte is in memory), so "done" from the initiator means all landed.
    done = wl.recv(conn)
    bad = wl.verify(dst, a) if done == "done" else -1
    conn.send("bytes: OK" if bad == 0 else
              f"bytes: FAILED ({bad} bad bytes)" if bad > 0 else "FAILED (no transfer)")
    wl.recv(conn)  # the initiator has the verdict: safe to tear down
    e.unregister_memory(dst.ctypes.data)
    return 0 if bad == 0 else 1


def initiator(a, conn):
    e = engine(a)
    src = wl.pattern(a.pages * a.page)
    if e.register_memory(src.ctypes.data, src.nbytes) != 0:
        raise RuntimeError("register_memory failed")
    peer, dst_base = wl.recv(conn)
    src_addrs = [src.ctypes.data + i * a.page for i in range(a.pages)]
    lengths = [a.page] * a.pages
    dst_addrs = [[dst_base + int(p) * a.page for p in wl.permutation(r, a.pages)] for r in range(a.rounds)]
    # Warm-up, not timed: the first transfer opens the segment (handshake, connection).
    if e.transfer_sync_write(peer, src.ctypes.data, dst_base, a.page) != 0:
        raise RuntimeError(f"warm-up transfer to {peer} failed")

    ok, inflight = True, []
    t0 = wl.now()
    for r in range(a.rounds):
        if r >= 2 and e.get_batch_transfer_status([inflight.pop(0)]) != 0:
            ok = False
            break
        b = e.batch_transfer_async_write(peer, src_addrs, dst_addrs[r], lengths)
        if b == 0:
            ok = False
            break
        inflight.append(b)
    if ok and inflight:
        ok = e.get_batch_transfer_status(inflight) == 0
    secs = wl.now() - t0
    conn.send("done" if ok else "failed")
    verdict = wl.recv(conn)
    wl.report(f"mooncake {a.protocol}", a, secs, verdict if ok else "transfer FAILED")
    conn.send("bye")
    e.unregister_memory(src.ctypes.data)
    return 0 if ok and verdict == "bytes: OK" else 1


if __name__ == "__main__":
    args = wl.parse_args(__doc__.splitlines()[0],
                         lambda p: p.add_argument("--protocol", default="tcp"))
    wl.run_pair(initiator, target, args)
