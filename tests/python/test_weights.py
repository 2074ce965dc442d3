"""RL weight updates between processes: 4 training ranks (PyTorch on CPU, FSDP2-style shards) write
a small MoE transformer into 2 inference ranks (fused qkv and gate_up, FP8 block quantization) over
tcp;ofi_rxm (and shm), 20 steps of changing weights, every inference byte equal to the reference
transform of the full weights; the torch unit hook (what CUDA arenas use) against the C++ one; a
training rank killed mid-update, and a restarted training job the inference ranks rejoin."""

import os
import sys
import time
import uuid

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples", "rl_weights"))

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import fabric_lib as fl  # noqa: E402
import moe as R  # noqa: E402
from fabric_lib import weights as W  # noqa: E402


@pytest.fixture
def store_port():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield store.port
    del store


def _start_all(peer, port, job, train_cfg, infer_cfg, overrides=None):
    """Every rank of both sides (they find each other through the store: all must start before
    any is ready); overrides: per training rank, config entries that replace train_cfg's."""
    ranks = []
    for r in range(R.INFER):
        ranks.append(("i", r, *peer(R.inference, dict(port=port, job=job, rank=r, **infer_cfg))))
    for r in range(R.TRAIN):
        cfg = dict(port=port, job=job, rank=r, **train_cfg)
        cfg.update((overrides or {}).get(r, {}))
        ranks.append(("t", r, *peer(R.trainer, cfg)))
    for side, r, conn, _ in ranks:
        assert conn.poll(120), f"{side}{r} did not start"
        msg = conn.recv()
        assert msg == "ready", msg
    return ranks


def _results(conn, n, timeout=120):
    out = []
    while len(out) < n:
        assert conn.poll(timeout), f"no result after {out}"
        msg = conn.recv()
        assert not (isinstance(msg, str) and msg.startswith("error")), msg
        if msg == "bye":
            break
        out.append(msg)
    return out


@pytest.mark.parametrize("provider,hook,window,owner_rows", [
    ("tcp;ofi_rxm", "auto", 2, 0), ("shm", "auto", 1, 0), ("tcp;ofi_rxm", "torch", 3, 128)])
def test_twenty_steps_land_bit_for_bit_in_every_inference_buffer(peer, store_port, provider, hook, window,
                                                                 owner_rows):
    steps = list(range(20))
    job = uuid.uuid4().hex
    common = dict(provider=provider, steps=steps, owner_rows=owner_rows)
    ranks = _start_all(peer, store_port, job, dict(hook=hook, window=window, **common), common)
    trained = _landed_exactly(ranks, steps)
    assert len(trained) == R.TRAIN
    assert all(times["writes"] > 0 for got in trained for times in got)


def _landed_exactly(ranks, steps):
    """Every rank reports every step ok, every inference rank with no buffer differing from the
    reference; returns each training rank's UpdateTimes per step."""
    trained = []
    for side, r, conn, _ in ranks:
        got = _results(conn, len(steps))
        assert [m[0] for m in got] == ["ok"] * len(steps), (side, r, got[-1])
        if side == "i":
            for _, step, bad in got:
                assert bad == [], f"inference rank {r} step {step}: {bad} differ from the reference"
        else:
            trained.append([m[2] for m in got])
    return trained


def test_a_trainer_killed_mid_update_fails_the_step_and_a_restarted_job_lands_whole(peer, store_port):
    """Training rank 2 dies after quantizing two units of step 3: every inference rank fails the
    step within its timeout naming rank 2, keeps step 2's weights in the other buffer set, and
    rejoins a restarted training job whose step 10 lands whole."""
    job, job2 = uuid.uuid4().hex, uuid.uuid4().hex
    common = dict(provider="tcp;ofi_rxm", timeout_s=8.0)
    infer = dict(steps=[0, 1, 2, 3], rejoin=dict(job=job2, steps=[10]), **common)
    ranks = _start_all(peer, store_port, job, dict(steps=[0, 1, 2, 3], hook="torch", **common), infer,
                       overrides={2: dict(kill_step=3)})
    conn2, proc2 = next((c, p) for side, r, c, p in ranks if side == "t" and r == 2)
    ranks = [x for x in ranks if not (x[0] == "t" and x[1] == 2)]
    t0 = time.monotonic()
    proc2.join(timeout=120)
    assert proc2.exitcode == 17, f"rank 2 should have died mid-update: {_results(conn2, 9, timeout=1)}"
    for side, r, conn, _ in ranks:
        got = _results(conn, 4)
        assert [m[0] for m in got[:3]] == ["ok"] * 3, (side, r, got)
        assert got[3][0] == "failed" and got[3][1] == 3, (side, r, got[3])
        if side == "i":
            assert "missing from training ranks" in got[3][2] and "2" in got[3][2].split("ranks")[-1], got[3][2]
            assert got[3][3] == [], f"inference rank {r}: step 2's set changed: {got[3][3]}"
            for _, step, bad in got[:3]:
                assert bad == []
        else:
            assert "timeout" in got[3][2] or "failed" in got[3][2], got[3][2]
    assert time.monotonic() - t0 < 60, "the failure took longer than the timeouts allow"
    # The restarted job: four fresh trainers under a new job name.
    fresh = []
    for r in range(R.TRAIN):
        fresh.append(peer(R.trainer, dict(port=store_port, job=job2, rank=r, steps=[10], provider="tcp;ofi_rxm")))
    for conn, _ in fresh:
        assert conn.poll(120) and conn.recv() == "ready"
    for conn, _ in fresh:
        assert [m[0] for m in _results(conn, 1)] == ["ok"]
    for side, r, conn, _ in ranks:
        if side == "i":
            got = _results(conn, 1)
            assert got == [("ok", 10, [])], got


