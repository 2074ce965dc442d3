"""The worker thread never needs the GIL: completions tracked by a DoneFlag or DoneCounter, and
Python callbacks waiting for the callback thread, keep flowing while a Python thread holds the GIL.
"""

import sys
import time
from multiprocessing import shared_memory

import numpy as np

import fabric_lib as fl
import roles


def test_completions_flow_while_a_python_thread_holds_the_gil(peer):
    """This thread takes the GIL and does not let go (switch interval 1000 s, a pure-Python loop
    with no call that releases it). Only then does the peer start writing (it waits on a
    shared-memory byte that this thread sets without releasing the GIL), so every completion below
    happens while the GIL is held. The loop must see all of them: the worker sets DoneFlag and
    DoneCounter itself and drops its reference to them without Python. (Before, the engine kept
    the Python objects alive through nanobind's GIL-taking deleter: the worker blocked at the
    first completion until this thread released the GIL, and the loop saw at most one.) A Python
    callback and a receive callback are queued first: they wait for the GIL on the callback
    thread, and must not hold up the worker either."""
    n = 1000
    gate = shared_memory.SharedMemory(create=True, size=1)
    try:
        gate.buf[0] = 0
        with fl.TransferEngine() as e:
            buf = np.zeros(1 << 16, dtype=np.uint8)
            _, desc = e.register_tensor(buf)
            called, received = [], []
            e.submit_recvs(256, 4, received.append)
            e.expect_imm_count(1, 1, lambda status: called.append(status.ok))
            counter, flag = fl.DoneCounter(), fl.DoneFlag()
            for _ in range(n):
                e.expect_imm_count(2, 1, counter)
            e.expect_imm_count(3, 1, flag)
            conn, _ = peer(roles.gated_sender, desc, e.main_address(), gate.name, n)
            assert conn.recv() == "ready"

            old_interval = sys.getswitchinterval()
            sys.setswitchinterval(1000.0)  # no other thread gets the GIL from this one
            try:
                gate.buf[0] = 1  # the peer starts writing; this releases nothing
                deadline = time.monotonic() + 30
                while (counter.done < n or not flag.done) and time.monotonic() < deadline:
                    pass
                # Read before this thread lets go of the GIL for the first time since the gate.
                seen = (counter.done, counter.failed, flag.done, flag.ok, list(called), list(received))
            finally:
                sys.setswitchinterval(old_interval)
            conn.send("done")
            assert conn.recv() == "ok"
            assert seen[:4] == (n, 0, True, True), f"while the GIL was held: {seen[:4]}"
            assert seen[4:] == ([], []), "Python callbacks cannot have run while the GIL was held"
            deadline = time.monotonic() + 30
            while (not called or not received) and time.monotonic() < deadline:
                time.sleep(0.001)  # the callback thread gets the GIL now
            assert called == [True] and received == [b"hello"], (called, received)
    finally:
        gate.close()
        gate.unlink()
