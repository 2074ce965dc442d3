"""The script test_exit.py runs as a child: two engines left open with Python callbacks pending
(200 writes with callables as on_done, receive callbacks, an expectation that never completes),
then the script ends: `python exit_child.py PROVIDER inflight|backlog raise|return|exit`.
inflight: it ends right after submitting, with WRITEs in flight. backlog: it waits until every
WRITE has landed, so only callbacks are left (each takes 2 ms, a backlog of about 0.4 s)."""

import atexit
import sys
import time


def report_engines_closed() -> None:
    # Registered before fabric_lib is imported, so it runs after fabric_lib's own hook (atexit is
    # last in, first out): the engines must be closed by then.
    print(f"closed at exit: {a.closed} {b.closed}", flush=True)


atexit.register(report_engines_closed)

import numpy as np  # noqa: E402

import fabric_lib as fl  # noqa: E402

provider, when, how = sys.argv[1:4]
nics = [""] if provider == "shm" else ["127.0.0.1"]
a = fl.TransferEngine(provider=provider, nics=nics)
b = fl.TransferEngine(provider=provider, nics=nics)
src = np.ones(1 << 20, np.uint8)
dst = np.zeros(1 << 20, np.uint8)
src_handle, _ = a.register_tensor(src)
_, dst_desc = b.register_tensor(dst)
seen = []


def slow_callback(status: fl.Status) -> None:
    seen.append(status.ok)
    if when == "backlog":
        time.sleep(0.002)


a.submit_recvs(256, 4, seen.append)
b.submit_recvs(256, 4, seen.append)
b.expect_imm_count(10, 1, seen.append)  # never sent: pending at exit
landed = fl.DoneFlag()
b.expect_imm_count(9, 200, landed)
for i in range(200):
    off = 4096 * (i % 256)
    a.submit_single_write(len=4096, src=src_handle, src_offset=off, dst=dst_desc, dst_offset=off,
                          imm=9, on_done=slow_callback)
if when == "inflight":
    a.submit_send(b.main_address(), b"hello", on_done=seen.append)
else:
    assert landed.wait(timeout=30), "the 200 writes did not land"
    time.sleep(0.05)  # the senders' completions too: only their callbacks are left
    assert len(seen) < 150, f"{len(seen)} callbacks ran already: no backlog is left at exit"
print("submitted 200 writes", flush=True)
if how == "raise":
    raise RuntimeError("the script failed with engines open")
if how == "exit":
    sys.exit(0)
