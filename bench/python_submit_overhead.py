"""Cost of one submit_single_write call from Python, next to the C++ figure (bench/submit_overhead).

Same pattern as the C++ program: one engine writes 64 bytes to itself over loopback, batches of
1000 submits (DoneCounter completion, no Python callback), the median per-call time of 19 batches
after a warm-up batch. Usage: python3 bench/python_submit_overhead.py [BUILD_DIR]
"""

import re
import subprocess
import sys
import time

import numpy as np

import fabric_lib as fl

BATCHES, BATCH = 20, 1000


def python_us_per_call():
    with fl.TransferEngine() as e:
        buf = np.zeros(1 << 20, np.uint8)
        h, d = e.register_tensor(buf)
        dst = e.add_remote(d)  # interned once, as the C++ program does
        done = fl.DoneCounter()
        submit = e.submit_single_write
        per_call = []
        for b in range(BATCHES):
            t0 = time.perf_counter()
            for _ in range(BATCH):
                submit(len=64, src=h, dst=dst, dst_offset=4096, on_done=done)
            t1 = time.perf_counter()
            assert done.wait((b + 1) * BATCH, 60) and done.failed == 0
            if b > 0:
                per_call.append((t1 - t0) / BATCH * 1e6)
        return sorted(per_call)[len(per_call) // 2]


def main():
    build = sys.argv[1] if len(sys.argv) > 1 else "build"
    out = subprocess.run([f"{build}/bench/submit-overhead"], check=True, capture_output=True,
                         text=True).stdout
    print(out.strip())
    cpp = float(re.search(r"([0-9.]+) us/call", out).group(1))
    py = python_us_per_call()
    print(f"python submit_single_write: {py:.2f} us/call (median of {BATCHES - 1} batches of {BATCH})")
    print(f"python overhead: {py - cpp:.2f} us/call, ratio python/cpp={py / cpp:.2f}")


if __name__ == "__main__":
    main()
