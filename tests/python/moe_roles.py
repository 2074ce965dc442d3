"""MoE ranks as processes, for tests/python/test_moe.py and examples/moe/run.py: each rank builds
its AllToAll (host kernels) over a TCPStore, runs decode steps of made-up tokens and routing, and
checks each step against the oracle (fabric_lib.moe.reference_*). Every rank knows every rank's
inputs (a function of (seed, rank, step)), so each checks its own outputs alone. Results go back
over the rank's pipe: ("ok", step, times) / ("failed", step, message, seconds) / "bye", or a
string starting "error" with the traceback."""

from __future__ import annotations

import os
import time
import traceback

import numpy as np
import torch

import fabric_lib as fl
from fabric_lib import moe as M


def make_input(cfg: dict, rank: int, step: int) -> tuple:
    """(x [n, hidden] BF16, topk_idx [n, k] int64, topk_weights [n, k] float32) of `rank` at
    `step`: rank 0 sends max_tokens tokens, rank 1 none on odd steps, the others 0 to max_tokens;
    about 1 slot in 8 is masked (-1) and a third of the picks go to the hot experts 0 and 1."""
    T, E, K, H = cfg["max_tokens"], cfg["experts"], cfg["topk"], cfg["hidden"]
    rng = np.random.default_rng([cfg.get("seed", 7), rank, step])
    n = T if rank == 0 else 0 if (rank == 1 and step % 2 == 1) else int(rng.integers(0, T + 1))
    idx = np.full((n, K), -1, dtype=np.int64)
    for t in range(n):
        for k in range(K):
            if rng.integers(0, 8) == 0:
                continue  # masked slot
            while True:
                e = int(rng.integers(0, 2)) if rng.integers(0, 3) == 0 else int(rng.integers(0, E))
                if e not in idx[t, :k]:
                    idx[t, k] = e
                    break
    g = torch.Generator().manual_seed(int(rng.integers(0, 2**62)))
    x = (torch.randn(n, H, generator=g) * 2).to(torch.bfloat16)
    if n > 1:
        x[1] = 0  # an all-zero token: FP8 scale 1
    w = torch.rand(n, K, generator=g, dtype=torch.float32)
    return x, torch.from_numpy(idx), w