# A model of 24 M parameters, 48 MiB moved per step (hidden 512, vocab 8192): the executor at a size
# where a column split's rows are runs of 512 and the gathers several MiB, on the 2-core machine.
SCALED = dict(hidden=512, inter=512, vocab=8192, layers=2, q_rows=1024, kv_rows=512)


@pytest.mark.parametrize("provider", ["tcp;ofi_rxm", "shm"])
def test_a_48_mib_model_lands_bit_for_bit_every_step(peer, store_port, provider):
    steps = [0, 1, 2]
    common = dict(provider=provider, steps=steps, model=SCALED)
    ranks = _start_all(peer, store_port, uuid.uuid4().hex, dict(window=2, **common), common)
    for got in _landed_exactly(ranks, steps):
        for times in got:
            assert times["bytes"] > 10 << 20 and times["requests"] < times["writes"], times


def test_a_trainer_killed_mid_update_of_a_48_mib_model_fails_every_rank_in_bounded_time(peer, store_port):
    """Training rank 1 dies after quantizing two units of step 1: the three other training ranks
    and both inference ranks end step 1 with an error (none hangs), within the 8 s timeout plus
    slack, and the inference ranks keep step 0's weights whole in the other buffer set."""
    common = dict(provider="tcp;ofi_rxm", timeout_s=8.0, steps=[0, 1], model=SCALED)
    ranks = _start_all(peer, store_port, uuid.uuid4().hex, dict(hook="torch", **common), common,
                       overrides={1: dict(kill_step=1)})
    dead = next(p for side, r, _, p in ranks if side == "t" and r == 1)
    t0 = time.monotonic()
    dead.join(timeout=120)
    assert dead.exitcode == 17, "rank 1 should have died mid-update"
    for side, r, conn, _ in ranks:
        if side == "t" and r == 1:
            continue
        got = _results(conn, 2, timeout=60)
        assert got[0][0] == "ok", (side, r, got)
        assert got[1][0] == "failed" and got[1][1] == 1, (side, r, got[1])
        if side == "i":
            assert got[0][2] == [] and got[1][3] == [], f"inference rank {r}: step 0's set changed: {got[1][3]}"
    assert time.monotonic() - t0 < 40, "the failure took longer than the 8 s timeouts allow"


def test_bad_pieces_are_rejected_with_a_clear_error(store_port):
    ps = R.params()
    with fl.TransferEngine(provider="tcp;ofi_rxm", nics=["127.0.0.1"]) as e:
        store = dist.TCPStore("127.0.0.1", store_port, is_master=False, wait_for_workers=False)
        kw = dict(rank=0, world=2, train_world=4, store=store, job=uuid.uuid4().hex)
        with pytest.raises(ValueError, match="no param named"):
            W.Inference(e, ps, [W.Piece("nope")], **kw)
        with pytest.raises(ValueError, match="outside"):
            W.Inference(e, ps, [W.Piece("embed", rows=(0, 10_000))], **kw)
        with pytest.raises(ValueError, match="aligned to 128"):
            W.Inference(e, ps, [W.Piece("l0.q", rows=(0, 100))], **kw)
        with pytest.raises(ValueError, match="same columns"):
            W.Inference(e, ps, [W.Piece("l0.q", buffer="x"), W.Piece("l0.o", buffer="x")], **kw)
        with pytest.raises(ValueError, match="mixes FP8 and BF16"):
            W.Inference(e, ps, [W.Piece("l0.q", buffer="x"), W.Piece("embed", buffer="x")], **kw)
    with pytest.raises(ValueError, match="equal parts"):
        W.even_split(10, 3, 0)


def test_torch_quantization_matches_the_reference_arithmetic():
    """quantize_fp8_blocks on partial edge blocks, zeros and extremes: scale = amax / 448, values
    within e4m3's range, and dequantization within half an e4m3 step of each value."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(300, 200, generator=g) * 3).to(torch.bfloat16)
    x[:128, :128] = 0
    x[200, 150] = 1e4
    q, s = W.quantize_fp8_blocks(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 2)
    assert s[0, 0] == 1.0 and torch.all(q[:128, :128].float() == 0)
    amax = x[128:256, 128:].float().abs().max()
    assert s[1, 1] == amax / 448
    back = q.float() * s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:300, :200]
    assert not torch.isnan(back).any()
    assert torch.all((back - x.float()).abs() <= x.float().abs() / 16 + s.max() * 2 ** -9)
