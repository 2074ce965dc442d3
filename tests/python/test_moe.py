"""MoE dispatch/combine from Python (fabric_lib.moe, host kernels), ranks as processes that meet in
a TCPStore: 4 ranks as 2 nodes over tcp;ofi_rxm and 8 ranks as 2 nodes over shm, hidden 2048 and
7168, skewed random routing with masked slots and ranks sending no tokens; every count, received
row and combined value checked against the oracle, bit for bit; identical inputs give identical
outputs; a rank killed mid-step fails the others within the timeout, naming it; refused input
changes nothing. The oracle's fp32 fused multiply-add emulation against libm's fmaf."""

import ctypes
import math
import os
import re
import sys
import time
import uuid

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import fabric_lib as fl  # noqa: E402
from fabric_lib import moe as M  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import moe_roles as R  # noqa: E402


@pytest.fixture
def store_port():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield store.port
    del store


def _start(peer, port, cfg, overrides=None):
    """Every rank (they meet in the store: all start before any is ready); returns [(conn, proc)]."""
    ranks = []
    for r in range(cfg["ranks"]):
        c = dict(cfg, port=port, rank=r)
        c.update((overrides or {}).get(r, {}))
        ranks.append(peer(R.rank_main, c))
    for r, (conn, _) in enumerate(ranks):
        assert conn.poll(180), f"rank {r} did not start"
        msg = conn.recv()
        assert msg == "ready", f"rank {r}: {msg}"
    return ranks


def _messages(conn, r, timeout=180):
    """Every message of rank r up to "bye"."""
    out = []
    while True:
        assert conn.poll(timeout), f"rank {r}: no message after {out[-3:]}"
        msg = conn.recv()
        assert not (isinstance(msg, str) and msg.startswith("error")), f"rank {r}: {msg}"
        if msg == "bye":
            return out
        out.append(msg)


def _case(provider, ranks, node_size, experts, topk, hidden, max_tokens, private_rows, dtype, **kw):
    return dict(provider=provider, ranks=ranks, node_size=node_size, experts=experts, topk=topk, hidden=hidden,
                max_tokens=max_tokens, private_rows=private_rows, dtype=dtype, job=uuid.uuid4().hex[:16], **kw)


@pytest.mark.parametrize("provider,ranks,node_size,experts,topk,hidden,max_tokens,private_rows,dtype,repeat", [
    # 4 ranks as 2 nodes: a private region smaller than most peers' rows; then 20 steps of one input.
    ("tcp;ofi_rxm", 4, 2, 16, 8, 2048, 24, 3, "fp8", 20),
    ("tcp;ofi_rxm", 4, 2, 8, 6, 2048, 16, 32, "bf16", 0),
    # 8 ranks as 2 nodes, hidden 7168.
    ("shm", 8, 4, 16, 8, 7168, 8, 4, "fp8", 0),
], ids=["tcp-4ranks-h2048-fp8", "tcp-4ranks-h2048-bf16", "shm-8ranks-h7168-fp8"])
def test_twenty_steps_match_the_oracle_bit_for_bit(peer, store_port, provider, ranks, node_size, experts, topk,
                                                    hidden, max_tokens, private_rows, dtype, repeat):
    cfg = _case(provider, ranks, node_size, experts, topk, hidden, max_tokens, private_rows, dtype,
                steps=20, repeat=repeat, full_oracle_steps=(1, 2))
    t0 = time.monotonic()
    procs = _start(peer, store_port, cfg)
    dispatch_us, combine_us = [], []
    for r, (conn, _) in enumerate(procs):
        got = _messages(conn, r)
        ok = [m for m in got if m[0] == "ok"]
        assert [m[1] for m in ok] == list(range(1, 21)), (r, got[-1])
        for _, step, info in ok:
            assert info["bad"] == [], f"rank {r}: {info['bad']}"
            dispatch_us.append(info["dispatch_s"] * 1e6)
            combine_us.append(info["combine_s"] * 1e6)
        last = ok[-1][2]
        assert last["writes"] > 0, "the proxy posted no writes between the nodes"
        # The proxy timed its waits on the other node (from its own post to the last immediate
        # counted). Its count of steps may lag by one: this rank's combine can end before its own
        # proxy has taken the last step's combine_sent.
        assert last["steps"] >= 19 and last["dispatch_wait_ms"] > 0 and last["combine_wait_ms"] > 0, last
        reps = [m for m in got if m[0] == "repeat"]
        assert len(reps) == repeat and all(m[2] for m in reps), f"rank {r}: repeated steps differ: {reps}"
    # The all-gather's keys are gone once every rank has read them.
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False, wait_for_workers=False)
    job = cfg["job"]
    left = [k for k in [f"{job}/a2a/{n}/{r}" for n in (0, 1) for r in range(ranks)] + [f"{job}/a2a/done"]
            if store.check([k])]
    assert left == [], left
    dispatch_us.sort()
    combine_us.sort()
    print(f"moe {provider} ranks={ranks} hidden={hidden} {dtype}: dispatch_us_p50={dispatch_us[len(dispatch_us) // 2]:.0f} "
          f"combine_us_p50={combine_us[len(combine_us) // 2]:.0f} wall_s={time.monotonic() - t0:.1f}")


