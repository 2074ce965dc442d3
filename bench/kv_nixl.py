"""kv_nixl.py: fabric-kv-bench's KV-cache workload (bench/kv_bench.cpp) through NVIDIA NIXL.

One prefill agent and one decode agent (NIXL's UCX backend, host memory), both in this process,
driven from one Python thread; a Qwen3-235B-like shard by default (94 layers, 32 KiB pages of 128
tokens: 1 KV head x 128 x bf16 per token), one request of --tokens. Per layer, one K and one V
tensor of `pages` pages; the decode side puts source page i at page pages-1-i.

"Compute" is a busy wait of --compute-us per layer. Layer by layer: --send-at of the way through
a layer's compute (after its attention; its MLP follows), its K and V pages go as ONE prepared
NIXL WRITE (descriptor lists and the 94 transfer handles are prepared once, before timing; each
carries a notification naming its layer). After prefill: the same 94 transfers, all posted after
the last layer's compute. Reported, as kv_bench does:
  per-layer transfer: post to the decode agent holding that layer's notification (p50, max),
    and post to check_xfer_state saying DONE on the prefill agent;
  exposed: the end of the compute to every layer's notification on the decode agent (what TTFT
    pays; 0 if all had come before);
  end of prefill: after-prefill mode, the end of the compute to every notification;
  post: CPU time of one transfer() call (p50, microseconds).
Every byte of the decode pages is checked after each mode. Ends with one line:
  nixl layers=<n> pages_per_layer=<n> exposed_ms=<x> end_of_prefill_ms=<y> post_us_per_layer=<z>

Why one process and one thread: NIXL's UCX backend sends a transfer's notification from inside
transfer() when the data is done by the time it returns (cma: UCX copies it there), and otherwise
only from the check_xfer_state call that first finds it done (seen here over tcp: with the
progress thread on, the data lands, but no notification comes until the prefill side checks), so
the prefill side must keep calling check_xfer_state. A second Python thread would fight the
busy-waiting "compute" for the GIL, so the prefill thread polls both agents itself: the prefill
transfers in posting order, and the decode agent's notifications.

With --poll compute (the default) it polls all through each layer's compute wait, so the decode
side sees each notification at once; a poll that moves data (over tcp one check_xfer_state call
took 0.2 to 0.6 ms at 16384 tokens) runs past the wait's end and stretches the compute. That was
still NIXL's best here, by the time to everything landed. With --poll layer the wait is a pure busy
wait, as kv_bench's, and NIXL is polled once after each part of it (and continuously after the
last layer); decode-side times are then seen at those points only.

Without a progress thread (--prog-thread 0, the default, as NIXL's nixlbench runs by default) those
polls are what move UCX. With 1, each agent also has NIXL's progress thread, and those spin: the
Python API sets its delay to 0, which the UCX backend turns into poll() with a zero timeout (two
idle agents took 1.1 to 1.9 cores here), so on a 2-core machine they fight the busy-waiting prefill
thread (over tcp at 4096 tokens, sending at the end of each layer: exposed 5-16 ms against 1.5-2).

UCX moves much of the data inside transfer() itself (over cma the whole copy, over tcp what the
socket takes), on the prefill thread; hence "first compute to complete ... more than layers x
compute", which counts the post calls and the stretched compute too: what TTFT pays. Two agents in
one process is what kv_bench does with two engines; UCX treats them as two peers on the host (cma
or tcp, not its in-process "self" transport: see the header).

The transport is UCX's choice under UCX_TLS / UCX_NET_DEVICES (bench/kv_compare.sh runs it with
UCX_TLS=tcp UCX_NET_DEVICES=lo, and with UCX's defaults). To say what UCX chose, UCX_PROTO_INFO=y
is set with UCX_LOG_FILE pointing at a temporary file (UCX writes a table when an endpoint first
uses an operation: in the warm-up run), and the prefill agent's tables are summarized in the
header. UCX's own warnings and errors from that file are copied to stderr. UCX_TLS=sm needs
--param ucx_error_handling_mode=none: UCX's shared-memory transports cannot detect a failed peer,
which NIXL's default error mode ("peer") requires, and the backend then does not start.

Usage: python3 bench/kv_nixl.py [--layers 94] [--tokens 4096] [--page-tokens 128] [--head-dim 128]
                                [--compute-us 1000] [--send-at 0.5] [--prog-thread 0|1]
                                [--poll compute|layer]
                                [--param KEY=VALUE]...
"""
import argparse
import os
import re
import shutil
import sys
import tempfile
import time

