"""RL weight updates: training ranks write new weights straight into inference ranks' buffers.

After each training step, every training rank writes its part of each tensor, unsharded and
quantized where the inference side wants FP8, directly into the inference ranks' registered
weight buffers with one-sided WRITEs, on a plan computed once (include/fabric/weights/plan.h). The
executor (include/fabric/weights/update.h) pipelines gather, quantize and send over a bounded
window of staging slots; inference ranks know a step is complete from immediate counts alone.

- Param: a tensor of the model (name, shape, whether inference holds it as FP8 e4m3 with 128 x 128
  block scales). Every rank of both sides lists the same params in the same order.
- Piece: a rectangle of a param a rank holds (training: an FSDP shard, an EP/TP split) or needs
  (inference: a TP split, an expert), optionally into a fused buffer (q/k/v, gate/up: pieces of
  one buffer are concatenated along rows, in the order given).
- Trainer / Inference: one rank of each side. Construction publishes the rank's pieces and its
  registered arena in a store (a torch.distributed Store: TCPStore, or the default group's),
  reads the others', and builds the same plan on every rank. Trainer.shard(name) is the rank's
  shard in its arena (write the new weights there, or train on it in place); Trainer.update(step)
  runs a step. Inference.update(step) (ready, then wait_update) waits for it and returns the buffer set it landed in;
  Inference.buffer(name, set) and .scale(name, set) are the tensors inference reads.

Buffer sets: with sets=2 (the default) step s writes set s % 2, so a failed step leaves the
other set, the last complete step's weights, untouched; retry under a new step number. With
sets=1 a failed step leaves its tensors partly written until a later step completes. A training
rank whose update failed is not reused: the job restarts its trainers under a new job name, and
each inference rank joins it with Inference.reconnect(job) (same params and pieces: same plan).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from . import _fabric_lib as _c
from ._fabric_lib import Box, Manifest, Placement, TensorSpec, UpdatePlan, UnitWork
from ._stores import store_of

__all__ = ["Param", "Piece", "Trainer", "Inference", "fsdp_rows", "even_split", "quantize_fp8_blocks",
           "UpdatePlan", "UnitWork"]

_ALIGN = 64
E4M3_MAX = 448.0
BLOCK = 128


@dataclass(frozen=True)
class Param:
    name: str
    shape: tuple
    fp8: bool = False  # inference holds it as FP8 e4m3 with one fp32 scale per 128 x 128 block

    @property
    def rows(self) -> int:
        return int(self.shape[0])

    @property
    def cols(self) -> int:
        return int(math.prod(self.shape[1:])) if len(self.shape) > 1 else 1


@dataclass(frozen=True)
class Piece:
    param: str
    rows: Optional[tuple] = None  # [r0, r1) of dim 0; None: all
    cols: Optional[tuple] = None  # [c0, c1) of the other dims flattened; None: all
    buffer: Optional[str] = None  # inference: the fused buffer it goes into (default: its param's name)


def fsdp_rows(rows: int, world: int, rank: int) -> tuple:
    """The rows FSDP2 gives `rank` of `world` (torch.chunk along dim 0: ceil(rows / world) each,
    the last ones shorter or empty)."""
    chunk = -(-rows // world)
    r0 = min(rows, rank * chunk)
    return (r0, min(rows, r0 + chunk))


def even_split(n: int, parts: int, k: int) -> tuple:
    """Part k of n split into `parts` equal parts (TP, EP)."""
    if n % parts:
        raise ValueError(f"{n} does not split into {parts} equal parts")
    return (n // parts * k, n // parts * (k + 1))


def quantize_fp8_blocks(x: Any) -> tuple:
    """(e4m3 values, fp32 scales) of a 2-D BF16 tensor, block by block: scale = amax / 448 over each
    128 x 128 block (1 for a block of zeros), value = e4m3(x / scale), rounded to nearest even. The
    same arithmetic as the C++ fp8::quantize_blocks, on any device."""
    import torch

    rows, cols = x.shape
    br, bc = -(-rows // BLOCK), -(-cols // BLOCK)
    xf = x.float()
    padded = torch.zeros(br * BLOCK, bc * BLOCK, dtype=torch.float32, device=x.device)
    padded[:rows, :cols] = xf.abs()
    amax = padded.view(br, BLOCK, bc, BLOCK).amax(dim=(1, 3))
    # A tensor divisor, not the scalar 448: CUDA divides by a scalar as a multiplication by its
    # reciprocal, which rounds differently from the C++ (and CPU) amax / 448.
    scale = torch.where(amax > 0, amax / torch.full_like(amax, E4M3_MAX), torch.ones_like(amax))
    full = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:rows, :cols]
    return (xf / full).to(torch.float8_e4m3fn), scale


def _spec(p: Param) -> TensorSpec:
    return TensorSpec(p.name, p.rows, p.cols, 2, p.fp8)


def _box(p: Param, piece: Piece) -> tuple:
    r0, r1 = piece.rows if piece.rows is not None else (0, p.rows)
    c0, c1 = piece.cols if piece.cols is not None else (0, p.cols)
    if not (0 <= r0 < r1 <= p.rows and 0 <= c0 < c1 <= p.cols):
        raise ValueError(f"{p.name}: rows [{r0}, {r1}) x cols [{c0}, {c1}) is empty or outside {p.rows} x {p.cols}")
    return (int(r0), int(r1), int(c0), int(c1))


def _align(x: int) -> int:
    return (x + _ALIGN - 1) // _ALIGN * _ALIGN


class _Side:
    """What both roles share: the params, the store protocol and the plan."""

    def __init__(self, engine: Any, params: Sequence[Param], *, store: Any, job: str, train_world: int,
                 infer_world: int, owner_rows: int) -> None:
        self.engine = engine
        self.params = list(params)
        self.index = {p.name: i for i, p in enumerate(self.params)}
        if len(self.index) != len(self.params):
            raise ValueError("two params share a name")
        self.store = store_of(store)
        self.job = job
        self.train_world, self.infer_world = train_world, infer_world
        self.owner_rows = owner_rows

    def _param(self, name: str) -> Param:
        if name not in self.index:
            raise ValueError(f"no param named {name!r}")
        return self.params[self.index[name]]

    def _publish(self, key: str, value: dict) -> None:
        self.store.set(f"{self.job}/{key}", json.dumps(value))

    def _read(self, key: str) -> dict:
        return json.loads(self.store.get(f"{self.job}/{key}"))

    def _plan(self) -> tuple:
        """Reads every rank's pieces and builds the manifest and the plan (the same everywhere)."""
        m = Manifest()
        m.tensors = [_spec(p) for p in self.params]
        m.src_ranks, m.dst_ranks = self.train_world, self.infer_world
        sources, dests, scales = [], [], []
        for r in range(self.train_world):
            for t, rank, box, off in self._read(f"t{r}/pieces")["placements"]:
                sources.append(Placement(t, rank, Box(*box), off))
        for r in range(self.infer_world):
            got = self._read(f"i{r}/pieces")
            for t, rank, box, off in got["placements"]:
                dests.append(Placement(t, rank, Box(*box), off))
            for t, rank, box, off in got["scales"]:
                scales.append(Placement(t, rank, Box(*box), off))
        m.sources, m.dests, m.dest_scales = sources, dests, scales
        return m, _c.weights_plan_update(m, self.owner_rows)

    def _descs(self, side: str, world: int, sets: int = 1) -> list:
        out = []
        for r in range(world):
            got = self._read(f"{side}{r}/arena")
            out.append([_c.MrDesc.from_bytes(bytes.fromhex(h)) for h in got["descs"]][:sets])
        return out


