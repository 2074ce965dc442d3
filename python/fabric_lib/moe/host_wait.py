"""How a rank's host thread waits for its GPU: the CUDA context's scheduling flag.

CUDA's default for a process with one context is to spin in every synchronize. A MoE rank has more
host threads that need a core: the AllToAll's proxy, and the engine's worker and callback threads.
Where the ranks sharing a host, three threads each, outnumber its cores, spinning waits take the
cores those threads need and a step stretches from microseconds to milliseconds (8 ranks on a
16-core H100 host: 3,585 / 4,016 us dispatch / combine spinning, 495 / 327 us with blocking-sync;
docs/benchmarks.md). "auto" therefore picks blocking-sync there and leaves CUDA's spin elsewhere.

The flag is set on the running context (cuCtxSetFlags, CUDA 12.1 and later), so a library can
choose it after torch made the context, as deep_ep.Buffer's constructor does.
"""

from __future__ import annotations

import ctypes
import os
from typing import Optional

# The CUDA context scheduling flags (cuda.h CU_CTX_SCHED_*).
SCHED_FLAGS = {"spin": 1, "yield": 2, "blocking-sync": 4}
_SCHED_MASK = 7
MODES = ("auto", *SCHED_FLAGS)
# Host threads a rank keeps busy: the AllToAll's proxy and the engine's worker and callback threads.
THREADS_PER_RANK = 3


def host_cores() -> int:
    """Cores this process may run on (its affinity, as a container or taskset limits it)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def choose(mode: str, ranks_on_host: int, cores: Optional[int] = None) -> str:
    """The scheduling mode `mode` stands for: itself, or for "auto" blocking-sync where the ranks
    on this host need more threads than it has cores, else spin."""
    if mode not in MODES:
        raise ValueError(f"host_wait must be one of {', '.join(map(repr, MODES))}, got {mode!r}")
    if mode != "auto":
        return mode
    cores = host_cores() if cores is None else cores
    return "blocking-sync" if ranks_on_host * THREADS_PER_RANK > cores else "spin"


def _driver():
    return ctypes.CDLL("libcuda.so.1")


def _check(what: str, code: int) -> None:
    if code != 0:
        raise RuntimeError(f"host_wait: {what} failed with CUDA driver error {code} (cuCtxSetFlags needs a "
                           f"CUDA 12.1 driver or later; pass host_wait='spin' to keep CUDA's default)")


def context_flags() -> int:
    """The current CUDA context's flags (cuCtxGetFlags)."""
    flags = ctypes.c_uint()
    _check("cuCtxGetFlags", _driver().cuCtxGetFlags(ctypes.byref(flags)))
    return flags.value


def context_mode() -> str:
    """The current context's scheduling mode by name ("auto" when CUDA decides: flag 0)."""
    sched = context_flags() & _SCHED_MASK
    return next((name for name, flag in SCHED_FLAGS.items() if flag == sched), "auto")


def apply(mode: str) -> None:
    """Sets the current CUDA context's scheduling flag to `mode` (one of SCHED_FLAGS) and checks
    that it took. The caller has made the context current (torch does on first use of a device)."""
    cu = _driver()
    flags = context_flags()
    _check("cuCtxSetFlags", cu.cuCtxSetFlags((flags & ~_SCHED_MASK) | SCHED_FLAGS[mode]))
    if context_mode() != mode:
        raise RuntimeError(f"host_wait: the context's scheduling flag did not change to {mode!r} "
                           f"(flags read back {context_flags():#x})")