import numpy as np

now = time.perf_counter  # CLOCK_MONOTONIC, as kv_bench's steady_clock


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=94)
    p.add_argument("--tokens", type=int, default=4096, help="prompt tokens of the request")
    p.add_argument("--page-tokens", type=int, default=128)
    p.add_argument("--head-dim", type=int, default=128, help="bytes per token = head_dim x 2 (one KV head, bf16)")
    p.add_argument("--compute-us", type=float, default=1000, help="simulated compute per layer")
    p.add_argument("--send-at", type=float, default=0.5,
                   help="where in a layer's compute its K and V are ready (after attention; the MLP follows)")
    p.add_argument("--prog-thread", type=int, default=0, choices=(0, 1),
                   help="NIXL's progress thread in both agents (1), or none: the polls progress UCX (0)")
    p.add_argument("--poll", choices=("compute", "layer"), default="compute",
                   help="poll NIXL throughout each layer's compute wait (compute), or once after it (layer)")
    p.add_argument("--param", action="append", default=[], help="UCX backend init parameter KEY=VALUE")
    a = p.parse_args()
    if not (1 <= a.layers <= 255 and a.tokens >= 1 and a.page_tokens >= 1 and a.head_dim >= 1
            and 0 <= a.send_at <= 1):
        p.error("--layers 1..255, --send-at 0..1, and --tokens, --page-tokens, --head-dim at least 1")
    a.pages = -(-a.tokens // a.page_tokens)
    a.page_bytes = a.page_tokens * 1 * a.head_dim * 2  # one KV head, bf16
    return a


LOG_DIR = tempfile.mkdtemp(prefix="kv_nixl.")  # for UCX's log, see main()


def finish(rc):
    """Ends the process without C library destructors: nixl-cu13 1.5.1 segfaults in one at exit
    (seen here: status 139 after a clean run), which would hide our exit status."""
    shutil.rmtree(LOG_DIR, ignore_errors=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def ucx_transport(log_path):
    """What UCX chose for the prefill agent's puts and active messages (the notifications), from
    its UCX_PROTO_INFO tables; copies UCX's warnings and errors to stderr."""
    try:
        import ctypes
        ctypes.CDLL(None).fflush(None)  # UCX's log file is block-buffered: flush what it holds
        lines = open(log_path, errors="replace").read().splitlines()
    except OSError:
        return "unknown (no UCX log)"
    put, am, title, op = set(), set(), None, None
    for raw in lines:
        if " ERROR " in raw or " WARN " in raw:
            print(raw, file=sys.stderr)
        line = re.sub(r"^\[[^]]*\] \[[^]]*\]\s*", "", raw).strip()
        # Table rows only, whole ones ("| a | b |"); "+---+" rules and anything else are skipped.
        cells = [c.strip() for c in line[1:-1].split("|")] if re.match(r"^\|.*\|$", line) else []
        if len(cells) == 1 and re.search(r"cfg#\d+$", cells[0]):
            title, op = cells[0], None  # "<agent> intra-node cfg#1"
        elif len(cells) == 1 and title:
            op = cells[0]  # "remote memory write by ucp_put* ..."
        elif len(cells) == 3 and op and re.match(r"^[0-9.inf]+$", cells[0]):
            # Only the prefill agent's endpoint to the decode agent; "self" is NIXL's own
            # endpoint to its agent, for loopback transfers, unused here.
            if title.startswith("prefill ") and " self " not in f" {title} ":
                if op.startswith("remote memory write"):
                    put.add(cells[2])
                elif op.startswith("active message"):
                    am.add(cells[2])
    if not put:
        return "unknown (UCX printed no put table)"
    return f"put over {' / '.join(sorted(put))}, notifications over {' / '.join(sorted(am)) or 'unknown'}"


class Bench:
    def __init__(self, nixl, a):
        self.a = a
        L, P, B = a.layers, a.pages, a.page_bytes
        cfg = dict(enable_prog_thread=bool(a.prog_thread), backends=[])
        params = dict(kv.split("=", 1) for kv in a.param)
        t0 = now()
        self.prefill = nixl.nixl_agent("prefill", nixl.nixl_agent_config(**cfg))
        self.prefill.create_backend("UCX", params)
        self.decode = nixl.nixl_agent("decode", nixl.nixl_agent_config(**cfg))
        self.decode.create_backend("UCX", params)
        t1 = now()
        # Per layer K then V, as kv_bench's Side::mem; one registered region per side.
        self.src = np.zeros((L, 2, P, B), np.uint8)
        self.dst = np.zeros((L, 2, P, B), np.uint8)
        for agent, buf in ((self.prefill, self.src), (self.decode, self.dst)):
            agent.register_memory(np.array([[buf.ctypes.data, buf.nbytes, 0]], np.uint64), "DRAM")
        t2 = now()
        # Metadata both ways, as two real peers would swap it; the connection is made before timing.
        peer = self.prefill.add_remote_agent(self.decode.get_agent_metadata())
        self.decode.add_remote_agent(self.prefill.get_agent_metadata())
        self.prefill.make_connection(peer)
        t3 = now()

        def rows(base, layer):
            """The layer's 2 x P pages (K pages, then V pages) as Nx3 (address, length, device)."""
            d = np.zeros((2 * P, 3), np.uint64)
            d[:, 0] = base + (layer * 2 * P + np.arange(2 * P, dtype=np.uint64)) * np.uint64(B)
            d[:, 1] = B
            return d

        # Page i of K (and of V) goes to decode page P-1-i: the index lists say so, the way a
        # connector maps block tables onto one prepared list per layer.
        self.local_idx = np.arange(2 * P, dtype=np.int32)
        self.remote_idx = np.concatenate([P - 1 - np.arange(P), 2 * P - 1 - np.arange(P)]).astype(np.int32)
        self.dlists, self.handles = [], []
        for layer in range(L):
            loc = self.prefill.prep_xfer_dlist("NIXL_INIT_AGENT", rows(self.src.ctypes.data, layer), "DRAM")
            rem = self.prefill.prep_xfer_dlist(peer, rows(self.dst.ctypes.data, layer), "DRAM")
            self.dlists.append((loc, rem))
        t4 = now()
        for layer, (loc, rem) in enumerate(self.dlists):
            self.handles.append(self.prefill.make_prepped_xfer(
                "WRITE", loc, self.local_idx, rem, self.remote_idx, notif_msg=b"L%d" % layer))
        t5 = now()
        self.setup_ms = dict(agents=t1 - t0, register=t2 - t1, connect=t3 - t2, dlists=t4 - t3, xfers=t5 - t4)
        # kv_bench's pattern, 1 + (request * 7 + layer * 13 + b) % 251, from one table with period 251.
        n = 2 * P * B
        self.pattern = (1 + np.arange(n + 251) % 251).astype(np.uint8)
        self.check_us = []  # duration of single check_xfer_state calls, sampled

    def run(self, request, layer_by_layer):
        a, L = self.a, self.a.layers
        n = 2 * a.pages * a.page_bytes
        for layer in range(L):
            off = (request * 7 + layer * 13) % 251
            self.src[layer].reshape(-1)[:] = self.pattern[off:off + n]
        self.dst.fill(0)  # the pattern never writes 0, so a page not written shows
        self.decode.get_new_notifs()  # nothing is due; start clean anyway

        posted, done, landed, post_us = [None] * L, [None] * L, [None] * L, []
        pending, failed = [], []  # posted, not yet DONE, in posting order

        def poll():
            # UCX moves one endpoint's writes in order, so checking the oldest first and stopping
            # at the first still in progress finds each transfer DONE (and has its notification
            # sent) as soon as it is, at one call per poll most of the time.
            while pending:
                t = now()
                s = self.prefill.check_xfer_state(self.handles[pending[0]])
                t1 = now()
                if len(self.check_us) < 100000:
                    self.check_us.append((t1 - t) * 1e6)
                if s == "PROC":
                    break
                if s != "DONE":
                    failed.append(f"layer {pending[0]}: check_xfer_state {s}")
                done[pending.pop(0)] = t1
            for agent, msgs in self.decode.get_new_notifs().items():
                t = now()
                for m in msgs:
                    if agent == "prefill" and m.startswith(b"L"):
                        landed[int(m[1:])] = t

        def post(layer):
            t = now()
            posted[layer] = t
            s = self.prefill.transfer(self.handles[layer])
            post_us.append((now() - t) * 1e6)
            if s == "ERR":
                failed.append(f"layer {layer}: transfer ERR")
            pending.append(layer)

        def compute(us):
            end = now() + us * 1e-6
            if a.poll == "compute":
                while now() < end:  # "compute", polling NIXL all the while
                    poll()
            else:
                while now() < end:  # a pure busy wait, as kv_bench's; NIXL is polled after it
                    pass
                poll()

        before_send = a.compute_us * a.send_at  # attention; the MLP takes the rest
        t_start = now()
        for layer in range(L):
            compute(before_send)
            if layer_by_layer:
                post(layer)
            compute(a.compute_us - before_send)
        compute_end = now()
        if not layer_by_layer:
            for layer in range(L):
                post(layer)
        deadline = now() + 120
        while (pending or None in landed) and not failed and now() < deadline:
            poll()
        if pending or None in landed:
            failed.append(f"{len(pending)} transfers not DONE, {landed.count(None)} notifications missing")
        r = dict(failed=failed)
        if not failed:
            lat = sorted((landed[i] - posted[i]) * 1e3 for i in range(L))
            dlat = sorted((done[i] - posted[i]) * 1e3 for i in range(L))
            r.update(layer_p50_ms=lat[L // 2], layer_max_ms=lat[-1], done_p50_ms=dlat[L // 2],
                     done_max_ms=dlat[-1], complete_ms=max(0.0, max(landed) - compute_end) * 1e3,
                     all_done_ms=max(0.0, max(done) - compute_end) * 1e3, post_us=sorted(post_us)[L // 2],
                     # What the request pays over its bare compute, post calls included (kv_bench's
                     # post is microseconds, so there this is about the exposed time).
                     overhead_ms=(max(landed) - t_start) * 1e3 - L * a.compute_us * 1e-3)
        # Every page: decode page P-1-i of each tensor holds prefill page i.
        bad = sum(not np.array_equal(self.dst[layer][:, ::-1], self.src[layer]) for layer in range(L))
        if bad:
            failed.append(f"{bad} of {L} layers differ on the decode side")
        return r


def main():
    a = parse_args()
    log_path = None
    if "UCX_PROTO_INFO" not in os.environ and "UCX_LOG_FILE" not in os.environ:
        # Before the import: UCX reads its environment when NIXL loads it.
        os.environ["UCX_PROTO_INFO"] = "y"
        log_path = os.path.join(LOG_DIR, "ucx.log")
        os.environ["UCX_LOG_FILE"] = log_path
    try:
        import importlib.metadata
        import nixl_cu13 as nixl
        version = importlib.metadata.version("nixl-cu13")
    except Exception as e:  # noqa: BLE001 (any failure is the answer)
        print(f"kv_nixl: NIXL cannot run: cannot import nixl_cu13 ({type(e).__name__}: {e}); "
              "pip install nixl-cu13", file=sys.stderr)
        finish(1)
    try:
        b = Bench(nixl, a)
        warm = b.run(1, True)  # warm-up: endpoints, rkeys, first touches, UCX's protocol selection
        b.check_us.clear()
        by_layer = b.run(2, True)
        at_end = b.run(3, False)
    except Exception as e:  # noqa: BLE001
        print(f"kv_nixl: NIXL cannot run: {type(e).__name__}: {e}", file=sys.stderr)
        if log_path:
            ucx_transport(log_path)  # UCX's own errors, to stderr
        finish(1)

    if log_path:
        transport = ucx_transport(log_path)
    else:
        transport = "not probed: the caller set UCX_PROTO_INFO or UCX_LOG_FILE"
    env = " ".join(f"{k}={os.environ[k]}" for k in ("UCX_TLS", "UCX_NET_DEVICES") if k in os.environ) or "UCX defaults"
    mib = 2.0 * a.pages * a.page_bytes / 1048576
    s = b.setup_ms
    when = "during" if a.poll == "compute" else "after"
    print(f"nixl-kv-bench: NIXL {version} UCX backend ({env}: {transport}), progress thread "
          f"{'on' if a.prog_thread else 'off'}, polled {when} each layer's compute, one process, two agents, "
          f"{a.layers} layers, {a.tokens} tokens = {a.pages} pages of {a.page_bytes // 1024} KiB per tensor, "
          f"K+V {mib:.1f} MiB per layer, compute {a.compute_us:.0f} us per layer (K and V ready at "
          f"{100 * a.send_at:.0f}% of it)")
    print(f"setup: agents {s['agents'] * 1e3:.1f} ms, register {s['register'] * 1e3:.1f} ms, metadata+connect "
          f"{s['connect'] * 1e3:.1f} ms, prep_xfer_dlist x{2 * a.layers} {s['dlists'] * 1e3:.1f} ms, "
          f"make_prepped_xfer x{a.layers} {s['xfers'] * 1e3:.1f} ms; check_xfer_state p50 "
          f"{sorted(b.check_us)[len(b.check_us) // 2] if b.check_us else 0:.2f} us per call (the prefill thread "
          "has to keep calling it: NIXL sends the notification from it)")
    runs = (("warm-up", warm), ("layer by layer", by_layer), ("after prefill", at_end))
    for name, r in runs:
        if r["failed"]:
            print(f"{name}: FAILED: {'; '.join(r['failed'])}")
    if any(r["failed"] for _, r in runs):
        finish(1)
    r = by_layer
    print(f"layer by layer: per-layer transfer p50 {r['layer_p50_ms']:.3f} ms, max {r['layer_max_ms']:.3f} ms "
          f"(to the notification; to DONE on the prefill agent p50 {r['done_p50_ms']:.3f} ms, max "
          f"{r['done_max_ms']:.3f} ms); exposed after the compute {r['complete_ms']:.3f} ms (all DONE "
          f"{r['all_done_ms']:.3f} ms); post {r['post_us']:.1f} us per layer; first compute to complete "
          f"{r['overhead_ms']:.3f} ms more than {a.layers} x compute; verified OK")
    print(f"after prefill: all layers sent at the end, complete {at_end['complete_ms']:.3f} ms after the compute "
          f"(all DONE {at_end['all_done_ms']:.3f} ms); post {at_end['post_us']:.1f} us per layer; verified OK")
    print(f"nixl layers={a.layers} pages_per_layer={2 * a.pages} exposed_ms={r['complete_ms']:.3f} "
          f"end_of_prefill_ms={at_end['complete_ms']:.3f} post_us_per_layer={r['post_us']:.1f}")
    finish(0)


if __name__ == "__main__":
    main()