class Trainer(_Side):
    """One training rank. pieces: what it holds (bf16); its arena holds them and its staging
    window, on `device` ("cpu" or a CUDA device). hook: how a unit is copied and quantized: "cuda"
    (the library's kernel, one launch per unit; the default for CUDA arenas), "host" (C++ on the
    CPU; the default for CPU arenas) or "torch" (torch ops, on either). trace: update() also
    returns "units", a timeline per unit (unit, input_ms, start_ms, quantized_ms, posted_ms)."""

    def __init__(self, engine: Any, params: Sequence[Param], pieces: Sequence[Piece], *, rank: int, world: int,
                 infer_world: int, store: Any = None, job: str = "weights", window: int = 2, sets: int = 2,
                 owner_rows: int = 0, timeout_s: float = 60.0, device: Any = "cpu", hook: str = "auto",
                 trace: bool = False, imm_base: Optional[int] = None) -> None:
        import torch

        super().__init__(engine, params, store=store, job=job, train_world=world, infer_world=infer_world,
                         owner_rows=owner_rows)
        self.rank, self.window = rank, window
        self._views = {}
        placements, cursor = [], 0
        for piece in pieces:
            p = self._param(piece.param)
            box = _box(p, piece)
            placements.append((self.index[p.name], rank, box, cursor))
            self._views[p.name] = (cursor, box)
            cursor = _align(cursor + (box[1] - box[0]) * (box[3] - box[2]) * 2)
        self._publish(f"t{rank}/pieces", {"placements": placements})
        self.manifest, self.plan = self._plan()
        staging = self.plan.staging_bytes_for(window)[rank]
        self.arena = torch.zeros(max(1, self.plan.staging_base[rank] + staging), dtype=torch.uint8,
                                 device=torch.device(device))
        # This rank's range of the engine's immediates: the gathers, credits and ready notices
        # sent to its arena are counted there, apart from any other user of the engine.
        self.imms = engine.reserve_imms(f"weights {job}: training rank {rank}", bits=_c.UPDATE_IMM_BITS, base=imm_base)
        handle, desc = engine.register_tensor(self.arena, imms=self.imms)
        self._publish(f"t{rank}/arena", {"descs": [desc.to_bytes().hex()]})
        train = [d[0] for d in self._descs("t", world)]
        self.train_descs = train  # every training rank's arena (its own included)
        dest_sets = list(map(list, zip(*self._descs("i", infer_world, sets))))
        if len(dest_sets) != sets:
            raise ValueError(f"the inference ranks registered fewer than {sets} buffer sets")
        on_gpu = self.arena.device.type == "cuda"
        if hook not in ("auto", "cuda", "torch", "host"):
            raise ValueError(f"hook must be auto, cuda, torch or host, not {hook!r}")
        if hook == "auto":
            hook = "cuda" if on_gpu else "host"
        if (hook == "cuda") != on_gpu and hook != "torch":
            raise ValueError(f"hook={hook!r} does not fit an arena on {self.arena.device}")
        self.hook = hook
        self.sender = _c.WeightSender(engine, self.plan, rank=rank, arena=handle, arena_ptr=self.arena.data_ptr(),
                                      train_arenas=train, dest_arenas=dest_sets, imms=self.imms, window=window,
                                      timeout_s=timeout_s,
                                      hook=self._torch_hook if hook == "torch" else None,
                                      cuda_hook=hook == "cuda", trace=trace)

    def shard(self, name: str) -> Any:
        """This rank's piece of `name` in its arena, a [rows, cols] bf16 tensor view."""
        import torch

        if name not in self._views:
            raise KeyError(f"rank {self.rank} holds no piece of {name!r}")
        off, (r0, r1, c0, c1) = self._views[name]
        n = (r1 - r0) * (c1 - c0)
        return self.arena[off:off + 2 * n].view(torch.bfloat16).view(r1 - r0, c1 - c0)

    def update(self, step: int) -> dict:
        """Runs step `step` on this rank; returns where its time went (ms) and what it posted."""
        return self.sender.update(step)

    def _torch_hook(self, w: UnitWork) -> None:
        """Copies and quantizes one unit with torch ops on the arena (CUDA arenas, or hook='torch')."""
        import torch

        a = self.arena
        for c in w.local_copies:
            src = a.as_strided((c.rows, c.row_bytes), (c.src_stride, 1), c.src_offset)
            dst = a.as_strided((c.rows, c.row_bytes), (c.dst_stride, 1), c.dst_offset)
            dst.copy_(src)
        rows = w.r1 - w.r0
        x = a.as_strided((rows, w.cols * 2), (w.in_stride, 1), w.in_offset).contiguous().view(torch.bfloat16)
        q, s = quantize_fp8_blocks(x)
        a[w.out_offset:w.out_offset + rows * w.cols].copy_(q.view(torch.uint8).reshape(-1))
        a[w.scale_offset:w.scale_offset + s.numel() * 4].copy_(s.reshape(-1).view(torch.uint8))
        if a.device.type == "cuda":
            torch.cuda.current_stream(a.device).synchronize()  # the WRITEs read it right after

    def close(self) -> None:
        self.sender.close()