def test_a_rank_killed_mid_step_fails_the_others_within_the_timeout_naming_it(peer, store_port):
    """Rank 3 exits right after its dispatch send of step 3: each other rank's step 3 fails (its
    dispatch or combine receive) within a bounded time, naming rank 3, and the failed AllToAll
    refuses later calls."""
    timeout_s = 2.5
    cfg = _case("tcp;ofi_rxm", 4, 2, 16, 4, 2048, 8, 2, "fp8", steps=5, timeout_s=timeout_s, light=True,
                kill_step=3, kill_rank=3, transfer_timeout_s=5.0)
    procs = _start(peer, store_port, cfg)
    conn3, proc3 = procs[3]
    proc3.join(timeout=120)
    assert proc3.exitcode == 17, "rank 3 should have exited mid-step"
    t_dead = time.monotonic()
    for r in range(3):
        got = _messages(procs[r][0], r)
        assert [m[1] for m in got if m[0] == "ok"] == [1, 2], (r, got)
        failed = got[-1]
        assert failed[0] == "failed" and failed[1] == 3, (r, failed)
        _, _, message, seconds, refusal = failed
        missing = re.search(r"ranks \[([0-9, ]*)\]", message)
        assert missing and 3 in [int(x) for x in missing.group(1).split(",")], f"rank {r}: {message}"
        assert message.startswith(("timeout", "provider")), message
        # A receive half waits at most timeout_s; dispatch and combine may both wait.
        assert seconds < 2 * timeout_s + 10, f"rank {r} took {seconds:.1f} s to fail"
        assert "failed earlier" in refusal, refusal
        print(f"moe-kill rank {r}: failed after {seconds:.2f} s: {message}")
    assert time.monotonic() - t_dead < 60


def test_bad_input_is_refused_clearly_and_the_next_step_is_exact(peer, store_port):
    cfg = _case("tcp;ofi_rxm", 2, 1, 8, 4, 256, 4, 2, "fp8", steps=2, bad_inputs=True, full_oracle_steps=(1, 2))
    procs = _start(peer, store_port, cfg)
    for r, (conn, _) in enumerate(procs):
        got = _messages(conn, r)
        kinds = {m[0]: m for m in got}
        assert kinds["bad_inputs"][1] == [], f"rank {r}: {kinds['bad_inputs'][1]}"
        assert kinds["bad_combines"][1] == [], f"rank {r}: {kinds['bad_combines'][1]}"
        ok = [m for m in got if m[0] == "ok"]
        assert [m[1] for m in ok] == [1, 2] and all(m[2]["bad"] == [] for m in ok), (r, got)


def test_bad_configs_are_refused_before_any_rank_is_waited_for():
    with fl.TransferEngine(provider="tcp;ofi_rxm", nics=["127.0.0.1"]) as e:
        store = dist.HashStore()
        kw = dict(rank=0, world_size=2, node_size=1, num_experts=8, experts_per_token=4, hidden=256, max_tokens=4,
                  store=store, init_timeout_s=1.0)
        with pytest.raises(fl.FabricError, match="experts 7: a positive multiple of ranks 2"):
            M.AllToAll(e, **dict(kw, num_experts=7))
        with pytest.raises(fl.FabricError, match="hidden 200"):
            M.AllToAll(e, **dict(kw, hidden=200))
        with pytest.raises(fl.FabricError, match="job 'a/b'"):
            M.AllToAll(e, **dict(kw, job="a/b"))
        with pytest.raises(fl.FabricError, match=r"buffers 5 \(1 to 4\)"):
            M.AllToAll(e, **dict(kw, buffers=5))
        with pytest.raises(ValueError, match="dispatch_dtype"):
            M.AllToAll(e, **dict(kw, dispatch_dtype="fp16"))
        with pytest.raises(ValueError, match="device"):
            M.AllToAll(e, **dict(kw, device="meta"))
        # The other rank never comes: the store wait times out naming it.
        with pytest.raises(fl.FabricError, match=r"ranks \[1\] did not publish"):
            M.AllToAll(e, **dict(kw, job="alone"))
        # A failed construction gave its job back: the same job may be built again.
        with pytest.raises(fl.FabricError, match=r"ranks \[1\] did not publish"):
            M.AllToAll(e, **dict(kw, job="alone"))


