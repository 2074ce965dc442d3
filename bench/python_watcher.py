"""The Python watcher's latency, taken apart (GPU machine, torch with CUDA).

Launch to seen (host clock; a torch store `word.fill_(i)` launched from Python, to):
  spin:     a Python loop reading watcher.value saw it (no callback)
  callback: the Python callback ran (it records perf_counter_ns itself)
  wake:     the launching thread was woken by the callback (threading.Event)
  wait:     engine.wait_uvm_watcher(w, i) returned (GIL released while it spins; no callback)
Round trips GPU -> Python -> GPU (GPU clock; one kernel stores i to the watcher's word, then spins
until a pinned host word that Python writes reads i, as the C++ benchmark's ping-pong does):
  rt_callback: the Python watcher callback answers
  rt_wait:     the main thread answers after wait_uvm_watcher returns
  rt_spin:     the main thread answers from a Python loop reading watcher.value
  cxx_watcher: the engine's watcher with a C++ callback, from the cuda_ipc benchmark: with
               --cxx-bench PATH (build-gpu/tests/cuda_ipc_bench) this script runs it right after
               its own round trips, in the same run, and reads its JSON; otherwise it reads
               --cxx-json (/tmp/cuda_ipc_bench.json) where that benchmark ran before.
The kernel is compiled at run time with NVRTC and launched through the CUDA driver API (ctypes);
without NVRTC the round trips are left out. The last line is
`python-watcher spin_p50_us=... spin_p99_us=... ... wait_p50_us=... rt_wait_p50_us=...`."""

import argparse
import ctypes
import glob
import json
import os
import subprocess
import tempfile
import threading
import time

import numpy as np
import torch

import fabric_lib as fl

PING_PONG = r"""
__device__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
// n round trips: store i to word (then a system fence), spin until ack >= i; out[i-1] = the round
// trip in ns, ~0 where no answer came within 100 ms (and the kernel ends).
extern "C" __global__ void ping_pong(unsigned long long* word, const volatile unsigned long long* ack,
                                     unsigned int n, unsigned long long* out) {
  volatile unsigned long long* w = word;
  for (unsigned int i = 1; i <= n; i++) {
    unsigned long long t0 = global_ns();
    *w = i;
    __threadfence_system();
    unsigned int spins = 0;
    while (*ack < i) {
      if ((++spins & 1023) == 0 && global_ns() - t0 > 100000000ull) {
        out[i - 1] = ~0ull;
        return;
      }
    }
    out[i - 1] = global_ns() - t0;
  }
}
"""


class _Word:
    def __init__(self, ptr):
        self.__cuda_array_interface__ = {"shape": (1,), "typestr": "<i8", "data": (ptr, False), "version": 3}


def _nvrtc():
    """libnvrtc from torch's wheels (nvidia-cuda-nvrtc), the CUDA toolkit, or the loader path."""
    names = []
    try:
        import nvidia.cuda_nvrtc  # noqa: PLC0415

        names += sorted(glob.glob(os.path.join(list(nvidia.cuda_nvrtc.__path__)[0], "lib", "libnvrtc.so*")))
    except ImportError:
        pass
    names += sorted(glob.glob("/usr/local/cuda*/lib64/libnvrtc.so*")) + ["libnvrtc.so", "libnvrtc.so.12"]
    for name in names:
        if "builtins" in name or name.endswith(".alt.so"):
            continue
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


class PingPongKernel:
    """ping_pong above, compiled for this GPU and launched on a stream of torch's context."""

    def __init__(self):
        nvrtc = _nvrtc()
        if nvrtc is None:
            raise RuntimeError("no libnvrtc found")
        self.cuda = ctypes.CDLL("libcuda.so.1")
        major, minor = torch.cuda.get_device_capability()
        prog = ctypes.c_void_p()
        self._check_nvrtc(nvrtc, nvrtc.nvrtcCreateProgram(ctypes.byref(prog), PING_PONG.encode(), b"pp.cu", 0,
                                                          None, None), "create")
        opts = (ctypes.c_char_p * 1)(f"--gpu-architecture=sm_{major}{minor}".encode())
        rc = nvrtc.nvrtcCompileProgram(prog, 1, opts)
        if rc != 0:
            size = ctypes.c_size_t()
            nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"nvrtc: {log.value.decode(errors='replace')}")
        size = ctypes.c_size_t()
        self._check_nvrtc(nvrtc, nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "cubin size")
        self.image = ctypes.create_string_buffer(size.value)
        self._check_nvrtc(nvrtc, nvrtc.nvrtcGetCUBIN(prog, self.image), "cubin")
        torch.cuda.synchronize()  # torch's (primary) context is current on this thread from here
        self.module, self.fn = ctypes.c_void_p(), ctypes.c_void_p()
        self._check(self.cuda.cuModuleLoadData(ctypes.byref(self.module), self.image), "cuModuleLoadData")
        self._check(self.cuda.cuModuleGetFunction(ctypes.byref(self.fn), self.module, b"ping_pong"),
                    "cuModuleGetFunction")

    @staticmethod
    def _check_nvrtc(nvrtc, rc, what):
        if rc != 0:
            raise RuntimeError(f"nvrtc {what}: error {rc}")

    def _check(self, rc, what):
        if rc != 0:
            name = ctypes.c_char_p()
            self.cuda.cuGetErrorName(rc, ctypes.byref(name))
            raise RuntimeError(f"{what}: {name.value.decode() if name.value else rc}")

    def launch(self, word_ptr, ack_ptr, n, out, stream):
        args = [ctypes.c_uint64(word_ptr), ctypes.c_uint64(ack_ptr), ctypes.c_uint32(n),
                ctypes.c_uint64(out.data_ptr())]
        params = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
        self._check(self.cuda.cuLaunchKernel(self.fn, 1, 1, 1, 1, 1, 1, 0, ctypes.c_void_p(stream.cuda_stream),
                                             params, None), "cuLaunchKernel")


