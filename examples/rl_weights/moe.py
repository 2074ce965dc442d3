"""Training and inference ranks as processes, for examples/rl_weights/run.py and the weight-update
tests (tests/python/test_weights.py, tests/gpu/test_weights_gpu.py): a MoE transformer (by default
small: 2 layers, 8 experts, hidden 256; any size through Model), held by 4 training ranks (non-expert tensors FSDP over 4, experts
EP 2 x FSDP 2, shards as FSDP2 cuts them: torch.chunk along dim 0) and needed by 2 inference ranks
(TP 2 attention with fused qkv, EP 2 experts with fused gate_up, FP8 block-quantized matrices, BF16
embeddings, norms and routers). Every step's weights are a function of (step, tensor), so each side
knows them: training ranks write their shards, inference ranks check every byte they received
against the reference transform of the full tensors (on the arenas' device: CUDA ranks draw and
quantize the reference on the GPU, so a GiB-sized model is checked every step in milliseconds)."""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass

import torch

import fabric_lib as fl
from fabric_lib import weights as W

TRAIN, INFER = 4, 2


@dataclass(frozen=True)
class Model:
    """The transformer's dimensions. The default is the small example; scaled(n) multiplies every
    width by n (about n^2 the bytes)."""

    hidden: int = 256
    inter: int = 256
    vocab: int = 512
    layers: int = 2
    experts: int = 8
    q_rows: int = 512
    kv_rows: int = 256

    def scaled(self, n: int) -> "Model":
        return Model(self.hidden * n, self.inter * n, self.vocab * n, self.layers, self.experts, self.q_rows * n,
                     self.kv_rows * n)

    def check(self) -> None:
        """Every FP8 piece must be cut on 128 x 128 blocks, and the splits must be even."""
        for name in ("hidden", "inter", "q_rows", "kv_rows"):
            if getattr(self, name) % (128 * INFER):
                raise ValueError(f"{name}={getattr(self, name)} must be a multiple of {128 * INFER}")
        if self.vocab % INFER or self.experts % INFER or self.experts % 2 or self.layers < 1:
            raise ValueError(f"vocab and experts must split over {INFER} ranks and layers >= 1")

    def params(self) -> list:
        h, q, kv = self.hidden, self.q_rows, self.kv_rows
        ps = [W.Param("embed", (self.vocab, h))]
        for l in range(self.layers):
            ps += [W.Param(f"l{l}.attn_norm", (h,)),
                   W.Param(f"l{l}.q", (q, h), fp8=True),
                   W.Param(f"l{l}.k", (kv, h), fp8=True),
                   W.Param(f"l{l}.v", (kv, h), fp8=True),
                   W.Param(f"l{l}.o", (h, q), fp8=True),
                   W.Param(f"l{l}.mlp_norm", (h,)),
                   W.Param(f"l{l}.router", (self.experts, h))]
            for e in range(self.experts):
                ps += [W.Param(f"l{l}.e{e}.gate", (self.inter, h), fp8=True),
                       W.Param(f"l{l}.e{e}.up", (self.inter, h), fp8=True),
                       W.Param(f"l{l}.e{e}.down", (h, self.inter), fp8=True)]
        ps += [W.Param("norm", (h,)), W.Param("lm_head", (self.vocab, h))]
        return ps

    def train_pieces(self, rank: int) -> list:
        out = []
        for p in self.params():
            if is_expert(p.name):
                e = int(p.name.split(".")[1][1:])
                if e // (self.experts // 2) != rank // 2:
                    continue  # EP 2: the first half of the experts on ranks 0-1, the rest on ranks 2-3
                r = W.fsdp_rows(p.rows, 2, rank % 2)
            else:
                r = W.fsdp_rows(p.rows, TRAIN, rank)
            if r[1] > r[0]:
                out.append(W.Piece(p.name, rows=r))
        return out

    def infer_pieces(self, rank: int) -> list:
        q, kv = self.q_rows, self.kv_rows
        out = [W.Piece("embed", rows=W.even_split(self.vocab, INFER, rank))]
        for l in range(self.layers):
            out.append(W.Piece(f"l{l}.attn_norm"))
            out += [W.Piece(f"l{l}.q", rows=W.even_split(q, INFER, rank), buffer=f"l{l}.qkv"),
                    W.Piece(f"l{l}.k", rows=W.even_split(kv, INFER, rank), buffer=f"l{l}.qkv"),
                    W.Piece(f"l{l}.v", rows=W.even_split(kv, INFER, rank), buffer=f"l{l}.qkv")]
            out.append(W.Piece(f"l{l}.o", cols=W.even_split(q, INFER, rank)))
            out += [W.Piece(f"l{l}.mlp_norm"), W.Piece(f"l{l}.router")]
            for e in range(rank * self.experts // INFER, (rank + 1) * self.experts // INFER):
                out += [W.Piece(f"l{l}.e{e}.gate", buffer=f"l{l}.e{e}.gate_up"),
                        W.Piece(f"l{l}.e{e}.up", buffer=f"l{l}.e{e}.gate_up"),
                        W.Piece(f"l{l}.e{e}.down")]
        out += [W.Piece("norm"), W.Piece("lm_head", rows=W.even_split(self.vocab, INFER, rank))]
        return out

    def param_count(self) -> int:
        return sum(p.rows * p.cols for p in self.params())


def is_expert(name: str) -> bool:
    return ".e" in name and name.split(".")[1].startswith("e")


def _model(cfg: dict) -> Model:
    return Model(**cfg["model"]) if cfg.get("model") else Model()


# The default model's, for callers that need no other size.
def params() -> list:
    return Model().params()


def train_pieces(rank: int) -> list:
    return Model().train_pieces(rank)


def infer_pieces(rank: int) -> list:
    return Model().infer_pieces(rank)


def full_weight(step: int, index: int, p: W.Param, device: str = "cpu") -> torch.Tensor:
    """Tensor `index` at `step`, drawn on `device` (the same bits wherever the same device draws it)."""
    g = torch.Generator(device=device).manual_seed(step * 100_003 + index)
    return (torch.randn(p.rows, p.cols, generator=g, device=device) * 0.05).to(torch.bfloat16)


def expected_buffers(step: int, rank: int, model: Model = Model(), device: str = "cpu") -> dict:
    """What each buffer of inference rank `rank` must hold after `step`: (bytes, scale bytes)."""
    ps = model.params()
    index = {p.name: i for i, p in enumerate(ps)}
    parts, scales, order = {}, {}, []
    for piece in model.infer_pieces(rank):
        p = ps[index[piece.param]]
        b = piece.buffer or piece.param
        if b not in parts:
            order.append(b)
            parts[b], scales[b] = [], []
        r0, r1 = piece.rows or (0, p.rows)
        c0, c1 = piece.cols or (0, p.cols)
        full = full_weight(step, index[p.name], p, device)
        if p.fp8:
            q, s = W.quantize_fp8_blocks(full)
            parts[b].append(q[r0:r1, c0:c1].contiguous().view(torch.uint8))
            scales[b].append(s[r0 // 128:-(-r1 // 128), c0 // 128:-(-c1 // 128)].contiguous())
        else:
            parts[b].append(full[r0:r1, c0:c1].contiguous())
    return {b: (torch.cat(parts[b]), torch.cat(scales[b]) if scales[b] else None) for b in order}


def _engine(cfg: dict) -> fl.TransferEngine:
    """Host arenas over a loopback provider, or (cfg["gpu"]) CUDA arenas over cuda_ipc."""
    if cfg.get("gpu"):
        return fl.TransferEngine(cuda_device=0, cuda_ipc=True, transfer_timeout_s=5.0)
    provider = cfg["provider"]
    return fl.TransferEngine(provider=provider, nics=[""] if provider == "shm" else ["127.0.0.1"],
                             transfer_timeout_s=5.0)


def _device(cfg: dict) -> str:
    return "cuda:0" if cfg.get("gpu") else "cpu"


def _store(cfg: dict):
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", cfg["port"], is_master=False, wait_for_workers=False)


def _step_barrier(store, cfg: dict, step: int) -> None:
    """Every rank of both sides waits here before step `step` (cfg["step_barrier"]): the training
    ranks have written their shards and the inference ranks have checked the last step and said
    ready, so an update's time is the update's alone, not the reference's drawing or checking."""
    if not cfg.get("step_barrier"):
        return
    key = f"{cfg['job']}/step/{step}"
    if store.add(key + "/arrived", 1) == TRAIN + INFER:
        store.set(key + "/go", "1")
    store.wait([key + "/go"])


class _KillingTrainer(W.Trainer):
    """Dies (os._exit) in the middle of step kill_step, after quantizing its first unit."""

    kill_step = -1
    step = -1
    units = 0

    def _torch_hook(self, w):
        super()._torch_hook(w)
        if self.step == self.kill_step:
            self.units += 1
            if self.units == 2:
                os._exit(17)


# Immediates of the round-trip calibration, local values of the training ranks' immediate ranges
# (Trainer.imms): kind 0 (gather), step tag 1023, units 0xF000 and 0xF001, which no update of this
# example uses (its steps are few, its units far fewer than 0xF000).
_PING, _PONG = 0x03FFF000, 0x03FFF001


def write_rtt_us(engine: fl.TransferEngine, t: W.Trainer, rounds: int = 200) -> float:
    """Training ranks 0 and 1: the median round trip of a zero-byte WRITE with an immediate (rank 0
    sends, rank 1 answers), the latency every credit -> gather of an update pays. Rank 1 returns 0."""
    import time

    me, peer = (0, 1) if t.rank == 0 else (1, 0)
    times = []
    for _ in range(rounds):
        got = fl.DoneFlag()
        t.imms.expect(_PONG if me == 0 else _PING, 1, got, timeout_s=10.0)
        t0 = time.perf_counter()
        if me == 0:
            engine.submit_barrier(dsts=[t.train_descs[peer]], imm=_PING)
        if not got.wait(timeout=10) or not got.ok:
            raise RuntimeError("the round-trip calibration between training ranks 0 and 1 timed out")
        if me == 1:
            engine.submit_barrier(dsts=[t.train_descs[peer]], imm=_PONG)
        times.append((time.perf_counter() - t0) * 1e6)
    return sorted(times)[len(times) // 2] if me == 0 else 0.0


def predict(t: W.Trainer, engine: fl.TransferEngine, machine: dict, rtt_us: float, steps: list) -> dict:
    """The executor's cost model (weights_predict_update, include/fabric/weights/update.h) for this
    plan, fed with what was measured on this machine: the copy bandwidth (machine["link_gbs"], a
    contiguous device copy), the WRITE round trip (write_rtt_us, before the steps), and this rank's
    submit time per request and hook time per unit (medians over the steps' own timers)."""
    def median(xs):
        return sorted(xs)[len(xs) // 2] if xs else 0.0

    post_us = median([x["post_ms"] * 1e3 / max(1, x["requests"]) for x in steps])
    unit_us = median([x["quantize_ms"] * 1e3 / max(1, x["units_quantized"]) for x in steps])
    p = fl._fabric_lib.weights_predict_update(t.plan, link_gbs=machine["link_gbs"], post_us=post_us, unit_us=unit_us,
                                              write_rtt_us=rtt_us, one_device=machine.get("one_device", False),
                                              window=t.window, nics=engine.nic_count)
    p.update(post_us=post_us, unit_us=unit_us, write_rtt_us=rtt_us)
    return p


def trainer(conn, cfg: dict) -> None:
    try:
        torch.set_num_threads(1)
        rank, model, device = cfg["rank"], _model(cfg), _device(cfg)
        store = _store(cfg)
        with _engine(cfg) as engine:
            kind = _KillingTrainer if cfg.get("kill_step", -1) >= 0 else W.Trainer
            t = kind(engine, model.params(), model.train_pieces(rank), rank=rank, world=TRAIN, infer_world=INFER,
                     store=store, job=cfg["job"], window=cfg.get("window", 2), owner_rows=cfg.get("owner_rows", 0),
                     timeout_s=cfg.get("timeout_s", 60.0), hook=cfg.get("hook", "auto"), device=device,
                     trace=cfg.get("trace", False))
            t.kill_step = cfg.get("kill_step", -1)
            problem = fl._fabric_lib.weights_check_update(t.manifest, t.plan)
            conn.send("ready" if problem == "" else "error: the plan does not check: " + problem)
            ps = model.params()
            index = {p.name: i for i, p in enumerate(ps)}
            measured = []  # this rank's UpdateTimes, per step
            rtt_us = write_rtt_us(engine, t) if cfg.get("predict") and rank in (0, 1) else 0.0
            for step in cfg["steps"]:
                for piece in model.train_pieces(rank):
                    p = ps[index[piece.param]]
                    r0, r1 = piece.rows
                    t.shard(p.name).copy_(full_weight(step, index[p.name], p, device)[r0:r1])
                if cfg.get("gpu"):
                    torch.cuda.synchronize()
                _step_barrier(store, cfg, step)
                t.step = step
                try:
                    times = t.update(step)
                except fl.FabricError as e:
                    conn.send(("failed", step, str(e)))
                    break
                conn.send(("ok", step, times))
                measured.append(times)
            if cfg.get("predict") and rank == 0:
                conn.send(("predicted", predict(t, engine, cfg["predict"], rtt_us, measured)))
            t.close()
        conn.send("bye")
    except Exception:
        conn.send("error " + traceback.format_exc())


def _check(inf: W.Inference, step: int, buffer_set: int, rank: int, model: Model, device: str) -> list:
    """Buffers of `buffer_set` that differ from step's reference (compared on `device`)."""
    bad = []
    for name, (want, want_scale) in expected_buffers(step, rank, model, device).items():
        got = inf.buffer(name, buffer_set)
        got = got.view(torch.uint8) if got.dtype == torch.float8_e4m3fn else got
        if not torch.equal(got, want):
            bad.append(name)
        if want_scale is not None and not torch.equal(inf.scale(name, buffer_set), want_scale):
            bad.append(name + ".scale")
    return bad


def inference(conn, cfg: dict) -> None:
    try:
        torch.set_num_threads(1)
        rank, model, device = cfg["rank"], _model(cfg), _device(cfg)
        store = _store(cfg)
        with _engine(cfg) as engine:
            inf = W.Inference(engine, model.params(), model.infer_pieces(rank), rank=rank, world=INFER,
                              train_world=TRAIN, store=store, job=cfg["job"],
                              owner_rows=cfg.get("owner_rows", 0), device=device)
            conn.send("ready")
            last_ok = None
            for step in cfg["steps"]:
                try:
                    inf.ready(step)
                    _step_barrier(store, cfg, step)
                    s = inf.wait_update(step, timeout_s=cfg.get("timeout_s", 60.0))
                except fl.FabricError as e:
                    # The other set still holds the last complete step's weights.
                    kept = _check(inf, last_ok, last_ok % 2, rank, model, device) if last_ok is not None else []
                    conn.send(("failed", step, str(e), kept))
                    if cfg.get("rejoin"):
                        inf.reconnect(cfg["rejoin"]["job"])
                        for again in cfg["rejoin"]["steps"]:
                            s = inf.update(again, timeout_s=60.0)
                            conn.send(("ok", again, _check(inf, again, s, rank, model, device)))
                    break
                conn.send(("ok", step, _check(inf, step, s, rank, model, device)))
                last_ok = step
            inf.close()
        conn.send("bye")
    except Exception:
        conn.send("error " + traceback.format_exc())