def test_default_jobs_are_unique_and_a_live_job_is_refused():
    """Two AllToAlls built with the default job in one store get different jobs (their
    construction keys and node regions never collide); a second live AllToAll of one job is
    refused by name, and closing the first gives the job back."""
    with fl.TransferEngine(provider="shm", nics=[""]) as e:
        store = dist.HashStore()
        kw = dict(rank=0, world_size=1, node_size=1, num_experts=4, experts_per_token=2, hidden=128, max_tokens=3,
                  dispatch_dtype="bf16", store=store)
        a, b = M.AllToAll(e, **kw), M.AllToAll(e, **kw)
        assert a.job != b.job and a.job.startswith("moe.") and b.job.startswith("moe."), (a.job, b.job)
        c = M.AllToAll(e, **dict(kw, job="serving"))
        with pytest.raises(ValueError, match="'serving': rank 0 already has a live AllToAll"):
            M.AllToAll(e, **dict(kw, job="serving"))
        c.close()
        M.AllToAll(e, **dict(kw, job="serving")).close()
        x, idx, w = R.make_input(dict(ranks=1, experts=4, topk=2, hidden=128, max_tokens=3, dtype="bf16", seed=1), 0, 2)
        for a2a in (a, b):  # both work, each with its own buffers
            rx, _, _, _, h = a2a.dispatch(x, idx)
            out = a2a.combine(rx.clone(), w, h)
            assert torch.equal(out, M.reference_combine_rows(idx, w, x.unsqueeze(1).expand(-1, 2, 128)))
        a.close()
        b.close()


def test_one_rank_alone_dispatches_and_combines_and_close_releases_it():
    """A single rank (one node, no proxy): outputs are views of the handle's buffer set, valid
    until close; two dispatches in flight, a third refused; a dispatch combined twice; spent
    handles refused; calls after close raise."""
    with fl.TransferEngine(provider="tcp;ofi_rxm", nics=["127.0.0.1"]) as e:
        cfg = dict(ranks=1, experts=4, topk=2, hidden=128, max_tokens=3, dtype="bf16")
        store = dist.HashStore()
        a2a = M.AllToAll(e, rank=0, world_size=1, node_size=1, num_experts=4, experts_per_token=2, hidden=128,
                         max_tokens=3, dispatch_dtype="bf16", store=store, job="single")
        assert store.num_keys() == 1, "the all-gather left keys in the store (only the live-job key stays)"
        assert a2a.buffers == 2
        x, idx, w = R.make_input(dict(cfg, seed=3), 0, 2)
        h = a2a.dispatch_send(x, idx)
        assert isinstance(h, M.Handle) and (h.buffer, h.step, h.num_tokens) == (0, 1, 3)
        # A second batch in flight goes to the other buffer set; a third, to the first's set while
        # the first is not yet received, is refused.
        x2, idx2, w2 = R.make_input(dict(cfg, seed=4), 0, 2)
        h2 = a2a.dispatch_send(x2[:2], idx2[:2])
        with pytest.raises(fl.FabricError, match="at most 2 dispatches in flight .* 'dispatch sent': receive it"):
            a2a.dispatch_send(x2, idx2)
        rx, rs, counts, src = a2a.dispatch_recv(h)
        assert rs is None and rx.shape == (4, 3, 128) and src.shape == (4, 3) and counts.dtype == torch.int32
        assert counts.tolist() == torch.bincount(idx[idx >= 0], minlength=4).tolist()
        rx2, _, counts2, _ = a2a.dispatch_recv(h2)
        assert h2.buffer == 1 and rx2.data_ptr() != rx.data_ptr()
        assert counts2.tolist() == torch.bincount(idx2[:2][idx2[:2] >= 0], minlength=4).tolist()
        out = torch.empty(3, 128, dtype=torch.bfloat16)
        assert a2a.combine(rx.clone(), w, h, out) is out  # expert = identity
        assert torch.equal(out, M.reference_combine_rows(idx, w, x.unsqueeze(1).expand(3, 2, 128)))
        a2a.combine_send(rx2.clone(), h2)
        out2 = a2a.combine_recv(w2[:2], h2)
        assert torch.equal(out2, M.reference_combine_rows(idx2[:2], w2[:2], x2[:2].unsqueeze(1).expand(2, 2, 128)))
        # A dispatch may be combined again (DeepEP's test combines each twice), here with the
        # expert outputs negated, until its set is taken.
        assert torch.equal(a2a.combine(-rx, w, h), M.reference_combine_rows(idx, w, -x.unsqueeze(1).expand(3, 2, 128)))
        # A dispatch never combined is dropped when its set is next needed (DeepEP's semantics).
        *_, h3 = a2a.dispatch(x, idx)
        with pytest.raises(fl.FabricError, match="the handle of dispatch 1 is spent"):
            a2a.combine(rx, w, h)
        a2a.dispatch(x2, idx2)
        rx5, _, counts5, _, h5 = a2a.dispatch(x, idx)
        assert h5.buffer == h3.buffer and counts5.tolist() == counts.tolist()
        with pytest.raises(fl.FabricError, match="dispatch 5 took its buffer set 0"):
            a2a.combine(rx, w, h3)
        assert torch.equal(a2a.combine(rx5.clone(), w, h5), M.reference_combine_rows(idx, w, x.unsqueeze(1).expand(3, 2, 128)))
        assert a2a.proxy_stats().writes == 0 and a2a.config.ranks == 1
        a2a.check()
        a2a.close()
        with pytest.raises(RuntimeError, match="closed"):
            a2a.dispatch(x, idx)


