"""The fabric-demo workload, for the peer drivers (nixl_bench.py, mooncake_bench.py).

Rounds of `pages` WRITEs of `page` bytes from a source of `pages` pages into random pages of a
destination of 2 x `pages` pages; round r writes into half r % 2, so one round is in flight while
the next is posted (a round waits for round r - 2, the one that used the same half). The source
holds the byte pattern of tools/common/paged_rounds.h; the permutations are numpy's (seed 1234 + r),
not std::shuffle's, so the pages differ from fabric-demo's but the shape is the same.
"""
import argparse
import multiprocessing as mp
import os
import sys
import time
import traceback

import numpy as np


def parse_args(description, extra=None):
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--page-kib", type=int, default=64)
    p.add_argument("--pages", type=int, default=512, help="pages per round (per half)")
    p.add_argument("--rounds", type=int, default=128)
    if extra:
        extra(p)
    a = p.parse_args()
    if a.rounds < 2:
        p.error("--rounds must be at least 2 (the last two rounds cover both halves)")
    a.page = a.page_kib * 1024
    return a


def pattern(nbytes):
    """Byte i of the source: the same as paged_rounds.h's pattern(i)."""
    # (i * 131 + 7) mod 256 repeats every 8192 bytes; (i >> 13) adds the block number on top.
    block = ((np.arange(8192, dtype=np.uint32) * 131 + 7) & 0xFF).astype(np.uint8)
    blocks = -(-nbytes // 8192)
    k = (np.arange(blocks, dtype=np.uint32) & 0xFF).astype(np.uint8)
    return (block[None, :] + k[:, None]).reshape(-1)[:nbytes]


def permutation(r, pages):
    """Destination page of source page i in round r (already offset into half r % 2)."""
    return np.random.default_rng(1234 + r).permutation(pages).astype(np.int64) + (r % 2) * pages


def verify(dst, a):
    """Number of bytes of the destination that differ from what the last two rounds wrote there
    (every destination page is written by one of them)."""
    src = pattern(a.pages * a.page).reshape(a.pages, a.page)
    want = np.empty((2 * a.pages, a.page), np.uint8)
    for r in (a.rounds - 2, a.rounds - 1):
        want[permutation(r, a.pages)] = src
    return int(np.count_nonzero(dst.reshape(2 * a.pages, a.page) != want))


def report(name, a, secs, verdict):
    moved = a.rounds * a.pages * a.page
    print(f"{name}: {a.rounds} rounds x {a.pages} pages of {a.page_kib} KiB, two processes")
    print(f"moved {moved} bytes in {secs:.3f} s, {moved / secs / 1e9:.2f} GB/s, {verdict}", flush=True)


def _exit(rc):
    """Ends the process without running C library destructors: nixl-cu13 1.5.1 crashes in one at
    every exit (rtnl_tc_unregister in its bundled libnl-route, from _dl_fini), work done or not."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def _child(target, a, conn):
    rc = 1
    try:
        rc = target(a, conn)
    except BaseException:  # noqa: B036 (report it: _exit would swallow it)
        traceback.print_exc()
    _exit(rc)


def run_pair(initiator, target, a):
    """Runs target(a, conn) in a spawned process and initiator(a, conn) here, conn being the out of
    band channel (addresses, metadata, the verdict); each returns its exit status. Exits with 0 if
    both succeeded."""
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    child = ctx.Process(target=_child, args=(target, a, theirs), daemon=True)
    child.start()
    rc = 1
    try:
        rc = initiator(a, mine)
    except BaseException:  # noqa: B036 (report it: _exit would swallow it)
        traceback.print_exc()
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.terminate()
        if child.exitcode != 0:
            print(f"target process ended with status {child.exitcode}", file=sys.stderr)
            rc = 1
        _exit(rc)


def recv(conn, timeout_s=300):
    """recv() with a deadline, so a dead peer fails the run instead of hanging it."""
    if not conn.poll(timeout_s):
        raise TimeoutError("no message from the peer process")
    return conn.recv()


now = time.perf_counter
