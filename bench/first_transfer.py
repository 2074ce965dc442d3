"""The first transfer to a new peer against the tenth, with and without connect() beforehand.

Two engines in one process per trial; each transfer is a 64 KiB single write with an immediate,
timed from submit until the receiver has counted the immediate (the data is in place). A fresh
pair of engines per trial, medians over TRIALS trials. Prints one line per provider and mode:
`first-transfer provider=... connect=yes|no first_ms=... tenth_ms=... first_over_tenth=...`.
Usage: python3 bench/first_transfer.py [--trials N] [--providers tcp;ofi_rxm shm]
"""

import argparse
import statistics
import time

import numpy as np

import fabric_lib as fl


def one_trial(provider, connect):
    """(first, tenth) transfer times in ms on a fresh pair of engines."""
    with fl.TransferEngine(provider=provider) as tx, fl.TransferEngine(provider=provider) as rx:
        src, dst = np.ones(1 << 20, np.uint8), np.zeros(1 << 20, np.uint8)
        hs, _ = tx.register_tensor(src)
        _, dd = rx.register_tensor(dst)
        remote = tx.add_remote(dd, connect=connect)
        times = []
        for i in range(10):
            landed = fl.DoneFlag()
            rx.expect_imm_count(100 + i, 1, landed)
            t0 = time.perf_counter()
            tx.submit_single_write(len=65536, src=hs, dst=remote, imm=100 + i)
            assert landed.wait(30) and landed.ok, landed.status
            times.append((time.perf_counter() - t0) * 1e3)
        return times[0], times[9]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=9)
    ap.add_argument("--providers", nargs="+", default=["tcp;ofi_rxm", "shm"])
    args = ap.parse_args()
    for provider in args.providers:
        for connect in (False, True):
            runs = [one_trial(provider, connect) for _ in range(args.trials)]
            first = statistics.median(r[0] for r in runs)
            tenth = statistics.median(r[1] for r in runs)
            print(f"first-transfer provider={provider} connect={'yes' if connect else 'no'} "
                  f"first_ms={first:.3f} tenth_ms={tenth:.3f} first_over_tenth={first / tenth:.2f} "
                  f"trials={args.trials} poll=adaptive", flush=True)


if __name__ == "__main__":
    main()
