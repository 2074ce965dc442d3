"""DoneFlag.wait and DoneCounter.wait: the waiting loop that engine.wait_uvm_watcher and
engine.wait_gpu_counter share (spin, yield, sleep, with the GIL released), on the CPU. The GPU
waits themselves are tested by tests/gpu/test_python_gpu.py."""

import threading
import time

import numpy as np
import pytest

import fabric_lib as fl


@pytest.fixture
def pair():
    """(a, b, write): two engines in this process; write(imm) sends one WRITE with `imm` a -> b."""
    with fl.TransferEngine() as a, fl.TransferEngine() as b:
        src, dst = np.ones(4096, np.uint8), np.zeros(4096, np.uint8)
        hs, _ = a.register_tensor(src)
        _, dd = b.register_tensor(dst)

        def write(imm):
            a.submit_single_write(len=4096, src=hs, dst=dd, imm=imm)

        yield a, b, write


def later(seconds, fn, *args):
    t = threading.Timer(seconds, fn, args)
    t.start()
    return t


def test_a_wait_releases_the_gil_and_ends_when_the_count_is_reached(pair):
    _, b, write = pair
    counter = fl.DoneCounter()
    for _ in range(3):
        b.expect_imm_count(5, 1, counter)
    spins = [0]
    stop = threading.Event()

    def python_work():  # pure Python: it runs only while the waiting thread has let go of the GIL
        while not stop.is_set():
            spins[0] += 1

    worker = threading.Thread(target=python_work)
    worker.start()
    timers = [later(0.1 * (i + 1), write, 5) for i in range(3)]
    try:
        t0 = time.monotonic()
        assert counter.wait(3, timeout=30)
        waited = time.monotonic() - t0
    finally:
        stop.set()
        worker.join()
        for t in timers:
            t.join()
    assert counter.done == 3 and counter.failed == 0
    assert 0.25 < waited < 10, waited  # the last write goes out after 0.3 s
    assert spins[0] > 1000, f"the other Python thread ran {spins[0]} rounds while this one waited"


def test_timeouts_are_kept_and_a_zero_timeout_only_looks(pair):
    _, b, write = pair
    flag, counter = fl.DoneFlag(), fl.DoneCounter()
    b.expect_imm_count(6, 1, flag)
    t0 = time.monotonic()
    assert not flag.wait(timeout=0)
    assert not counter.wait(1, timeout=0)
    assert time.monotonic() - t0 < 0.5
    t0 = time.monotonic()
    assert not flag.wait(timeout=0.2)
    assert 0.2 <= time.monotonic() - t0 < 5
    assert counter.wait(0, timeout=0), "a count already reached is seen without waiting"
    write(6)
    assert flag.wait(timeout=30) and flag.ok
    assert flag.wait(timeout=0), "once done, a zero timeout sees it"


def test_a_timeout_too_large_for_the_clock_waits_instead_of_failing_at_once(pair):
    """1e12 s overflowed the clock's nanoseconds: the deadline came out in the past and the wait
    returned False at once."""
    _, b, write = pair
    flag = fl.DoneFlag()
    b.expect_imm_count(7, 1, flag)
    timer = later(0.1, write, 7)
    assert flag.wait(timeout=1e12) and flag.ok
    timer.join()
    with pytest.raises(ValueError, match="timeout"):
        flag.wait(timeout=float("nan"))
