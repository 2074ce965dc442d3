"""NIXL (UCX backend) driver for bench/compare.sh: the fabric-demo workload between two NIXL agents
in two processes (the initiator here, the target spawned), WRITEs of prepared descriptor lists,
one transfer request per round, a notification per request; the target verifies every byte.

  nixl_bench.py [--page-kib 64] [--pages 512] [--rounds 128] [--backend UCX] [--param K=V]...
                [--prog-thread 1|0] [--probe]

The transport is UCX's choice under UCX_TLS (compare.sh runs it with UCX_TLS=tcp and with sm).
With --prog-thread 0 (as compare.sh runs it) there is no NIXL progress thread: the initiator
busy-polls check_xfer_state and the target busy-polls get_new_notifs, which progress UCX; with 1,
NIXL's progress thread does and the target looks for notifications every millisecond.
Timed: from the first request made to the last one DONE, on the initiator, as fabric-demo.
--probe only says whether the backend starts (compare.sh asks it about LIBFABRIC).
"""
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workload as wl  # noqa: E402


def agent(name, a):
    import nixl_cu13 as nixl  # the import is local: the spawned target imports only what it runs
    ag = nixl.nixl_agent(name, nixl.nixl_agent_config(enable_prog_thread=a.prog_thread, backends=[]))
    params = dict(kv.split("=", 1) for kv in a.param)
    ag.create_backend(a.backend, params)
    return ag


def page_descs(base, npages, page):
    """Nx3 (address, length, device) rows, one per page of the buffer at base."""
    d = np.zeros((npages, 3), np.uint64)
    d[:, 0] = base + np.arange(npages, dtype=np.uint64) * np.uint64(page)
    d[:, 1] = page
    return d


def target(a, conn):
    ag = agent("target", a)
    dst = np.zeros(2 * a.pages * a.page, np.uint8)
    reg = ag.register_memory(np.array([[dst.ctypes.data, dst.nbytes, 0]], np.uint64), "DRAM")
    conn.send((ag.get_agent_metadata(), dst.ctypes.data))
    ag.add_remote_agent(wl.recv(conn))
    # One notification per request, as fabric-demo's receiver counts one immediate per WRITE:
    # all rounds have landed when all have been notified (NIXL sends a request's notification
    # after its data). Without a progress thread these calls are what progresses UCX here.
    seen, deadline = 0, time.time() + 300
    while seen < a.rounds and time.time() < deadline:
        seen += sum(len(v) for v in ag.get_new_notifs().values())
        if seen < a.rounds and a.prog_thread:
            time.sleep(0.001)
    bad = wl.verify(dst, a) if seen == a.rounds else -1
    conn.send("bytes: OK" if bad == 0 else
              f"bytes: FAILED ({bad} bad bytes)" if bad > 0 else f"FAILED ({seen} of {a.rounds} notifications)")
    wl.recv(conn)  # the initiator has the verdict: safe to tear down
    ag.deregister_memory(reg)
    return 0 if bad == 0 else 1


def initiator(a, conn):
    ag = agent("initiator", a)
    src = wl.pattern(a.pages * a.page)
    reg = ag.register_memory(np.array([[src.ctypes.data, src.nbytes, 0]], np.uint64), "DRAM")
    meta, dst_base = wl.recv(conn)
    conn.send(ag.get_agent_metadata())
    peer = ag.add_remote_agent(meta)
    local = ag.prep_xfer_dlist("NIXL_INIT_AGENT", page_descs(src.ctypes.data, a.pages, a.page), "DRAM")
    remote = ag.prep_xfer_dlist(peer, page_descs(dst_base, 2 * a.pages, a.page), "DRAM")
    ag.make_connection(peer)
    src_idx = np.arange(a.pages, dtype=np.int32)
    perms = [wl.permutation(r, a.pages).astype(np.int32) for r in range(a.rounds)]

    def wait(h):
        while (s := ag.check_xfer_state(h)) == "PROC":
            pass
        h.release()
        return s == "DONE"

    ok, inflight = True, []
    t0 = wl.now()
    for r in range(a.rounds):
        if r >= 2:
            ok = wait(inflight.pop(0))  # round r - 2 used the same half
            if not ok:
                break
        h = ag.make_prepped_xfer("WRITE", local, src_idx, remote, perms[r], notif_msg=b"r%d" % r)
        if ag.transfer(h) == "ERR":
            ok = False
            break
        inflight.append(h)
    ok = all([wait(h) for h in inflight]) and ok
    secs = wl.now() - t0
    verdict = wl.recv(conn) if ok else "transfer FAILED"
    wl.report(f"nixl {a.backend} (UCX_TLS={os.environ.get('UCX_TLS', 'default')})", a, secs, verdict)
    conn.send("bye")
    ag.release_dlist_handle(local)
    ag.release_dlist_handle(remote)
    ag.deregister_memory(reg)
    return 0 if ok and verdict == "bytes: OK" else 1


def probe(a):
    """One line: does the backend start in this process? If not, why (NIXL logs the loader's reason
    only at INFO, so the plugin is dlopen()ed here again to show it)."""
    import ctypes
    import glob
    import nixl_cu13 as nixl
    try:
        ag = nixl.nixl_agent("probe", nixl.nixl_agent_config(backends=[]))
        ag.create_backend(a.backend, dict(kv.split("=", 1) for kv in a.param))
        print(f"nixl {a.backend} backend: starts")
        wl._exit(0)
    except Exception as e:  # noqa: BLE001 (any failure is the answer)
        why = f"{type(e).__name__}: {e}"
    root = os.path.dirname(os.path.dirname(nixl.__file__))
    for lib in glob.glob(f"{root}/.nixl_cu13.mesonpy.libs/plugins/libplugin_{a.backend}.so"):
        try:
            ctypes.CDLL(lib)
        except OSError as e:
            why += f"; the plugin does not load: {e}"
    print(f"nixl {a.backend} backend: does not start ({why})")
    wl._exit(1)


if __name__ == "__main__":
    args = wl.parse_args(__doc__.splitlines()[0],
                         lambda p: (p.add_argument("--backend", default="UCX"),
                                    p.add_argument("--param", action="append", default=[],
                                                   help="backend init parameter KEY=VALUE"),
                                    p.add_argument("--prog-thread", type=int, default=1,
                                                   help="NIXL progress thread (1, the default) or none (0)"),
                                    p.add_argument("--probe", action="store_true",
                                                   help="only say whether the backend starts")))
    if args.probe:
        probe(args)
    wl.run_pair(initiator, target, args)
