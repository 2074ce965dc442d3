"""Training and inference ranks as processes, for examples/rl_weights/run.py and the weight-update
tests (tests/python/test_weights.py, tests/gpu/test_weights_gpu.py): a small MoE transformer
(2 layers, 8 experts, hidden 256), held by 4 training ranks (non-expert tensors FSDP over 4, experts
EP 2 x FSDP 2, shards as FSDP2 cuts them: torch.chunk along dim 0) and needed by 2 inference ranks
(TP 2 attention with fused qkv, EP 2 experts with fused gate_up, FP8 block-quantized matrices, BF16
embeddings, norms and routers). Every step's weights are a function of (step, tensor), so each side
knows them: training ranks write their shards, inference ranks check every byte they received
against the reference transform of the full tensors."""

from __future__ import annotations

import os
import traceback

import torch

import fabric_lib as fl
from fabric_lib import weights as W

HIDDEN, INTER, VOCAB, EXPERTS, LAYERS = 256, 256, 512, 8, 2
Q_ROWS, KV_ROWS = 512, 256
TRAIN, INFER = 4, 2


def params() -> list:
    ps = [W.Param("embed", (VOCAB, HIDDEN))]
    for l in range(LAYERS):
        ps += [W.Param(f"l{l}.attn_norm", (HIDDEN,)),
               W.Param(f"l{l}.q", (Q_ROWS, HIDDEN), fp8=True),
               W.Param(f"l{l}.k", (KV_ROWS, HIDDEN), fp8=True),
               W.Param(f"l{l}.v", (KV_ROWS, HIDDEN), fp8=True),
               W.Param(f"l{l}.o", (HIDDEN, Q_ROWS), fp8=True),
               W.Param(f"l{l}.mlp_norm", (HIDDEN,)),
               W.Param(f"l{l}.router", (EXPERTS, HIDDEN))]
        for e in range(EXPERTS):
            ps += [W.Param(f"l{l}.e{e}.gate", (INTER, HIDDEN), fp8=True),
                   W.Param(f"l{l}.e{e}.up", (INTER, HIDDEN), fp8=True),
                   W.Param(f"l{l}.e{e}.down", (HIDDEN, INTER), fp8=True)]
    ps += [W.Param("norm", (HIDDEN,)), W.Param("lm_head", (VOCAB, HIDDEN))]
    return ps


def is_expert(name: str) -> bool:
    return ".e" in name and name.split(".")[1].startswith("e")


def train_pieces(rank: int) -> list:
    out = []
    for p in params():
        if is_expert(p.name):
            e = int(p.name.split(".")[1][1:])
            if e // (EXPERTS // 2) != rank // 2:
                continue  # EP: experts 0-3 on ranks 0-1, 4-7 on ranks 2-3
            r = W.fsdp_rows(p.rows, 2, rank % 2)
        else:
            r = W.fsdp_rows(p.rows, TRAIN, rank)
        if r[1] > r[0]:
            out.append(W.Piece(p.name, rows=r))
    return out