def round_trips(e, kernel, how, n=5000):
    """GPU-timed round trips (us) with Python answering `how`: callback, wait or spin."""
    ack_t = torch.zeros(8, dtype=torch.int64, pin_memory=True)  # mapped: UVA gives it one address
    ack = ack_t.numpy()
    out = torch.zeros(n, dtype=torch.int64, device="cuda")
    ended = threading.Event()

    def answer(old, new):
        ack[0] = new
        if new >= n:
            ended.set()

    w = e.alloc_uvm_watcher(answer if how == "callback" else None)
    stream = torch.cuda.Stream()
    kernel.launch(w.device_ptr, ack_t.data_ptr(), n, out, stream)
    try:
        if how == "callback":
            ended.wait(60)
        elif how == "wait":
            for i in range(1, n + 1):
                ack[0] = e.wait_uvm_watcher(w, i, 5)
        else:
            for i in range(1, n + 1):
                deadline = time.monotonic() + 5
                while w.value < i:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"spin: round {i} not seen")
                ack[0] = w.value
    finally:
        ack[0] = n  # whatever happened, let the kernel end
        stream.synchronize()
        e.free_uvm_watcher(w)
    ns = out.cpu().numpy().astype(np.uint64)
    ns = ns[100:]  # warm-up
    ok = ns[(ns != 0) & (ns != np.uint64(2**64 - 1))]
    return ok.astype(np.float64) / 1000


def launch_to_seen(e, n=2000):
    stamp, ev = [0], threading.Event()

    def cb(old, new):
        stamp[0] = time.perf_counter_ns()
        ev.set()

    w = e.alloc_uvm_watcher(cb)
    word = torch.as_tensor(_Word(w.device_ptr), device="cuda")
    spin, callback, wake, wait = [], [], [], []
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
    w = e.alloc_uvm_watcher(None)  # no callback: nothing else takes the GIL per change
    word = torch.as_tensor(_Word(w.device_ptr), device="cuda")
    for i in range(1, n + 1):
        t0 = time.perf_counter_ns()
        word.fill_(i)
        e.wait_uvm_watcher(w, i, 5)
        wait.append(time.perf_counter_ns() - t0)
    e.free_uvm_watcher(w)
    return {k: np.array(x[100:]) / 1000 for k, x in (("spin", spin), ("callback", callback), ("wake", wake),
                                                     ("wait", wait))}


def cxx_watcher(path):
    """The engine's C++ watcher round trip from the cuda_ipc benchmark's JSON, or None."""
    try:
        with open(path) as f:
            stats = json.load(f)["watcher_store_fence_round_trip"]
        return {"p50": stats["p50_us"], "p99": stats["p99_us"]}
    except (OSError, KeyError, ValueError):
        return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cxx-json", default="/tmp/cuda_ipc_bench.json")
    ap.add_argument("--cxx-bench", help="the cuda_ipc benchmark to run for the C++ watcher's figure")
    args = ap.parse_args()
    fields = []
    with fl.TransferEngine(cuda_device=0) as e:
        for k, a in launch_to_seen(e).items():
            print(f"launch -> {k:9s} p50 {np.percentile(a, 50):7.2f} us  p99 {np.percentile(a, 99):7.2f} us  "
                  f"mean {a.mean():7.2f} us")
            fields += [f"{k}_p50_us={np.percentile(a, 50):.2f}", f"{k}_p99_us={np.percentile(a, 99):.2f}"]
        try:
            kernel = PingPongKernel()
        except (OSError, RuntimeError) as err:
            kernel = None
            print(f"round trips left out: {err}")
        if kernel is not None:
            for how in ("callback", "wait", "spin"):
                a = round_trips(e, kernel, how)
                print(f"round trip GPU -> Python {how:8s} -> GPU  p50 {np.percentile(a, 50):7.2f} us  "
                      f"p99 {np.percentile(a, 99):7.2f} us  (n={a.size})")
                fields += [f"rt_{how}_p50_us={np.percentile(a, 50):.2f}",
                           f"rt_{how}_p99_us={np.percentile(a, 99):.2f}"]
    if args.cxx_bench:  # the same run: the C++ watcher measured now, after the Python one
        args.cxx_json = os.path.join(tempfile.mkdtemp(), "cuda_ipc_bench.json")
        subprocess.run([args.cxx_bench, "--json", args.cxx_json], check=True, stdout=subprocess.DEVNULL)
    cxx = cxx_watcher(args.cxx_json)
    if cxx:
        print(f"round trip GPU -> C++ watcher -> GPU (cuda_ipc_bench)  p50 {cxx['p50']:.2f} us  "
              f"p99 {cxx['p99']:.2f} us")
        fields += [f"cxx_watcher_p50_us={cxx['p50']:.2f}", f"cxx_watcher_p99_us={cxx['p99']:.2f}"]
        rt = [f for f in fields if f.startswith("rt_wait_p50_us=")]
        if rt:
            fields.append(f"rt_wait/cxx_p50={float(rt[0].split('=')[1]) / cxx['p50']:.2f}")
    print("python-watcher " + " ".join(fields))


if __name__ == "__main__":
    main()