class Inference(_Side):
    """One inference rank. pieces: what it needs; pieces naming one buffer are concatenated along
    rows, each buffer with its own [rows, cols] tensor (float8_e4m3fn for FP8 params, with a
    float32 scale tensor of the concatenated block rows). `sets` copies of every buffer."""

    def __init__(self, engine: Any, params: Sequence[Param], pieces: Sequence[Piece], *, rank: int, world: int,
                 train_world: int, store: Any = None, job: str = "weights", sets: int = 2, owner_rows: int = 0,
                 device: Any = "cpu", imm_base: Optional[int] = None) -> None:
        import torch

        super().__init__(engine, params, store=store, job=job, train_world=train_world, infer_world=world,
                         owner_rows=owner_rows)
        self.rank, self.sets = rank, sets
        # Buffers in order of first mention; each: its pieces, then (FP8) its scales.
        order, members = [], {}
        for piece in pieces:
            b = piece.buffer or piece.param
            if b not in members:
                order.append(b)
                members[b] = []
            members[b].append(piece)
        placements, scales, cursor = [], [], 0
        self._buffers = {}
        for b in order:
            first = self._param(members[b][0].param)
            fp8 = first.fp8
            cols, rows_total, start = None, 0, cursor
            for piece in members[b]:
                p = self._param(piece.param)
                box = _box(p, piece)
                if p.fp8 != fp8:
                    raise ValueError(f"buffer {b!r} mixes FP8 and BF16 params")
                if cols is not None and box[3] - box[2] != cols:
                    raise ValueError(f"buffer {b!r}: pieces of one buffer must have the same columns")
                cols = box[3] - box[2]
                placements.append((self.index[p.name], rank, box, cursor))
                cursor += (box[1] - box[0]) * cols * (1 if fp8 else 2)
                rows_total += box[1] - box[0]
            entry = {"offset": start, "rows": rows_total, "cols": cols, "fp8": fp8}
            cursor = _align(cursor)
            if fp8:
                entry["scale_offset"], srows = cursor, 0
                for piece in members[b]:
                    p = self._param(piece.param)
                    r0, r1, c0, c1 = _box(p, piece)
                    if r0 % BLOCK or (r1 % BLOCK and r1 != p.rows) or c0 % BLOCK or (c1 % BLOCK and c1 != p.cols):
                        raise ValueError(f"{p.name}: an FP8 piece must be aligned to 128 x 128 blocks")
                    sbox = (r0 // BLOCK, -(-r1 // BLOCK), c0 // BLOCK, -(-c1 // BLOCK))
                    scales.append((self.index[p.name], rank, sbox, cursor))
                    cursor += (sbox[1] - sbox[0]) * (sbox[3] - sbox[2]) * 4
                    srows += sbox[1] - sbox[0]
                entry["scale_shape"] = (srows, -(-cols // BLOCK))
                cursor = _align(cursor)
            self._buffers[b] = entry
        self._pieces = {"placements": placements, "scales": scales}
        self._publish(f"i{rank}/pieces", self._pieces)
        self.arenas = [torch.zeros(max(1, cursor), dtype=torch.uint8, device=torch.device(device))
                       for _ in range(sets)]
        self.imms = engine.reserve_imms(f"weights {job}: inference rank {rank}", bits=_c.UPDATE_IMM_BITS, base=imm_base)
        self._descs_hex = [engine.register_tensor(a, imms=self.imms)[1].to_bytes().hex() for a in self.arenas]
        self._publish(f"i{rank}/arena", {"descs": self._descs_hex})
        self.manifest, self.plan = self._plan()
        train = [d[0] for d in self._descs("t", train_world)]
        self.receiver = _c.WeightReceiver(engine, self.plan, rank=rank, train_arenas=train, sets=sets, imms=self.imms)

    def buffer(self, name: str, set: int = 0) -> Any:
        """Buffer `name` of buffer set `set`: [rows, cols], bf16 or float8_e4m3fn."""
        import torch

        e = self._buffers[name]
        n = e["rows"] * e["cols"]
        a = self.arenas[set]
        if e["fp8"]:
            return a[e["offset"]:e["offset"] + n].view(torch.float8_e4m3fn).view(e["rows"], e["cols"])
        return a[e["offset"]:e["offset"] + 2 * n].view(torch.bfloat16).view(e["rows"], e["cols"])

    def scale(self, name: str, set: int = 0) -> Any:
        """The fp32 block scales of FP8 buffer `name` ([ceil(rows/128), ceil(cols/128)]; x ~ value * scale)."""
        import torch

        e = self._buffers[name]
        if not e["fp8"]:
            raise ValueError(f"buffer {name!r} is not FP8")
        r, c = e["scale_shape"]
        off = e["scale_offset"]
        return self.arenas[set][off:off + 4 * r * c].view(torch.float32).view(r, c)

    @property
    def buffers(self) -> list:
        return list(self._buffers)

    def ready(self, step: int) -> None:
        """Buffer set step % sets may be written (call it once the set is no longer read)."""
        self.receiver.ready(step)

    def wait_update(self, step: int, timeout_s: float = 60.0) -> int:
        """Returns the buffer set step landed in; raises FabricError naming the missing training ranks."""
        self.receiver.wait_update(step, timeout_s)
        return step % self.sets

    def update(self, step: int, timeout_s: float = 60.0) -> int:
        """ready(step) then wait_update(step)."""
        self.ready(step)
        return self.wait_update(step, timeout_s)

    def reconnect(self, job: str) -> None:
        """Joins a restarted training job that runs under a new job name: publishes this rank's
        pieces and arenas there and takes the new trainers' arenas (the same params and pieces, so
        the same plan). Blocks until every new trainer has published."""
        if job == self.job:
            raise ValueError("a restarted job needs a new job name (the old keys name dead trainers)")
        self.job = job
        self._publish(f"i{self.rank}/pieces", self._pieces)
        self._publish(f"i{self.rank}/arena", {"descs": self._descs_hex})
        self.receiver.set_sources([d[0] for d in self._descs("t", self.train_world)])

    def close(self) -> None:
        self.receiver.close()
