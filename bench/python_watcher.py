"""The Python watcher's latency, taken apart (GPU machine, torch with CUDA):
  spin:     torch store launched -> the word seen by a Python loop reading watcher.value (no callback)
  callback: torch store launched -> the Python callback ran (it records perf_counter_ns itself)
  wake:     torch store launched -> the launching thread woken by the callback (threading.Event)
Prints `python-watcher spin_p50_us=... callback_p50_us=... wake_p50_us=...` (means alongside)."""

import threading
import time

import numpy as np
import torch

import fabric_lib as fl


class _Word:
    def __init__(self, ptr):
        self.__cuda_array_interface__ = {"shape": (1,), "typestr": "<i8", "data": (ptr, False), "version": 3}


def main(n=2000):
    with fl.TransferEngine(cuda_device=0) as e:
        stamp, ev = [0], threading.Event()

        def cb(old, new):
            stamp[0] = time.perf_counter_ns()
            ev.set()

        w = e.alloc_uvm_watcher(cb)
        word = torch.as_tensor(_Word(w.device_ptr), device="cuda")
        spin, callback, wake = [], [], []
        for i in range(1, n + 1):
            ev.clear()
            t0 = time.perf_counter_ns()
            word.fill_(i)
            while w.value != i:  # holds the GIL: the callback waits until this loop ends
                pass
            spin.append(time.perf_counter_ns() - t0)
            ev.wait(5)
        v = n
        for i in range(1, n + 1):
            ev.clear()
            t0 = time.perf_counter_ns()
            word.fill_(v + i)
            ev.wait(5)
            wake.append(time.perf_counter_ns() - t0)
            callback.append(stamp[0] - t0)
        e.free_uvm_watcher(w)
    r = {k: np.array(x[100:]) / 1000 for k, x in (("spin", spin), ("callback", callback), ("wake", wake))}
    print(" ".join(f"{k}_p50_us={np.percentile(a, 50):.2f} {k}_mean_us={a.mean():.2f}" for k, a in r.items()))
    print("python-watcher " + " ".join(f"{k}_p50_us={np.percentile(a, 50):.2f}" for k, a in r.items()))


if __name__ == "__main__":
    main()