def infer_pieces(rank: int) -> list:
    out = [W.Piece("embed", rows=W.even_split(VOCAB, INFER, rank))]
    for l in range(LAYERS):
        out.append(W.Piece(f"l{l}.attn_norm"))
        out += [W.Piece(f"l{l}.q", rows=W.even_split(Q_ROWS, INFER, rank), buffer=f"l{l}.qkv"),
                W.Piece(f"l{l}.k", rows=W.even_split(KV_ROWS, INFER, rank), buffer=f"l{l}.qkv"),
                W.Piece(f"l{l}.v", rows=W.even_split(KV_ROWS, INFER, rank), buffer=f"l{l}.qkv")]
        out.append(W.Piece(f"l{l}.o", cols=W.even_split(Q_ROWS, INFER, rank)))
        out += [W.Piece(f"l{l}.mlp_norm"), W.Piece(f"l{l}.router")]
        for e in range(rank * EXPERTS // INFER, (rank + 1) * EXPERTS // INFER):
            out += [W.Piece(f"l{l}.e{e}.gate", buffer=f"l{l}.e{e}.gate_up"),
                    W.Piece(f"l{l}.e{e}.up", buffer=f"l{l}.e{e}.gate_up"),
                    W.Piece(f"l{l}.e{e}.down")]
    out += [W.Piece("norm"), W.Piece("lm_head", rows=W.even_split(VOCAB, INFER, rank))]
    return out


def full_weight(step: int, index: int, p: W.Param) -> torch.Tensor:
    g = torch.Generator().manual_seed(step * 100_003 + index)
    return (torch.randn(p.rows, p.cols, generator=g) * 0.05).to(torch.bfloat16)


def expected_buffers(step: int, rank: int) -> dict:
    """What each buffer of inference rank `rank` must hold after `step`: (bytes, scale bytes)."""
    ps = params()
    index = {p.name: i for i, p in enumerate(ps)}
    parts, scales, order = {}, {}, []
    for piece in infer_pieces(rank):
        p = ps[index[piece.param]]
        b = piece.buffer or piece.param
        if b not in parts:
            order.append(b)
            parts[b], scales[b] = [], []
        r0, r1 = piece.rows or (0, p.rows)
        c0, c1 = piece.cols or (0, p.cols)
        full = full_weight(step, index[p.name], p)
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


def trainer(conn, cfg: dict) -> None:
    try:
        torch.set_num_threads(1)
        rank = cfg["rank"]
        with _engine(cfg) as engine:
            kind = _KillingTrainer if cfg.get("kill_step", -1) >= 0 else W.Trainer
            t = kind(engine, params(), train_pieces(rank), rank=rank, world=TRAIN, infer_world=INFER,
                     store=_store(cfg), job=cfg["job"], window=cfg.get("window", 2), owner_rows=cfg.get("owner_rows", 0),
                     timeout_s=cfg.get("timeout_s", 60.0), hook=cfg.get("hook", "auto"), device=_device(cfg))
            t.kill_step = cfg.get("kill_step", -1)
            problem = fl._fabric_lib.weights_check_update(t.manifest, t.plan)
            conn.send("ready" if problem == "" else "error: the plan does not check: " + problem)
            ps = params()
            index = {p.name: i for i, p in enumerate(ps)}
            for step in cfg["steps"]:
                for piece in train_pieces(rank):
                    p = ps[index[piece.param]]
                    r0, r1 = piece.rows
                    t.shard(p.name).copy_(full_weight(step, index[p.name], p)[r0:r1])
                if cfg.get("gpu"):
                    torch.cuda.synchronize()
                t.step = step
                try:
                    times = t.update(step)
                except fl.FabricError as e:
                    conn.send(("failed", step, str(e)))
                    break
                conn.send(("ok", step, times))
            t.close()
        conn.send("bye")
    except Exception:
        conn.send("error " + traceback.format_exc())


def _check(inf: W.Inference, step: int, buffer_set: int, rank: int) -> list:
    """Buffers of `buffer_set` that differ from step's reference."""
    bad = []
    for name, (want, want_scale) in expected_buffers(step, rank).items():
        got = inf.buffer(name, buffer_set).cpu()
        got = got.view(torch.uint8) if got.dtype == torch.float8_e4m3fn else got
        if not torch.equal(got, want):
            bad.append(name)
        if want_scale is not None and not torch.equal(inf.scale(name, buffer_set).cpu(), want_scale):
            bad.append(name + ".scale")
    return bad


def inference(conn, cfg: dict) -> None:
    try:
        torch.set_num_threads(1)
        rank = cfg["rank"]
        with _engine(cfg) as engine:
            inf = W.Inference(engine, params(), infer_pieces(rank), rank=rank, world=INFER, train_world=TRAIN,
                              store=_store(cfg), job=cfg["job"], owner_rows=cfg.get("owner_rows", 0),
                              device=_device(cfg))
            conn.send("ready")
            last_ok = None
            for step in cfg["steps"]:
                try:
                    s = inf.update(step, timeout_s=cfg.get("timeout_s", 60.0))
                except fl.FabricError as e:
                    # The other set still holds the last complete step's weights.
                    kept = _check(inf, last_ok, last_ok % 2, rank) if last_ok is not None else []
                    conn.send(("failed", step, str(e), kept))
                    if cfg.get("rejoin"):
                        inf.reconnect(cfg["rejoin"]["job"])
                        for again in cfg["rejoin"]["steps"]:
                            s = inf.update(again, timeout_s=60.0)
                            conn.send(("ok", again, _check(inf, again, s, rank)))
                    break
                conn.send(("ok", step, _check(inf, step, s, rank)))
                last_ok = step
            inf.close()
        conn.send("bye")
    except Exception:
        conn.send("error " + traceback.format_exc())