def test_the_oracles_fma_is_libms_fmaf_even_where_float64_rounds_twice():
    """fma_fp32 against libm's fmaf: random values, and products landing near half an ulp of the
    accumulator, where w * x + acc in float64 then rounded to fp32 rounds twice."""
    libm = ctypes.CDLL("libm.so.6")
    libm.fmaf.restype = ctypes.c_float
    libm.fmaf.argtypes = [ctypes.c_float] * 3
    g = torch.Generator().manual_seed(5)
    n = 20000
    w = torch.rand(n, generator=g)
    x = (torch.randn(n, generator=g) * 8).to(torch.bfloat16).float()
    acc = torch.randn(n, generator=g) * torch.tensor([1e-6, 1.0, 1e3, 1e8])[torch.randint(0, 4, (n,), generator=g)]
    # Adversarial: acc with an odd last bit, w * x about an odd multiple of half its ulp (w rounded
    # to fp32 leaves the product a little off the tie: float64 rounds it onto it, then fp32 to even).
    e = torch.randint(-20, 20, (n,), generator=g).double()
    mant = torch.randint(0, 2**22, (n,), generator=g).double() * 2 + 1
    acc2 = ((1 + mant * 2.0**-23) * 2.0**e).float()
    xm = torch.randint(128, 256, (n,), generator=g).double() * 2.0 ** torch.randint(-10, 1, (n,), generator=g).double()
    w2 = (2.0 ** (e - 24) * torch.tensor([1.0, 3.0, 5.0]).double()[torch.randint(0, 3, (n,), generator=g)] / xm).float()
    ws, xs, accs = torch.cat([w, w2]), torch.cat([x, xm.float()]), torch.cat([acc, acc2])
    want = torch.tensor([libm.fmaf(a, b, c) for a, b, c in zip(ws.tolist(), xs.tolist(), accs.tolist())])
    got = M.fma_fp32(ws, xs, accs)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    naive = (ws.double() * xs.double() + accs.double()).float()
    assert not torch.equal(naive.view(torch.int32), want.view(torch.int32)), "no double-rounding case was hit"


def test_quantize_fp8_tokens_per_128_values():
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(3, 384, generator=g) * 5).to(torch.bfloat16)
    x[1, 128:256] = 0
    q, s = M.quantize_fp8_tokens(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 3) and s[1, 1] == 1.0
    assert s[0, 2] == x[0, 256:].float().abs().max() / 448
    back = M.dequantize_fp8_tokens(q, s)
    assert torch.all((back - x.float()).abs() <= x.float().abs() / 16 + 1e-6)


def test_quantize_fp8_tokens_pow2_scales_are_the_ceiling_power_of_two():
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(4, 512, generator=g) * 3).to(torch.bfloat16)
    x[0, :128] = 0  # amax below 1e-4: the floor's scale
    x[1, 0:128] = x[1, 0:128].clamp(-0.1, 0.1)
    x[1, 5] = 1.75 * 2**-3  # amax / 448 exactly 2^-11: that power, not the next
    x[2, 128:256] = x[2, 128:256].clamp(-0.1, 0.1)
    x[2, 130] = (1.75 + 2**-7) * 2**-3  # the next BF16 above it: the next power
    q, s = M.quantize_fp8_tokens_pow2(x)
    amax = x.float().view(4, 4, 128).abs().amax(dim=2).clamp(min=1e-4)
    v = amax / torch.full_like(amax, 448.0)  # the float32 quotient; log2 of it in double is exact enough
    assert s.tolist() == [[2.0 ** math.ceil(math.log2(a)) for a in row] for row in v.tolist()]
    assert s[1, 0] == 2**-11 and s[2, 1] == 2**-10
    assert torch.equal(q.view(torch.uint8), (x.float().view(4, 4, 128) / s.unsqueeze(2)).to(torch.float8_e4m3fn).view(4, 512).view(torch.uint8))
