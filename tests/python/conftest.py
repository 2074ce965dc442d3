"""Shared fixtures: run a role in a second process (spawned, so no engine thread is forked)."""

import multiprocessing as mp
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture
def peer():
    """peer(fn, *args) starts fn(conn, *args) in a spawned process; returns (conn, process).
    Every process started is joined (or killed) at the end of the test."""
    ctx = mp.get_context("spawn")
    started = []

    def start(fn, *args):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=fn, args=(child, *args), daemon=True)
        p.start()
        started.append(p)
        return parent, p

    yield start
    for p in started:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
            pytest.fail("a peer process did not finish")