def expert_fn(xf: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """The toy expert: elementwise in the token's values (so the oracle, computing it one token at a
    time, gets the same bits as the rank computing it over its received rows) and different per
    expert (so a row combined from the wrong place shows). xf [n, h] fp32, experts [n] -> BF16."""
    e = experts.float().unsqueeze(1)
    return (xf * (0.5 + e / 16) + (e * 0.25 - 1)).to(torch.bfloat16)


def dispatch_form(cfg: dict, x: torch.Tensor) -> tuple:
    """x as the dispatch output holds it: (values, scales or None)."""
    if cfg["dtype"] == "fp8":
        return M.quantize_fp8_tokens(x)
    return x, None


def values_of(cfg: dict, xd: torch.Tensor, scales) -> torch.Tensor:
    """fp32 values of dispatched rows (dequantized for FP8)."""
    return M.dequantize_fp8_tokens(xd, scales) if cfg["dtype"] == "fp8" else xd.float()


def engine_of(cfg: dict) -> fl.TransferEngine:
    provider = cfg["provider"]
    return fl.TransferEngine(provider=provider, nics=[""] if provider == "shm" else ["127.0.0.1"],
                             transfer_timeout_s=cfg.get("transfer_timeout_s", 30.0))


def build(cfg: dict, engine, rank: int) -> M.AllToAll:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", cfg["port"], is_master=False, wait_for_workers=False)
    return M.AllToAll(engine, rank=rank, world_size=cfg["ranks"], node_size=cfg["node_size"],
                      num_experts=cfg["experts"], experts_per_token=cfg["topk"], hidden=cfg["hidden"],
                      max_tokens=cfg["max_tokens"], dispatch_dtype=cfg["dtype"],
                      private_rows=cfg.get("private_rows", 32), timeout_s=cfg.get("timeout_s", 60.0),
                      store=store, job=cfg["job"])


def counts_problem(cfg: dict, r: int, L: int, inputs: list, counts: torch.Tensor, tag: str) -> list:
    """Rank r's received counts against the bincount of every rank's routing over its experts."""
    every = torch.cat([idx.flatten() for _, idx, _ in inputs])
    want = torch.bincount(every[every >= 0], minlength=cfg["experts"])[r * L:(r + 1) * L].int()
    if torch.equal(counts, want):
        return []
    return [f"{tag}: counts {counts.tolist()} != bincount {want.tolist()}"]


def row_problems(cfg: dict, r: int, L: int, forms: list, recv: tuple, tag: str) -> list:
    """Every received row is its source token (named by recv_src), with its scales."""
    rx, rs, counts, src = recv
    T = cfg["max_tokens"]
    bad = []
    rows_all = torch.zeros(len(forms), T, rx.shape[2] * rx.element_size(), dtype=torch.uint8)
    for s, (xd, _) in enumerate(forms):
        rows_all[s, :xd.shape[0]] = xd.view(torch.uint8)
    for el in range(L):
        c = int(counts[el])
        s_of, t_of = (src[el, :c] // T).long(), (src[el, :c] % T).long()
        if not torch.equal(rx[el, :c].view(torch.uint8), rows_all[s_of, t_of]):
            bad.append(f"{tag} expert {r * L + el}: a received row differs from its source token")
        if rs is not None and c:
            want_s = torch.stack([forms[s][1][t] for s, t in zip(s_of.tolist(), t_of.tolist())])
            if not torch.equal(rs[el, :c], want_s):
                bad.append(f"{tag} expert {r * L + el}: scales differ")
    return bad


class Rank:
    """One rank's AllToAll with its expert buffer and the per-step checks."""

    def __init__(self, cfg: dict, a2a: M.AllToAll, rank: int) -> None:
        self.cfg, self.a2a, self.rank = cfg, a2a, rank
        self.L, self.M = a2a.local_experts, a2a.rows_per_expert
        self.expert_out = torch.zeros(self.L, self.M, cfg["hidden"], dtype=torch.bfloat16)

    def step(self, step: int, inputs: list, split: bool, prequantized: bool, probe=None) -> tuple:
        """Runs dispatch, the experts and combine; returns (recv tuple, out, dispatch s, combine s).
        probe(handle, topk_weights): called between the experts and combine."""
        x, idx, w = inputs[self.rank]
        xs = None
        if prequantized and self.cfg["dtype"] == "fp8":
            x, xs = M.quantize_fp8_tokens(x)
        t0 = time.perf_counter()
        if split:
            h = self.a2a.dispatch_send(x, idx, xs)
            recv = self.a2a.dispatch_recv(h)
        else:
            *recv, h = self.a2a.dispatch(x, idx, xs)
            recv = tuple(recv)
        t1 = time.perf_counter()
        self.run_experts(recv)
        if probe:
            probe(h, w)
        t2 = time.perf_counter()
        if split:
            self.a2a.combine_send(self.expert_out, h)
            out = self.a2a.combine_recv(w, h)
        else:
            out = self.a2a.combine(self.expert_out, w, h)
        t3 = time.perf_counter()
        return recv, out, t1 - t0, t3 - t2

    def run_experts(self, recv: tuple) -> None:
        rx, rs, counts, _ = recv
        for el in range(self.L):
            c = int(counts[el])
            if c:
                xf = values_of(self.cfg, rx[el, :c], rs[el, :c] if rs is not None else None)
                e = torch.full((c,), self.rank * self.L + el, dtype=torch.int64)
                self.expert_out[el, :c] = expert_fn(xf, e)

    def check(self, step: int, inputs: list, recv: tuple, out: torch.Tensor, full: bool) -> list:
        """What differs from the oracle (empty: nothing)."""
        cfg, r, L = self.cfg, self.rank, self.L
        T, E = cfg["max_tokens"], cfg["experts"]
        rx, rs, counts, src = recv
        forms = [dispatch_form(cfg, x) for x, _, _ in inputs]
        tag = f"step {step}"
        bad = counts_problem(cfg, r, L, inputs, counts, tag)
        if bad:
            return bad
        bad += row_problems(cfg, r, L, forms, recv, tag)
        # The order (and everything else) against reference_dispatch.
        ref = M.reference_dispatch([(xd, xs, idx, w) for (xd, xs), (_, idx, w) in zip(forms, inputs)],
                                   num_experts=E, max_tokens=T, rank=r)
        for el in range(L):
            c = int(counts[el])
            if not (torch.equal(rx[el, :c].view(torch.uint8), ref[0][el, :c].view(torch.uint8))
                    and torch.equal(src[el, :c], ref[3][el, :c])
                    and (rs is None or torch.equal(rs[el, :c], ref[1][el, :c]))):
                bad.append(f"step {step} expert {r * L + el}: rows differ from reference_dispatch")
        # Combine: the weighted sum of the expert of each slot applied to the token.
        x, idx, w = inputs[r]
        xf = values_of(cfg, *forms[r])
        rows = torch.stack([expert_fn(xf, idx[:, k].clamp(min=0)) for k in range(cfg["topk"])], 1) \
            if x.shape[0] else torch.zeros(0, cfg["topk"], cfg["hidden"], dtype=torch.bfloat16)
        want = M.reference_combine_rows(idx, w, rows)
        if not torch.equal(out.view(torch.int16), want.view(torch.int16)):
            n_bad = int((out.view(torch.int16) != want.view(torch.int16)).sum())
            bad.append(f"step {step}: combine differs from the oracle in {n_bad} values")
        if full:
            bad += self.check_generic_oracle(step, inputs, forms, out)
        return bad

    def check_generic_oracle(self, step: int, inputs: list, forms: list, out: torch.Tensor) -> list:
        """reference_combine from every rank's reference expert outputs (the DeepEP-style oracle)."""
        cfg, E = self.cfg, self.cfg["experts"]
        ins = [(xd, xs, idx, w) for (xd, xs), (_, idx, w) in zip(forms, inputs)]
        outs = []
        for d, (rx, rs, counts, _) in enumerate(M.reference_dispatch(ins, num_experts=E, max_tokens=cfg["max_tokens"])):
            y = torch.zeros(self.L, self.M, cfg["hidden"], dtype=torch.bfloat16)
            for el in range(self.L):
                c = int(counts[el])
                if c:
                    y[el, :c] = expert_fn(values_of(cfg, rx[el, :c], rs[el, :c] if rs is not None else None),
                                          torch.full((c,), d * self.L + el, dtype=torch.int64))
            outs.append(y)
        want = M.reference_combine(ins, outs, self.rank, num_experts=E)
        return [] if torch.equal(out.view(torch.int16), want.view(torch.int16)) else \
            [f"step {step}: combine differs from reference_combine"]


def snapshot(recv: tuple, out: torch.Tensor) -> tuple:
    """The meaningful part of a step's results (rows up to the counts), copied."""
    rx, rs, counts, src = recv
    rows = [rx[el, :int(c)].view(torch.uint8).clone() for el, c in enumerate(counts.tolist())]
    scales = [rs[el, :int(c)].clone() for el, c in enumerate(counts.tolist())] if rs is not None else []
    return counts.clone(), rows, scales, src.clone(), out.clone()


def same(a: tuple, b: tuple) -> bool:
    ca, ra, sa, srca, oa = a
    cb, rb, sb, srcb, ob = b
    if not torch.equal(ca, cb) or not torch.equal(oa.view(torch.int16), ob.view(torch.int16)):
        return False
    for el, c in enumerate(ca.tolist()):
        if not torch.equal(srca[el, :c], srcb[el, :c]):
            return False
    return all(torch.equal(x, y) for x, y in zip(ra + sa, rb + sb))


def bad_inputs(cfg: dict, a2a: M.AllToAll) -> list:
    """Input the AllToAll must refuse, each with the error it must raise; returns the failures."""
    H, K, T, E = cfg["hidden"], cfg["topk"], cfg["max_tokens"], cfg["experts"]
    n = 2
    x = torch.zeros(n, H, dtype=torch.bfloat16)
    idx = torch.tensor([[0, 1][:K] + [-1] * (K - 2)] * n, dtype=torch.int64)
    w = torch.ones(n, K)
    out_of_range = idx.clone()
    out_of_range[1, 0] = E
    twice = idx.clone()
    twice[0, 1] = 0
    cases = [
        ("x float32", TypeError, "x must be", lambda: a2a.dispatch(x.float(), idx)),
        ("x wrong hidden", ValueError, "shape", lambda: a2a.dispatch(x[:, :H // 2], idx)),
        ("x one-dimensional", ValueError, "x must be", lambda: a2a.dispatch(x[0], idx)),
        ("too many tokens", ValueError, "more than max_tokens",
         lambda: a2a.dispatch(torch.zeros(T + 1, H, dtype=torch.bfloat16), torch.zeros(T + 1, K, dtype=torch.int64))),
        ("x not contiguous", ValueError, "contiguous",
         lambda: a2a.dispatch(torch.zeros(H, n, dtype=torch.bfloat16).t(), idx)),
        ("topk_idx int32", TypeError, "topk_idx must be torch.int64", lambda: a2a.dispatch(x, idx.int())),
        ("topk_idx wrong k", ValueError, "topk_idx must have shape", lambda: a2a.dispatch(x, idx[:, :1])),
        ("topk_idx missing", TypeError, "topk_idx must be a torch.Tensor", lambda: a2a.dispatch(x, None)),
        ("expert out of range", fl.FabricError, f"= {E}, not below experts {E}", lambda: a2a.dispatch(x, out_of_range)),
        ("expert twice", fl.FabricError, "names expert 0 in slots 0 and 1", lambda: a2a.dispatch(x, twice)),
        ("combine without a handle", TypeError, "handle must be the MoeHandle",
         lambda: a2a.combine(torch.zeros(a2a.local_experts, a2a.rows_per_expert, H, dtype=torch.bfloat16), w, None)),
        ("receive without a handle", TypeError, "handle must be the MoeHandle", lambda: a2a.dispatch_recv(3)),
    ]
    if cfg["dtype"] == "fp8":
        q, s = M.quantize_fp8_tokens(x)
        cases += [
            ("fp8 x without scales", ValueError, "needs x_scales", lambda: a2a.dispatch(q, idx)),
            ("bf16 x with scales", ValueError, "x_scales is given", lambda: a2a.dispatch(x, idx, s)),
            ("round_scale with fp8 x", ValueError, "round_scale is for BF16 x",
             lambda: a2a.dispatch(q, idx, s, round_scale=True)),
            ("scales wrong shape", ValueError, "x_scales must have shape", lambda: a2a.dispatch(q, idx, s[:, :1])),
        ]
    else:
        cases.append(("round_scale for bf16", ValueError, "round_scale is for BF16 x in an FP8 dispatch",
                      lambda: a2a.dispatch(x, idx, round_scale=True)))
        cases.append(("fp8 x for bf16", TypeError, "x must be torch.bfloat16",
                      lambda: a2a.dispatch(x.to(torch.float8_e4m3fn), idx)))
    return [f for f in (_expect(*c) for c in cases) if f]


def bad_combines(cfg: dict, a2a: M.AllToAll, h: M.Handle, w: torch.Tensor) -> list:
    """Right after dispatch h (received): combine input the AllToAll must refuse, and halves out
    of order for h."""
    L, Mr, H, n = a2a.local_experts, a2a.rows_per_expert, cfg["hidden"], h.num_tokens
    eo = torch.zeros(L, Mr, H, dtype=torch.bfloat16)
    cases = [
        ("expert_out float32", TypeError, "expert_out must be torch.bfloat16", lambda: a2a.combine(eo.float(), w, h)),
        ("expert_out wrong shape", ValueError, "expert_out must have shape", lambda: a2a.combine(eo[:, :1], w, h)),
        ("out wrong shape", ValueError, "out must have shape",
         lambda: a2a.combine(eo, w, h, torch.zeros(n + 1, H, dtype=torch.bfloat16))),
        ("topk_weights float64", TypeError, "topk_weights must be torch.float32", lambda: a2a.combine(eo, w.double(), h)),
        ("topk_weights missing", TypeError, "topk_weights must be a torch.Tensor", lambda: a2a.combine(eo, None, h)),
        ("topk_weights wrong shape", ValueError, "topk_weights must have shape",
         lambda: a2a.combine(eo, torch.ones(n + 1, cfg["topk"]), h)),
        ("receive twice", fl.FabricError, f"out of order for dispatch {h.step}", lambda: a2a.dispatch_recv(h)),
        ("combine receive before its send", fl.FabricError, f"out of order for dispatch {h.step}",
         lambda: a2a.combine_recv(w, h)),
    ]
    return [f for f in (_expect(*c) for c in cases) if f]


def _expect(what: str, kind: type, text: str, call) -> str:
    try:
        call()
    except kind as e:
        return "" if text in str(e) else f"{what}: {kind.__name__} without {text!r}: {e}"
    except Exception as e:  # noqa: BLE001 - the wrong error is the failure reported
        return f"{what}: {type(e).__name__} instead of {kind.__name__}: {e}"
    return f"{what}: accepted"


def rank_main(conn, cfg: dict) -> None:
    """One rank: cfg has port, job, provider, ranks, node_size, experts, topk, hidden, max_tokens,
    dtype, steps, and optionally repeat (steps of one same input after the others), kill_step
    (this rank exits after its dispatch send of that step), bad_inputs, full_oracle_steps."""
    try:
        torch.set_num_threads(1)
        rank = cfg["rank"]
        with engine_of(cfg) as engine:
            a2a = build(cfg, engine, rank)
            me = Rank(cfg, a2a, rank)
            conn.send("ready")
            if cfg.get("bad_inputs"):
                conn.send(("bad_inputs", bad_inputs(cfg, a2a)))
            run_steps(conn, cfg, me)
            a2a.close()
        conn.send("bye")
    except Exception:  # noqa: BLE001 - the failure goes back to the test
        conn.send("error " + traceback.format_exc())


def run_steps(conn, cfg: dict, me: Rank) -> None:
    steps = list(range(1, cfg["steps"] + 1))
    repeat_at = cfg.get("repeat", 0)
    first = None
    for i, step in enumerate(steps + [10_000] * repeat_at):
        repeated = i >= len(steps)
        inputs = [make_input(cfg, s, step) for s in range(cfg["ranks"])]
        if step == cfg.get("kill_step") and me.rank == cfg.get("kill_rank"):
            x, idx, _ = inputs[me.rank]
            me.a2a.dispatch_send(x, idx)
            os._exit(17)  # mid-step: its rows sent, nothing more
        t0 = time.monotonic()
        try:
            probe = None
            if cfg.get("bad_inputs") and step == 1:
                def probe(h, w):
                    conn.send(("bad_combines", bad_combines(cfg, me.a2a, h, w)))
            recv, out, d_s, c_s = me.step(step, inputs, split=step % 2 == 0, prequantized=step % 3 == 0,
                                          probe=probe)
        except fl.FabricError as e:
            conn.send(("failed", step, str(e), time.monotonic() - t0, _refusal(me.a2a)))
            return
        if repeated:
            snap = snapshot(recv, out)
            first = first or snap
            conn.send(("repeat", step, same(first, snap)))
            continue
        bad = [] if cfg.get("light") else me.check(step, inputs, recv, out, step in cfg.get("full_oracle_steps", ()))
        stats = me.a2a.proxy_stats()
        conn.send(("ok", step, dict(dispatch_s=d_s, combine_s=c_s, bad=bad, writes=stats.writes,
                                    steps=stats.steps, dispatch_wait_ms=stats.dispatch_wait_ms,
                                    combine_wait_ms=stats.combine_wait_ms)))


def _refusal(a2a: M.AllToAll) -> str:
    """What a call on an AllToAll that failed raises (it must refuse every later call)."""
    try:
        a2a.dispatch_send(torch.zeros(0, a2a.hidden, dtype=torch.bfloat16), torch.zeros(0, a2a.topk, dtype=torch.int64))
    except fl.FabricError as e:
        return str(e)
    return "accepted"


# ---- the DeepEP shim (fabric_lib.moe.deep_ep.Buffer), for tests/python/test_moe_deep_ep.py ----


def unpack_ue8m0(packed: torch.Tensor) -> torch.Tensor:
    """fp32 scales [..., 4 G] of UE8M0 exponents packed four per int32 [..., G]."""
    b = torch.stack([(packed >> (8 * i)) & 0xFF for i in range(4)], dim=-1).flatten(-2)
    return (b << 23).to(torch.int32).view(torch.float32)


def deep_ep_problems(cfg: dict, buf, rank: int, inputs: list, forms: list, got: tuple, tag: str) -> list:
    """One low-latency dispatch of this rank against the oracle: counts, rows, scales in DeepEP's
    column-major layout (UE8M0-packed when asked), and the handle's src_info / layout_range."""
    if isinstance(got[0], tuple):
        (rx, scales), counts, handle, _, _ = got
    else:  # use_fp8=False: BF16 rows, no scales
        (rx, scales), counts, handle = (got[0], None), got[1], got[2]
    cpu = (lambda t: t.cpu()) if rx.device.type != "cpu" else (lambda t: t)
    if scales is None:
        scales = torch.zeros(rx.shape[0], rx.shape[1], rx.shape[2] // M.BLOCK).transpose(1, 2).contiguous().transpose(1, 2)
    strides = scales.stride()
    rx, scales, counts = cpu(rx), cpu(scales), cpu(counts)
    handle = (cpu(handle[0]), cpu(handle[1]), *handle[2:])
    T, E, W = cfg["max_tokens"], cfg["experts"], cfg["ranks"]
    L, Mr = E // W, W * T
    ref_x, ref_s, ref_counts, ref_src = M.reference_dispatch(
        [(xd, xs, idx, None) for (xd, xs), (_, idx, _) in zip(forms, inputs)], num_experts=E, max_tokens=T, rank=rank)
    bad = []
    if not torch.equal(counts, ref_counts):
        return [f"{tag}: recv_count {counts.tolist()} != {ref_counts.tolist()}"]
    G = cfg["hidden"] // M.BLOCK
    ue8m0 = cfg.get("ue8m0", False)
    want_shape = (L, Mr, G // 4 if ue8m0 else G)
    if tuple(scales.shape) != want_shape or strides[1] != 1 or strides[2] != Mr:
        bad.append(f"{tag}: scales shape {list(scales.shape)} strides {strides}, not column-major {want_shape}")
    unpacked = unpack_ue8m0(scales) if ue8m0 else scales
    src_info, layout_range, t_, h_, e_ = handle
    if (t_, h_, e_) != (T, cfg["hidden"], E):
        bad.append(f"{tag}: handle dims {(t_, h_, e_)}")
    for el in range(L):
        c = int(counts[el])
        if not torch.equal(rx[el, :c].view(torch.uint8), ref_x[el, :c].view(torch.uint8)):
            bad.append(f"{tag} expert {rank * L + el}: rows differ")
        if ref_s is not None and not torch.equal(unpacked[el, :c], ref_s[el, :c]):
            bad.append(f"{tag} expert {rank * L + el}: scales differ")
        if not torch.equal(src_info[el, :c], ref_src[el, :c] % T):
            bad.append(f"{tag} expert {rank * L + el}: src_info differs")
        for s in range(W):
            rows = ref_src[el, :c] // T == s
            n = int(rows.sum())
            first = int(rows.nonzero()[0]) if n else 0
            # As DeepEP's test_low_latency.py reads it: begin in the high 32 bits, count in the low.
            got_first, got_n = int(layout_range[el, s]) >> 32, int(layout_range[el, s]) & 0xFFFFFFFF
            if got_n != n or (n and got_first != first):
                bad.append(f"{tag} expert {rank * L + el} source {s}: layout_range ({got_n}, {got_first}) != ({n}, {first})")
    return bad


def deep_ep_results(procs: list, timeout: float = 180, started: bool = False) -> None:
    """Waits for every rank of deep_ep_rank_main (procs: [(conn, process)]) and asserts that each
    found nothing wrong and refused everything it had to (started: their "ready" was read)."""
    for r, (conn, _) in enumerate(procs if not started else []):
        assert conn.poll(timeout), f"rank {r} did not start"
        msg = conn.recv()
        assert msg == "ready", f"rank {r}: {msg}"
    for r, (conn, _) in enumerate(procs):
        got = {}
        while True:
            assert conn.poll(timeout), f"rank {r}: no message after {list(got)}"
            msg = conn.recv()
            assert not (isinstance(msg, str) and msg.startswith("error")), f"rank {r}: {msg}"
            if msg == "bye":
                break
            got[msg[0]] = msg[1]
        assert got["ok"] == [], f"rank {r}: {got['ok'][:5]}"
        assert got["refusals"] == [], f"rank {r}: {got['refusals']}"


def deep_ep_rank_main(conn, cfg: dict) -> None:
    """One rank of a DeepEP-style job over fabric_lib.moe.deep_ep.Buffer (host kernels, or CUDA
    kernels with cfg["device"] "cuda"): two batches in flight (the second with
    return_recv_hook), FP8 with round_scale + UE8M0 on even steps, the identity expert, every
    output against the oracle; then the refusals."""
    import torch.distributed as dist

    from fabric_lib.moe import deep_ep

    try:
        torch.set_num_threads(1)
        dev = torch.device(cfg.get("device", "cpu"))
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        rank, W, T, E, K, H = cfg["rank"], cfg["ranks"], cfg["max_tokens"], cfg["experts"], cfg["topk"], cfg["hidden"]
        store = dist.TCPStore("127.0.0.1", cfg["port"], is_master=False, wait_for_workers=False)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=W)
        with engine_of(cfg) as engine:
            buf = deep_ep.Buffer(None, 0, deep_ep.Buffer.get_low_latency_rdma_size_hint(T, H, W, E), low_latency_mode=True,
                                 num_qps_per_rank=E // W, engine=engine, node_size=cfg["node_size"], timeout_s=60.0,
                                 allow_nvlink_for_low_latency_mode=cfg.get("allow_nvlink", True),
                                 explicitly_destroy=True, enable_shrink=False)
            if buf.node_size != (cfg["node_size"] if cfg.get("allow_nvlink", True) else 1):
                raise AssertionError(f"node_size {buf.node_size}")
            check_host_wait(buf, W)
            conn.send("ready")
            bad = []
            stats = torch.zeros(E // W, dtype=torch.int32, device=dev)  # batch A's counts, summed
            want_stats = torch.zeros(E // W, dtype=torch.int32)
            for step in range(1, cfg["steps"] + 1):
                ue8m0 = step % 2 == 0
                c = dict(cfg, ue8m0=ue8m0)
                batches = []
                for b in range(2):  # dispatch A, dispatch B (B received through its hook)
                    inputs = [make_input(cfg, s, 10 * step + b) for s in range(W)]
                    x, idx, w = (t.to(dev) for t in inputs[rank])
                    idx = idx.to(deep_ep.topk_idx_t)  # as DeepEP's test casts its routing
                    got = buf.low_latency_dispatch(x, idx, T, E, use_fp8=True, round_scale=ue8m0, use_ue8m0=ue8m0,
                                                   return_recv_hook=b == 1, async_finish=b == 0,
                                                   cumulative_local_expert_recv_stats=stats if b == 0 else None)
                    got[3].current_stream_wait()
                    batches.append((inputs, got))
                batches[1][1][4]()  # B's receive hook
                outs = []
                for b, (inputs, got) in enumerate(batches):
                    quant = M.quantize_fp8_tokens_pow2 if ue8m0 else M.quantize_fp8_tokens
                    forms = [quant(x) for x, _, _ in inputs]
                    tag = f"step {step} batch {'AB'[b]}"
                    bad += deep_ep_problems(c, buf, rank, inputs, forms, got, tag)
                    if b == 0:
                        want_stats += got[1].cpu()
                    (rx, scales), _, handle, _, _ = got
                    rs = unpack_ue8m0(scales) if ue8m0 else scales
                    y = M.dequantize_fp8_tokens(rx, rs).to(torch.bfloat16)  # the identity expert
                    x, idx, w = (t.to(dev) for t in inputs[rank])
                    out, _, hook = buf.low_latency_combine(y, idx, w, handle, return_recv_hook=b == 0)
                    outs.append((out, hook, forms[rank], idx.cpu(), w.cpu(), tag))
                for out, hook, (xq, xs), idx, w, tag in outs:
                    hook()  # A's combine receive
                    out = out.cpu()
                    rows = M.dequantize_fp8_tokens(xq, xs).to(torch.bfloat16).unsqueeze(1).expand(-1, K, -1)
                    want = M.reference_combine_rows(idx, w, rows)
                    if not torch.equal(out.view(torch.int16), want.view(torch.int16)):
                        bad.append(f"{tag}: combine differs from the oracle")
            if not torch.equal(stats.cpu(), want_stats):
                bad.append(f"cumulative_local_expert_recv_stats {stats.tolist()} != {want_stats.tolist()}")
            bad += deep_ep_mixed_steps(cfg, buf, rank, dev)
            conn.send(("ok", bad))
            conn.send(("refusals", deep_ep_refusals(cfg, buf)))
            buf.destroy()
        dist.destroy_process_group()
        conn.send("bye")
    except Exception:  # noqa: BLE001 - the failure goes back to the test
        conn.send("error " + traceback.format_exc())


def deep_ep_mixed_steps(cfg: dict, buf, rank: int, dev: torch.device) -> list:
    """DeepEP's test habits on one Buffer: use_fp8 switched every call, some dispatches never
    combined (their buffer set is reused two dispatches later), some combined twice (the second
    time with the expert outputs written into get_next_low_latency_combine_buffer and zero_copy);
    a late combine of a dropped dispatch raises. Every dispatch and combine against the oracle."""
    from fabric_lib.moe import deep_ep

    T, E, K, W = cfg["max_tokens"], cfg["experts"], cfg["topk"], cfg["ranks"]
    bad, dropped = [], []
    waits = [torch.zeros(W, dtype=torch.int64, device=dev) for _ in range(2)]  # dispatch, combine
    for i in range(6):
        use_fp8, drop, zero_copy = i % 2 == 0, i in (0, 3), i in (2, 5)
        inputs = [make_input(cfg, s, 100 + i) for s in range(W)]
        x, idx, w = (t.to(dev) for t in inputs[rank])
        got = buf.low_latency_dispatch(x, idx.to(deep_ep.topk_idx_t), T, E, use_fp8=use_fp8,
                                       dispatch_wait_recv_cost_stats=waits[0])
        forms = [M.quantize_fp8_tokens(x) if use_fp8 else (x, None) for x, _, _ in inputs]
        tag = f"mixed call {i} ({'fp8' if use_fp8 else 'bf16'})"
        bad += deep_ep_problems(dict(cfg, ue8m0=False), buf, rank, inputs, forms, got, tag)
        handle = got[2]
        if drop:
            dropped.append(handle)
            continue
        y = M.dequantize_fp8_tokens(*got[0]).to(torch.bfloat16) if use_fp8 else got[0].clone()
        xq, xs = forms[rank]
        rows = (M.dequantize_fp8_tokens(xq, xs).to(torch.bfloat16) if use_fp8 else xq).unsqueeze(1).expand(-1, K, -1)
        # As DeepEP's test: combined without zero_copy, then again with it (other values: negated).
        for again in ((False, True) if zero_copy else (False,)):
            sign = -1 if again else 1
            expert_out = sign * y
            if again:
                buf.get_next_low_latency_combine_buffer(handle).copy_(expert_out)
                expert_out = torch.empty_like(y)  # what the caller passes is not read with zero_copy
            out, _, _ = buf.low_latency_combine(expert_out, idx, w, handle, zero_copy=again,
                                                combine_wait_recv_cost_stats=waits[1])
            want = M.reference_combine_rows(idx.cpu(), w.cpu(), sign * rows)
            if not torch.equal(out.cpu().view(torch.int16), want.view(torch.int16)):
                bad.append(f"{tag}: {'the second' if again else 'the'} combine differs from the oracle")
    for name, t in zip(("dispatch", "combine"), waits):
        t = t.cpu()
        if (t < 0).any() or t.sum() <= 0 or t.max() > 600e9:
            bad.append(f"{name}_wait_recv_cost_stats {t.tolist()}: not a plausible wait in ns per source")
    # Call 0's set was taken by call 4 (the FP8 AllToAll's third dispatch): its handle is spent.
    y = torch.zeros(E // W, W * T, cfg["hidden"], dtype=torch.bfloat16, device=dev)
    x, idx, w = (t.to(dev) for t in make_input(cfg, rank, 100))
    bad.append(_expect("late combine of a dropped dispatch", fl.FabricError, "took its buffer set",
                       lambda: buf.low_latency_combine(y, idx, w, dropped[0])))
    return [b for b in bad if b]


def deep_ep_refusals(cfg: dict, buf) -> list:
    """What the shim must refuse, each before anything is sent (every rank makes the same calls)."""
    from fabric_lib.moe import deep_ep

    T, E, K, H = cfg["max_tokens"], cfg["experts"], cfg["topk"], cfg["hidden"]
    dev = torch.device(cfg.get("device", "cpu"))
    x = torch.zeros(2, H, dtype=torch.bfloat16, device=dev)
    idx = torch.full((2, K), -1, dtype=torch.int64, device=dev)
    w = torch.ones(2, K, device=dev)
    y = torch.zeros(E // cfg["ranks"], cfg["ranks"] * T, H, dtype=torch.bfloat16, device=dev)
    cases = [
        ("ue8m0 without round_scale", ValueError, "use_ue8m0 needs round_scale",
         lambda: buf.low_latency_dispatch(x, idx, T, E, use_ue8m0=True)),
        ("wait stats of the wrong shape", ValueError, f"dispatch_wait_recv_cost_stats must have shape [{cfg['ranks']}]",
         lambda: buf.low_latency_dispatch(x, idx, T, E, dispatch_wait_recv_cost_stats=torch.zeros(1, dtype=torch.int64,
                                                                                                  device=dev))),
        ("other shape", ValueError, "use one Buffer per shape", lambda: buf.low_latency_dispatch(x, idx, T + 1, E)),
        ("fp32 x", TypeError, "x must be torch.bfloat16", lambda: buf.low_latency_dispatch(x.float(), idx, T, E)),
        ("logfmt", NotImplementedError, "use_logfmt", lambda: buf.low_latency_combine(y, idx, w, None, use_logfmt=True)),
        ("not a handle", TypeError, "handle must be", lambda: buf.low_latency_combine(y, idx, w, (None,) * 5)),
        ("combine buffer of no handle", TypeError, "handle must be", lambda: buf.get_next_low_latency_combine_buffer(None)),
        ("normal mode", NotImplementedError, "normal (high-throughput) mode", lambda: buf.dispatch(x, topk_idx=idx)),
        ("normal layout", NotImplementedError, "normal (high-throughput) mode", lambda: buf.get_dispatch_layout(idx, E)),
        # DeepEP's constructor keywords: what cannot be honoured raises at construction, naming it.
        ("unknown keyword", TypeError, "'num_qp_per_rank'",
         lambda: deep_ep.Buffer(None, 0, 0, low_latency_mode=True, num_qp_per_rank=4, engine=buf.engine)),
        ("mask without shrink mode", RuntimeError, "enable_shrink=True",
         lambda: buf.low_latency_query_mask_buffer(torch.zeros(cfg["ranks"], dtype=torch.int))),
        ("mask update without shrink mode", RuntimeError, "enable_shrink=True",
         lambda: buf.low_latency_update_mask_buffer(0, True)),
        ("fabric memory", NotImplementedError, "use_fabric",
         lambda: deep_ep.Buffer(None, 0, 0, low_latency_mode=True, use_fabric=True, engine=buf.engine)),
        ("mpi comm", NotImplementedError, "comm", lambda: deep_ep.Buffer(None, comm=object(), engine=buf.engine)),
        ("unknown host_wait", ValueError, "host_wait must be one of",
         lambda: deep_ep.Buffer(None, engine=buf.engine, host_wait="busy")),
        ("destroy without explicitly_destroy", RuntimeError, "explicitly_destroy=True",
         lambda: deep_ep.Buffer(None, engine=buf.engine, node_size=buf.node_size).destroy()),
    ]
    if dev.type == "cuda":  # shrink mode runs on the host kernels only, for now
        cases.append(("shrink mode on CUDA", NotImplementedError, "enable_shrink",
                      lambda: deep_ep.Buffer(None, 0, 0, low_latency_mode=True, enable_shrink=True)))
    return [f for f in (_expect(*c) for c in cases) if f]


def check_host_wait(buf, ranks_on_host: int) -> None:
    """The Buffer's host_wait="auto" took the mode its rule gives for this host (all ranks of these
    tests share one host) and the current CUDA context runs with it; None without CUDA."""
    from fabric_lib.moe import host_wait

    if not torch.cuda.is_available():
        if buf.host_wait is not None:
            raise AssertionError(f"host_wait {buf.host_wait!r} without CUDA")
        return
    want = host_wait.choose("auto", ranks_on_host)
    if (buf.host_wait, host_wait.context_mode()) != (want, want):
        raise AssertionError(f"host_wait: Buffer took {buf.host_wait!r}, the context runs {host_wait.context_mode()!r}, "
                             f"the rule gives {want!r} for {ranks_on_host} ranks on {host_wait.host_cores()} cores")


def deep_ep_groups_rank_main(conn, cfg: dict) -> None:
    """One rank of a world split into EP groups of cfg["group"] ranks, each group a Buffer of its
    own, all dispatching at once: every rank's rows must come from its own group (the oracle over
    its group's inputs; the groups' inputs differ), and a second Buffer given the first's job is
    refused."""
    import torch.distributed as dist

    from fabric_lib.moe import deep_ep

    try:
        torch.set_num_threads(1)
        rank, W, G = cfg["rank"], cfg["ranks"], cfg["group"]
        store = dist.TCPStore("127.0.0.1", cfg["port"], is_master=False, wait_for_workers=False)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=W)
        groups = [dist.new_group(list(range(g, g + G))) for g in range(0, W, G)]  # every rank makes every group
        mine, gi = groups[rank // G], rank // G
        gcfg = dict(cfg, ranks=G, seed=7 + 100 * gi)  # each group's own inputs
        T, E, K = cfg["max_tokens"], cfg["experts"], cfg["topk"]
        with engine_of(cfg) as engine:
            buf = deep_ep.Buffer(mine, 0, 0, low_latency_mode=True, engine=engine, node_size=cfg["node_size"],
                                 timeout_s=60.0)
            conn.send("ready")
            bad = []
            me = dist.get_rank(mine)
            for step in range(3):
                inputs = [make_input(gcfg, s, step) for s in range(G)]
                x, idx, w = inputs[me]
                got = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)
                bad += deep_ep_problems(dict(gcfg, ue8m0=False), buf, me, inputs, [(x_, None) for x_, _, _ in inputs],
                                        got, f"group {gi} step {step}")
                out, _, _ = buf.low_latency_combine(got[0].clone(), idx, w, got[2])
                want = M.reference_combine_rows(idx, w, x.unsqueeze(1).expand(-1, K, -1))
                if not torch.equal(out.view(torch.int16), want.view(torch.int16)):
                    bad.append(f"group {gi} step {step}: combine differs")
            job = buf._options["job"]
            twin = deep_ep.Buffer(mine, engine=engine, node_size=cfg["node_size"], job=job)
            x, idx, _ = make_input(gcfg, me, 0)
            bad.append(_expect("a second Buffer under the first's job", ValueError, "already has a live AllToAll",
                               lambda: twin.low_latency_dispatch(x, idx, T, E, use_fp8=False)))
            conn.send(("ok", [b for b in bad if b]))
            conn.send(("refusals", []))
            del twin
            del buf
        dist.destroy_process_group()
        conn.send("bye")
    except Exception:  # noqa: BLE001 - the failure goes back to the test
        conn.send("error " + traceback.format_exc())


def deep_ep_shrink_rank_main(conn, cfg: dict) -> None:
    """One rank of a 4-rank DeepEP job (host kernels, 2 nodes of 2) in which rank 3 kills itself
    (SIGKILL) after step 1. With enable_shrink the survivors mask it after one timeout at step 2's
    dispatch, as DeepEP's shrink test expects (low_latency_query_mask_buffer shows it on every
    survivor), and steps 2 and 3 are exact against the oracle of the survivors' routing (rank 3
    sends nothing; combine leaves out its experts' slots); clean_low_latency_buffer, the mask
    updates and low_latency_clean_mask_buffer then work as DeepEP documents them. Without
    enable_shrink the survivors' step 2 raises naming rank 3."""
    import re
    import signal

    import torch.distributed as dist

    from fabric_lib.moe import deep_ep

    try:
        torch.set_num_threads(1)
        rank, W, T, E = cfg["rank"], cfg["ranks"], cfg["max_tokens"], cfg["experts"]
        L, gone, shrink = E // W, cfg["gone"], cfg["shrink"]
        store = dist.TCPStore("127.0.0.1", cfg["port"], is_master=False, wait_for_workers=False)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=W)
        with engine_of(cfg) as engine:
            buf = deep_ep.Buffer(None, engine=engine, node_size=cfg["node_size"], timeout_s=cfg["timeout_s"],
                                 explicitly_destroy=True, enable_shrink=shrink)
            conn.send("ready")
            bad, mask = [], torch.zeros(W, dtype=torch.int)
            for step in (1, 2, 3):
                if step == 2 and rank == gone:
                    os.kill(os.getpid(), signal.SIGKILL)
                # FP8 at step 2 in shrink mode (both AllToAlls were built at step 1); without it a
                # new dtype would build its AllToAll collectively, waiting init_timeout_s for rank 3.
                use_fp8 = shrink and step == 2
                inputs = [make_input(cfg, s, step) for s in range(W)]
                if step >= 2:  # what the survivors' outputs must equal: rank 3 sent nothing
                    x3, idx3, w3 = inputs[gone]
                    inputs[gone] = (x3[:0], idx3[:0], w3[:0])
                x, idx, w = inputs[rank]
                forms = [M.quantize_fp8_tokens(xs) if use_fp8 else (xs, None) for xs, _, _ in inputs]
                tag = f"step {step}"
                try:
                    got = buf.low_latency_dispatch(x, idx, T, E, use_fp8=use_fp8)
                except fl.FabricError as e:
                    if not shrink and step == 2 and re.search(r"ranks? \[?3\b", str(e)):  # names it
                        conn.send(("ok", bad))
                        conn.send(("refusals", []))
                        conn.send("bye")
                        os._exit(0)  # a failed AllToAll: nothing more to check or to release cleanly
                    raise
                if not shrink and step == 2:
                    bad.append("step 2 without shrink mode did not raise")
                if shrink:
                    buf.low_latency_query_mask_buffer(mask)
                    want = [1 if (r == gone and step >= 2) else 0 for r in range(W)]
                    if mask.tolist() != want:
                        bad.append(f"{tag}: mask {mask.tolist()} != {want}")
                bad += deep_ep_problems(dict(cfg, ue8m0=False), buf, rank, inputs, forms, got, tag)
                y = M.dequantize_fp8_tokens(*got[0]).to(torch.bfloat16) if use_fp8 else got[0].clone()
                out, _, _ = buf.low_latency_combine(y, idx, w, got[2])
                xq, xs = forms[rank]
                rows = (M.dequantize_fp8_tokens(xq, xs).to(torch.bfloat16) if use_fp8 else xq)
                live_idx = idx.clone()
                if step >= 2:
                    live_idx[(idx >= 0) & (idx // L == gone)] = -1  # its experts' slots count as weight 0
                want_out = M.reference_combine_rows(live_idx, w, rows.unsqueeze(1).expand(-1, idx.shape[1], -1))
                if not torch.equal(out.view(torch.int16), want_out.view(torch.int16)):
                    bad.append(f"{tag}: combine differs from the survivors' oracle")
            buf.clean_low_latency_buffer(T, cfg["hidden"], E)  # the survivors all arrive
            for masked, want in ((False, [0] * W), (True, [int(r == gone) for r in range(W)])):
                buf.low_latency_update_mask_buffer(gone, masked)
                buf.low_latency_query_mask_buffer(mask)
                if mask.tolist() != want:
                    bad.append(f"update_mask_buffer({gone}, {masked}): mask {mask.tolist()}")
            buf.low_latency_clean_mask_buffer()
            buf.low_latency_query_mask_buffer(mask)
            if mask.tolist() != [0] * W:
                bad.append(f"after clean_mask_buffer: mask {mask.tolist()}")
            conn.send(("ok", bad))
            conn.send(("refusals", []))
            buf.destroy()
        dist.destroy_process_group()
        conn.send("bye")
    except Exception:  # noqa: BLE001 - the failure goes back to the test
        conn.send("error " + traceback.format_exc())
