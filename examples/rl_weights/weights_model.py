"""RL weight updates with a real transformers model: training ranks take AdamW steps on a Qwen3 (or
Qwen3-MoE) model and write the new weights into inference ranks after every step, through
fabric_lib.weights (Trainer / Inference); the inference ranks' logits must equal the trainer's.

    python3 examples/rl_weights/weights_model.py [--provider tcp;ofi_rxm|shm] [--trainers 2] [--inference 2]
        [--steps 3] [--fp8] [--model qwen3|qwen3_moe] [--size tiny|gpu] [--device cpu|cuda]

The model is built from a config (AutoConfig.for_model, AutoModelForCausalLM.from_config; random
weights, fixed seed, nothing downloaded) and the transfer plan from its own named_parameters():

- Training ranks (data parallel, FSDP-style publishing): every rank holds the whole model for
  compute, trains on its own batch of random tokens (a language-model loss), all-reduces the
  gradients with gloo and takes the same AdamW step, so every rank holds the same weights. Each
  rank publishes only its FSDP2 shard of each parameter (torch.chunk along dim 0, as
  fully_shard cuts it; the fused experts' dim 0 is the expert), copied into its Trainer arena.
  Full replicas keep the example to plain PyTorch on CPU and on one shared GPU (NCCL refuses two
  ranks on one GPU); a real FSDP2 job copies its local shards, the same rows, into the arena.
- Inference ranks hold the model as a TP serving engine does (vLLM's layout): embed_tokens and
  lm_head split by vocab rows, q/k/v split by heads into one fused qkv_proj buffer, gate/up into
  a fused gate_up_proj buffer, o_proj and down_proj split by columns, MoE experts split over the
  ranks (EP), norms and the router whole. With --fp8 the projections and experts arrive as FP8
  e4m3 with 128 x 128 block scales (the library quantizes on the training ranks); embeddings,
  norms and the router stay BF16.
- The check, every step: the inference ranks gather their buffers into inference rank 0's model
  (FP8 dequantized), which computes logits on a fixed probe batch and a greedy continuation. The
  training rank 0 computes the same from its own weights (with --fp8, the FP8-rounded ones:
  quantize and dequantize, the dequantized reference). BF16 must be bit for bit equal; FP8 within
  the FP8 bound (it is bit for bit too when both sides dequantize the same bytes). The logits must
  change every step and the greedy tokens by the last.

Step 0 publishes the initial weights; steps 1..N each follow one optimizer step. The update time
(the slowest training rank's Trainer.update, all ranks lined up at a store barrier first, so no
training or checking is in it) and the library's cost model (weights_predict_update, fed with this
machine's link, round trip, post and hook times) end in:

    weights-model model=<name> params=<M> bytes=<MiB per step> trainers=<n> inference=<n> steps=<n>
        update_ms_p50=<ms> gbps=<GB/s> logits_equal=<yes|no> measured_over_predicted=<x>

(bytes: what the training ranks posted per step, FP8 gathers between them included; gbps: bytes
over update_ms_p50, 1e9 bytes per second; measured_over_predicted needs 2 or more training ranks.)

--device cuda: every process on GPU 0 (the arenas too, over cuda_ipc), BF16; --size gpu is a
Qwen3-MoE-shaped config for one 78 GiB GPU with 4 training and 2 inference processes.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
import traceback
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# Model shapes. Widths of split FP8 tensors must cut on 128 x 128 blocks: q rows (heads x
# head_dim), kv rows, intermediate and o_proj/down_proj columns, each / inference ranks.
SIZES = {
    # The test's: 2 layers, hidden 256 (q 512 rows, kv 256 rows: TP 2 halves stay 128-aligned).
    "tiny": dict(hidden=256, layers=2, heads=4, kv_heads=2, head_dim=128, inter=512, vocab=1024,
                 experts=8, moe_inter=128, topk=2, batch=2, seq=16),
    # One shared 78 GiB GPU, 4 training replicas and 2 inference ranks under MPS, a run of a few
    # steps well inside 2 minutes: Qwen3-30B-A3B's attention and expert widths and its 151,936-token
    # vocab, 2 layers of 16 experts (top 4) instead of 48 of 128. About 0.81 B parameters (0.62 B of
    # them the embeddings and lm_head), 1.5 GiB per BF16 update, 1.3 GiB with FP8 experts and
    # projections. (4 layers of 32 experts, 1.3 B, with batch 4 x 128, did not finish 3 steps in 5
    # minutes on an H100: every step's gradients, 4 bytes a parameter, go through the host to gloo
    # on every training rank, and so do the inference ranks' buffers for the check.)
    "gpu": dict(hidden=2048, layers=2, heads=32, kv_heads=4, head_dim=128, inter=6144, vocab=151936,
                experts=16, moe_inter=768, topk=4, batch=2, seq=64),
}
PROBE_BATCH, PROBE_LEN, GEN_TOKENS = 2, 8, 8
# What the fork server imports once, so that each rank process starts with them (torch and
# transformers cost seconds per process on a small machine; the test starts four at once). Nothing
# that could initialize CUDA, which a forked process could then not use: fabric_lib (a CUDA build's
# extension) is imported by each rank.
PRELOAD = ["numpy", "torch", "torch.distributed", "transformers", "transformers.models.qwen3.modeling_qwen3",
           "transformers.models.qwen3_moe.modeling_qwen3_moe"]


# ----------------------------------------------------------------------------- the model


def build_model(cfg: dict):
    """The transformers model of cfg["model"] ("qwen3" or "qwen3_moe") at cfg's size, random
    weights from cfg["seed"] (the same bits in every process on the same device), in BF16."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    attn = cfg.get("attn", "eager")
    if cfg["device"].startswith("cuda"):
        # Bit-equal logits in two processes need deterministic kernels: the MoE block's index_add_
        # adds with atomics on CUDA unless told otherwise, cuBLAS needs a fixed workspace. warn_only:
        # NLLLoss (the LM loss) has no deterministic CUDA kernel and would fail the step otherwise.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        # Attention, backward included. Under warn_only, SDPA's fused backwards stay
        # non-deterministic (cuDNN's, which PyTorch picks on Hopper for the training batch, warned
        # so; FlashAttention's and the memory-efficient one's switch only under the strict mode,
        # which the loss rules out). Eager attention (the default here) is matmuls and a float32
        # softmax, forward and backward, deterministic with the above; with --attn sdpa only SDPA's
        # math backend stays on, which is the same composite. The training ranks' weights stay
        # equal either way (each takes the same step on the same all-reduced gradients); this makes
        # a step itself repeatable.
        torch.backends.cuda.enable_cudnn_sdp(False)
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        torch.backends.cuda.enable_math_sdp(True)

    s = cfg["size"]
    kw = dict(hidden_size=s["hidden"], num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
              num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"], vocab_size=s["vocab"],
              intermediate_size=s["inter"], tie_word_embeddings=False, max_position_embeddings=4096)
    if cfg["model"] == "qwen3_moe":
        kw.update(num_experts=s["experts"], num_experts_per_tok=s["topk"], moe_intermediate_size=s["moe_inter"],
                  decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
    config = AutoConfig.for_model(cfg["model"], **kw)
    torch.manual_seed(cfg["seed"])
    with torch.device(cfg["device"]):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation=attn)
    assert model.config._attn_implementation == attn, model.config._attn_implementation
    return model.eval()


class Entry:
    """One matrix the plan moves: a parameter, or one expert of a fused 3-D experts parameter
    ([experts, rows, cols]: each expert its own matrix, so FP8 blocks never straddle experts)."""

    def __init__(self, name: str, index, shape: tuple, fp8: bool):
        self.name, self.index, self.shape, self.fp8 = name, index, tuple(shape), fp8
        self.key = name if index is None else f"{name}.{index}"

    def view(self, model):
        """This entry's tensor in `model`, as the [rows, cols] matrix the plan sees."""
        p = model.get_parameter(self.name).data
        t = p if self.index is None else p[self.index]
        return t.reshape(self.shape[0], -1)


def entries(model, fp8: bool) -> list:
    """The model's parameters, in named_parameters() order; FP8 (with fp8) for the linear layers:
    the *_proj weights and the experts; embeddings, lm_head, norms and the router stay BF16."""
    out = []
    for name, p in model.named_parameters():
        if p.dim() == 3:  # fused experts: gate_up_proj [E, 2 * inter, hidden], down_proj [E, hidden, inter]
            out += [Entry(name, e, p.shape[1:], fp8) for e in range(p.shape[0])]
        else:
            out.append(Entry(name, None, p.shape, fp8 and name.endswith("_proj.weight")))
    return out


def params(es: list) -> list:
    from fabric_lib import weights as W

    return [W.Param(e.key, e.shape, fp8=e.fp8) for e in es]


def train_pieces(es: list, rank: int, world: int) -> list:
    """FSDP2's shards: rows torch.chunk(dim 0) gives `rank`; for experts, whole experts."""
    from fabric_lib import weights as W

    out = []
    for e in es:
        if e.index is None:
            r = W.fsdp_rows(e.shape[0], world, rank)
            if r[1] > r[0]:
                out.append(W.Piece(e.key, rows=r))
        else:
            experts = _experts_of(es, e.name)
            r0, r1 = W.fsdp_rows(experts, world, rank)
            if r0 <= e.index < r1:
                out.append(W.Piece(e.key))
    return out


def infer_pieces(es: list, rank: int, world: int) -> list:
    """What TP (and EP) rank `rank` of `world` serves from, vLLM's way: vocab-parallel embedding and
    lm_head, q/k/v fused into qkv_proj and gate/up into gate_up_proj (column parallel: rows split),
    o_proj and down_proj row parallel (columns split), experts split over the ranks, the rest whole."""
    from fabric_lib import weights as W

    out = []
    for e in es:
        parts = e.name.split(".")  # e.g. model.layers.0.self_attn.q_proj.weight
        prefix, leaf = ".".join(parts[:-2]), parts[-2] if len(parts) > 1 else ""
        if e.index is not None:
            if e.index in range(*W.even_split(_experts_of(es, e.name), world, rank)):
                out.append(W.Piece(e.key))
        elif leaf in ("embed_tokens", "lm_head"):
            out.append(W.Piece(e.key, rows=W.even_split(e.shape[0], world, rank)))
        elif leaf in ("q_proj", "k_proj", "v_proj"):  # even_split refuses kv heads that do not split
            out.append(W.Piece(e.key, rows=W.even_split(e.shape[0], world, rank), buffer=f"{prefix}.qkv_proj.weight"))
        elif leaf in ("gate_proj", "up_proj"):
            out.append(W.Piece(e.key, rows=W.even_split(e.shape[0], world, rank), buffer=f"{prefix}.gate_up_proj.weight"))
        elif leaf in ("o_proj", "down_proj"):
            out.append(W.Piece(e.key, cols=W.even_split(e.shape[1], world, rank)))
        else:  # norms, the router
            out.append(W.Piece(e.key))
    return out


def _experts_of(es: list, name: str) -> int:
    return sum(1 for e in es if e.name == name)


def dequantize(q, scale, rows: int, cols: int):
    """BF16 of FP8 e4m3 values times their 128 x 128 block scales (the inverse of
    fabric_lib.weights.quantize_fp8_blocks up to rounding; the same arithmetic on both sides)."""
    import torch

    full = scale.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
    return (q.float() * full).to(torch.bfloat16)


def fp8_round_trip(x):
    """What an FP8 inference rank computes with: x quantized as the library does, dequantized."""
    from fabric_lib import weights as W

    q, s = W.quantize_fp8_blocks(x)
    return dequantize(q, s, *x.shape)


def probe_tokens(cfg: dict):
    import torch

    g = torch.Generator().manual_seed(cfg["seed"] + 7)
    return torch.randint(0, cfg["size"]["vocab"], (PROBE_BATCH, PROBE_LEN), generator=g).to(cfg["device"])


def probe(model, cfg: dict) -> tuple:
    """(logits of the probe batch, a greedy continuation of its first prompt). The logits go back as
    a float32 numpy array (BF16 widens exactly): a torch tensor in a pipe is passed as a shared
    memory handle that dies with its sender."""
    import torch

    with torch.no_grad():
        x = probe_tokens(cfg)
        logits = model(input_ids=x).logits
        seq = x[:1]
        for _ in range(GEN_TOKENS):  # greedy, whole sequence each time: no cache, no generate() config
            nxt = model(input_ids=seq).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
    return logits.float().cpu().numpy(), seq[0, PROBE_LEN:].tolist()


# ----------------------------------------------------------------------------- the processes


def _engine(cfg: dict):
    import fabric_lib as fl

    if cfg["device"] != "cpu":
        return fl.TransferEngine(cuda_device=0, cuda_ipc=True, transfer_timeout_s=10.0)
    provider = cfg["provider"]
    return fl.TransferEngine(provider=provider, nics=[""] if provider == "shm" else ["127.0.0.1"],
                             transfer_timeout_s=10.0)


def _store(cfg: dict):
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", cfg["port"], is_master=False, wait_for_workers=False)


def _group(store, cfg: dict, side: str, rank: int, world: int) -> None:
    """This side's gloo group (training: the gradient all-reduce; inference: gathering the TP
    buffers for the check), on the shared store under its own prefix."""
    import datetime

    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback: a container's hostname may not resolve
    dist.init_process_group("gloo", store=dist.PrefixStore(f"{cfg['job']}/pg-{side}", store), rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))


def _barrier(store, cfg: dict, step: int) -> None:
    """Every rank of both sides before step `step`'s update: the training ranks have stepped and
    written their shards, the inference ranks checked the last step and said ready, so the update's
    time is the update's alone."""
    key = f"{cfg['job']}/step/{step}"
    if store.add(key + "/arrived", 1) == cfg["trainers"] + cfg["inference"]:
        store.set(key + "/go", "1")
    store.wait([key + "/go"])


def _stacks_on_signal() -> None:
    """A rank prints every thread's Python stack to stderr on SIGUSR1: what the launcher asks for
    before it gives up on a rank that went quiet."""
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1, all_threads=True)


def progress(cfg: dict, who: str, what: str) -> None:
    """One phase of one rank, to stderr at once, seconds since the launcher started the ranks: a run
    cut short shows where each rank was (building, training step k, update k, checking k)."""
    if cfg.get("progress", True):
        print(f"weights-model progress {time.time() - cfg.get('t0', time.time()):7.1f} s  {who}: {what}",
              file=sys.stderr, flush=True)


def trainer(conn, cfg: dict) -> None:
    try:
        import torch
        import torch.distributed as dist

        from fabric_lib import weights as W

        torch.set_num_threads(cfg.get("threads", 1))
        rank, world, dev = cfg["rank"], cfg["trainers"], cfg["device"]
        who = f"training rank {rank}"
        _stacks_on_signal()
        progress(cfg, who, "started")
        store = _store(cfg)
        _group(store, cfg, "train", rank, world)
        t0 = time.time()
        model = build_model(cfg)
        if dev != "cpu":
            torch.cuda.synchronize()
        progress(cfg, who, f"model built ({sum(p.numel() for p in model.parameters()) / 1e6:.0f} M parameters, "
                           f"{time.time() - t0:.1f} s)")
        es = entries(model, cfg["fp8"])
        mine = {p.param for p in train_pieces(es, rank, world)}
        opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.0)
        with _engine(cfg) as engine:
            t = W.Trainer(engine, params(es), train_pieces(es, rank, world), rank=rank, world=world,
                          infer_world=cfg["inference"], store=store, job=cfg["job"], window=cfg["window"],
                          device=dev)
            calib = _calibrate(engine, t, store, cfg) if world > 1 and rank in (0, 1) else None
            progress(cfg, who, "arenas registered, ready")
            conn.send(("ready", sum(p.numel() for p in model.parameters())))
            measured = []
            for step in range(cfg["steps"] + 1):
                if step > 0:
                    t0 = time.time()
                    loss = _train_step(model, opt, cfg, rank, world, step, who)
                    if rank == 0:
                        progress(cfg, who, f"step {step}: trained, loss {float(loss):.4f} ({time.time() - t0:.1f} s)")
                for e in es:  # publish this rank's shard of the (new) weights
                    if e.key in mine:
                        r0, r1 = W.fsdp_rows(e.shape[0], world, rank) if e.index is None else (0, e.shape[0])
                        t.shard(e.key).copy_(e.view(model)[r0:r1])
                if dev != "cpu":
                    torch.cuda.synchronize()
                _barrier(store, cfg, step)
                times = t.update(step)
                measured.append(times)
                if rank == 0:
                    progress(cfg, who, f"update {step}: sent ({times['total_ms']:.1f} ms)")
                ref = None
                if rank == 0:  # the reference the inference ranks must match
                    t0 = time.time()
                    ref = _reference(model, es, cfg)
                    progress(cfg, who, f"update {step}: reference probed ({time.time() - t0:.1f} s)")
                conn.send(("ok", step, times, ref, float(loss) if step > 0 else None))
            if calib and rank == 0:
                from moe import predict  # the cost model, fed as examples/rl_weights/run.py feeds it

                conn.send(("predicted", dict(predict(t, engine, calib, calib["rtt_us"], measured),
                                             link_gbs=calib["link_gbs"])))
            t.close()
        dist.destroy_process_group()
        conn.send("bye")
    except Exception:
        conn.send("error " + traceback.format_exc())


def _train_step(model, opt, cfg: dict, rank: int, world: int, step: int, who: str = ""):
    """One AdamW step on a language-model loss over this rank's random tokens, the gradients
    averaged over the training ranks (gloo, through host memory: it also serves CUDA ranks)."""
    import torch
    import torch.distributed as dist

    s = cfg["size"]
    g = torch.Generator().manual_seed(cfg["seed"] * 1000 + step * 16 + rank)
    x = torch.randint(0, s["vocab"], (s["batch"], s["seq"]), generator=g).to(cfg["device"])
    model.train()
    t0 = time.time()
    loss = model(input_ids=x, labels=x).loss
    opt.zero_grad(set_to_none=False)
    loss.backward()
    if cfg["device"] != "cpu":
        torch.cuda.synchronize()
    t1 = time.time()
    ps = [p for p in model.parameters() if p.grad is not None]
    bucket, size = [], 0
    for i, p in enumerate(ps):  # buckets of up to 64 M values: a GPU-sized model stays light on the host
        bucket.append(p)
        size += p.numel()
        if size >= 1 << 26 or i == len(ps) - 1:
            flat = torch.cat([q.grad.reshape(-1).float() for q in bucket]).cpu()
            dist.all_reduce(flat)
            flat = (flat / world).to(cfg["device"])
            off = 0
            for q in bucket:
                q.grad.copy_(flat[off:off + q.numel()].view_as(q.grad))
                off += q.numel()
            bucket, size = [], 0
    t2 = time.time()
    opt.step()
    model.eval()
    if rank == 0 and step == 1:  # the first step's phases (the later ones repeat them)
        progress(cfg, who, f"step 1: forward+backward {t1 - t0:.1f} s, gradient all-reduce {t2 - t1:.1f} s, "
                           f"AdamW {time.time() - t2:.1f} s")
    return loss.detach()


def _reference(model, es: list, cfg: dict) -> tuple:
    """The probe on this rank's weights, FP8 entries rounded through FP8 as inference gets them."""
    import torch

    saved = []
    with torch.no_grad():
        for e in es:
            if e.fp8:
                v = e.view(model)
                saved.append((v, v.clone()))
                v.copy_(fp8_round_trip(v))
        out = probe(model, cfg)
        for v, orig in saved:
            v.copy_(orig)
    return out


def _calibrate(engine, t, store, cfg: dict) -> dict:
    """Training ranks 0 and 1: what the cost model needs of this machine. The link: a 64 MiB WRITE
    from rank 0 into a buffer of rank 1 (median of 5; on the GPU, a device copy, as the ranks
    share one GPU); the WRITE round trip: moe.write_rtt_us."""
    import torch

    import fabric_lib as fl
    from moe import write_rtt_us

    if cfg["device"] != "cpu":
        from run import copy_gbs

        gbs = copy_gbs() if t.rank == 0 else 0.0
        return {"link_gbs": gbs, "one_device": True, "rtt_us": write_rtt_us(engine, t)}
    n = 64 << 20
    buf = torch.zeros(n, dtype=torch.uint8)
    handle, desc = engine.register_tensor(buf)
    key = f"{cfg['job']}/calib"
    gbs = 0.0
    if t.rank == 1:
        store.set(key + "/desc", desc.to_bytes().hex())
        store.wait([key + "/done"])
    else:
        dst = engine.add_remote(fl.MrDesc.from_bytes(bytes.fromhex(store.get(key + "/desc").decode())), connect=True)
        times = []
        for _ in range(5):
            done = fl.DoneFlag()
            t0 = time.perf_counter()
            engine.submit_single_write(len=n, src=handle, dst=dst, on_done=done)
            if not done.wait(timeout=30) or not done.ok:
                raise RuntimeError("the link calibration WRITE did not complete")
            times.append(time.perf_counter() - t0)
        gbs = n / statistics.median(times) / 1e9
        store.set(key + "/done", "1")
    engine.dereg_mr(handle)
    return {"link_gbs": gbs, "one_device": False, "rtt_us": write_rtt_us(engine, t)}


def inference(conn, cfg: dict) -> None:
    try:
        import torch
        import torch.distributed as dist

        from fabric_lib import weights as W

        torch.set_num_threads(cfg.get("threads", 1))
        rank, world = cfg["rank"], cfg["inference"]
        who = f"inference rank {rank}"
        _stacks_on_signal()
        progress(cfg, who, "started")
        store = _store(cfg)
        if world > 1:
            _group(store, cfg, "infer", rank, world)
        t0 = time.time()
        model = build_model(cfg)  # the architecture; its weights all come from the training ranks
        progress(cfg, who, f"model built ({time.time() - t0:.1f} s)")
        es = entries(model, cfg["fp8"])
        with _engine(cfg) as engine:
            inf = W.Inference(engine, params(es), infer_pieces(es, rank, world), rank=rank, world=world,
                              train_world=cfg["trainers"], store=store, job=cfg["job"], device=cfg["device"])
            progress(cfg, who, "arenas registered, ready")
            conn.send("ready")
            for step in range(cfg["steps"] + 1):
                inf.ready(step)
                _barrier(store, cfg, step)
                s = inf.wait_update(step, timeout_s=120.0)
                t0 = time.time()
                if rank == 0:
                    progress(cfg, who, f"update {step}: landed")
                _load(model, es, inf, s, rank, world, cfg)
                conn.send(("ok", step, *probe(model, cfg)) if rank == 0 else ("ok", step, None, None))
                if rank == 0:
                    progress(cfg, who, f"update {step}: gathered and probed ({time.time() - t0:.1f} s)")
            inf.close()
        if world > 1:
            dist.destroy_process_group()
        conn.send("bye")
    except Exception:
        conn.send("error " + traceback.format_exc())


def _layout(es: list, rank: int, world: int) -> list:
    """Where each piece of inference rank `rank` sits: (entry, (r0, r1, c0, c1) of the entry, its
    buffer, its first row there, its first block-scale row there), pieces of a buffer stacked in
    order as fabric_lib.weights.Inference stacks them."""
    by_key = {e.key: e for e in es}
    rows_at, srows_at, out = {}, {}, []
    for piece in infer_pieces(es, rank, world):
        e = by_key[piece.param]
        rows, cols = e.shape[0], (e.shape[1] if len(e.shape) > 1 else 1)
        r0, r1 = piece.rows or (0, rows)
        c0, c1 = piece.cols or (0, cols)
        b = piece.buffer or piece.param
        out.append((e, (r0, r1, c0, c1), b, rows_at.get(b, 0), srows_at.get(b, 0)))
        rows_at[b] = rows_at.get(b, 0) + r1 - r0
        srows_at[b] = srows_at.get(b, 0) + -(-(r1 - r0) // 128)
    return out


def _load(model, es: list, inf, buffer_set: int, rank: int, world: int, cfg: dict) -> None:
    """Puts what every inference rank received (buffer set `buffer_set`) into inference rank 0's
    model: each rank flattens its pieces (FP8 dequantized to BF16) in layout order, rank 0
    gathers them (gloo, through host memory) and writes each piece where its layout says."""
    import torch
    import torch.distributed as dist

    parts = []
    for e, (r0, r1, c0, c1), b, row, srow in _layout(es, rank, world):
        x = inf.buffer(b, buffer_set)[row:row + r1 - r0]
        if e.fp8:
            x = dequantize(x, inf.scale(b, buffer_set)[srow:srow + -(-(r1 - r0) // 128)], r1 - r0, c1 - c0)
        parts.append(x.reshape(-1))
    flat = torch.cat(parts)
    if world > 1:
        sizes = [sum((r1 - r0) * (c1 - c0) for _, (r0, r1, c0, c1), *_ in _layout(es, k, world)) for k in range(world)]
        padded = torch.zeros(max(sizes), dtype=torch.bfloat16)
        padded[:flat.numel()] = flat.cpu()
        got = [torch.zeros_like(padded) for _ in range(world)] if rank == 0 else None
        dist.gather(padded, got, dst=0)
        if rank != 0:
            return
        flats = [g.to(cfg["device"]) for g in got]
    else:
        flats = [flat]
    with torch.no_grad():
        for k, f in enumerate(flats):
            off = 0
            for e, (r0, r1, c0, c1), *_ in _layout(es, k, world):
                n = (r1 - r0) * (c1 - c0)
                e.view(model)[r0:r1, c0:c1].copy_(f[off:off + n].view(r1 - r0, c1 - c0))
                off += n


# ----------------------------------------------------------------------------- the run


def run(cfg: dict, out=print) -> dict:
    """Starts cfg["trainers"] training and cfg["inference"] inference processes (from a fork server
    that preloaded torch and transformers: no engine thread is ever forked), checks every step,
    prints the weights-model line through `out` and returns what it found: logits_equal, tokens
    (per step), update_ms (per step), bytes, params, predicted (or None), line. Raises
    AssertionError when a check fails, RuntimeError when a rank fails; the ranks are killed then."""
    import torch.distributed as dist

    ctx = mp.get_context("forkserver")
    # torch.cuda.is_available() through NVML, should an import call it in the fork server: the CUDA
    # runtime's own check would initialize CUDA there, and the forked ranks could not use it.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    ctx.set_forkserver_preload(PRELOAD)  # once per launcher process; later calls change nothing
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    procs = []

    def start(fn, c):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=fn, args=(child, c), daemon=True)
        p.start()
        procs.append(p)
        return parent, p

    try:
        return _run(cfg, store, start, out)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def _run(cfg: dict, store, start, out) -> dict:
    import torch

    base = dict(cfg, port=store.port, job=cfg.get("job") or uuid.uuid4().hex, t0=time.time())
    ranks = [("inference", r, *start(inference, dict(base, rank=r))) for r in range(cfg["inference"])]
    ranks += [("training", r, *start(trainer, dict(base, rank=r))) for r in range(cfg["trainers"])]

    owed = {(side, r): 1 for side, r, _, _ in ranks}
    ready = _collect(ranks, owed, cfg.get("timeout_s", 600.0))
    nparams = 0
    for (side, r), (msg,) in ready.items():
        if side == "training":
            msg, nparams = msg
        if msg != "ready":
            raise RuntimeError(f"{side} rank {r}: {msg}")
    progress(base, "launcher", f"every rank ready, {nparams / 1e6:.0f} M parameters; steps next")
    steps = cfg["steps"] + 1
    # Every step's message from every rank, then training rank 0's prediction (2 or more training
    # ranks), then each rank's goodbye.
    owed = {(side, r): steps + (side == "training" and r == 0 and cfg["trainers"] > 1) + 1 for side, r, _, _ in ranks}
    got = _collect(ranks, owed, cfg.get("timeout_s", 600.0))
    predicted = got[("training", 0)][steps][1] if cfg["trainers"] > 1 else None
    for (side, r), msgs in got.items():
        if msgs[-1] != "bye":
            raise RuntimeError(f"{side} rank {r} did not finish: {msgs[-1]!r}")

    # The check: inference rank 0's probe against training rank 0's, every step.
    equal, worst, tokens, update_ms, prev = True, 0.0, [], [], None
    for step in range(steps):
        _, _, _, ref, loss = got[("training", 0)][step]
        _, _, logits, toks = got[("inference", 0)][step]
        ref_logits, ref_toks = ref
        logits, ref_logits = torch.from_numpy(logits), torch.from_numpy(ref_logits)
        diff = (logits - ref_logits).abs().max().item()
        worst = max(worst, diff)
        same = torch.equal(logits, ref_logits)
        # FP8: both sides dequantize the same bytes, so equal is expected; the bound allowed is
        # what an e4m3 rounding (2^-4 relative) of the weights could move the logits by.
        ok = same or (cfg["fp8"] and diff <= 2 ** -4 * ref_logits.abs().max().item())
        equal = equal and same
        if not ok or toks != ref_toks:
            raise AssertionError(f"step {step}: inference logits differ from training rank 0's by {diff} "
                                 f"(tokens {toks} vs {ref_toks})")
        if prev is not None and torch.equal(prev, logits):
            raise AssertionError(f"step {step}: the logits did not change with the weights")
        prev = logits
        tokens.append(toks)
        update_ms.append(max(got[("training", r)][step][2]["total_ms"] for r in range(cfg["trainers"])))
        out(f"step {step:3d}  update_ms {update_ms[-1]:8.2f}  loss {'-' if loss is None else f'{loss:.4f}'}  "
            f"max|logit diff| {diff:.3g}  greedy {toks}")
    if tokens[-1] == tokens[0]:
        raise AssertionError(f"the greedy tokens did not change over {cfg['steps']} steps: {tokens[0]}")

    nbytes = sum(got[("training", r)][0][2]["bytes"] for r in range(cfg["trainers"]))
    p50 = statistics.median(update_ms)
    line = (f"weights-model model={cfg['model']} params={nparams / 1e6:.2f}M bytes={nbytes / 2**20:.2f}MiB "
            f"trainers={cfg['trainers']} inference={cfg['inference']} steps={cfg['steps']} "
            f"update_ms_p50={p50:.2f} gbps={nbytes / p50 / 1e6:.2f} "
            f"logits_equal={'yes' if equal else f'fp8_bound(max {worst:.3g})'}")
    if predicted:
        line += f" measured_over_predicted={p50 / predicted['predicted_ms']:.2f}"
        out(f"predicted {predicted['predicted_ms']:.2f} ms (weights_predict_update): link {predicted['link_ms']:.2f} ms, "
            f"post {predicted['post_ms']:.2f} ms, chain {predicted['chain_ms']:.2f} ms; fed with the link's "
            f"{predicted['link_gbs']:.2f} GB/s, a {predicted['write_rtt_us']:.1f} us WRITE round trip, "
            f"{predicted['post_us']:.2f} us per request, {predicted['unit_us']:.1f} us per quantized unit")
    out(line)
    return dict(logits_equal=equal, tokens=tokens, update_ms=update_ms, bytes=nbytes, params=nparams,
                predicted=predicted, line=line)


def _collect(ranks: list, owed: dict, timeout_s: float) -> dict:
    """Reads the ranks' pipes as messages arrive until each rank (side, r) has sent owed[(side, r)]
    messages; returns them per rank. A rank's error raises at once, whichever rank the launcher
    waits for most; so does a rank whose process ended. When none of the ranks still owing a
    message sends one for timeout_s, every live rank prints its Python stacks to stderr (SIGUSR1)
    and this raises naming the quiet ranks."""
    import signal
    from multiprocessing.connection import wait

    got = {key: [] for key in owed}
    rank_of = {conn: (side, r, proc) for side, r, conn, proc in ranks}
    while True:
        waiting = [c for c, (side, r, _) in rank_of.items() if len(got[(side, r)]) < owed[(side, r)]]
        if not waiting:
            return got
        arrived = wait(waiting, timeout=timeout_s)
        if not arrived:
            for _, _, proc in rank_of.values():
                if proc.is_alive():
                    os.kill(proc.pid, signal.SIGUSR1)
            time.sleep(2)  # the stacks reach stderr
            quiet = ", ".join(f"{rank_of[c][0]} rank {rank_of[c][1]}" for c in waiting)
            raise RuntimeError(f"nothing from {quiet} in {timeout_s:.0f} s (every rank's stacks are above)")
        for c in arrived:
            side, r, proc = rank_of[c]
            try:
                msg = c.recv()
            except EOFError:
                proc.join(timeout=5)
                raise RuntimeError(f"{side} rank {r}: its process ended (exit code {proc.exitcode})") from None
            if isinstance(msg, str) and msg.startswith("error"):
                raise RuntimeError(f"{side} rank {r}: {msg}")
            got[(side, r)].append(msg)


def config(args) -> dict:
    size = dict(SIZES[args.size])
    for k in SIZES["tiny"]:
        if getattr(args, k, None) is not None:
            size[k] = getattr(args, k)
    return dict(model=args.model, size=size, trainers=args.trainers, inference=args.inference, steps=args.steps,
                lr=args.lr, fp8=args.fp8, provider=args.provider, device=args.device, window=args.window,
                seed=args.seed, threads=args.threads, attn=args.attn, timeout_s=args.timeout_s)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3", choices=["qwen3", "qwen3_moe"])
    ap.add_argument("--size", default="tiny", choices=sorted(SIZES))
    for k in SIZES["tiny"]:
        ap.add_argument("--" + k.replace("_", "-"), type=int, default=None, help=f"override the size's {k}")
    ap.add_argument("--trainers", type=int, default=2)
    ap.add_argument("--inference", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps (each followed by an update)")
    ap.add_argument("--lr", type=float, default=1e-2, help="AdamW's (large: the greedy tokens must change)")
    ap.add_argument("--fp8", action="store_true", help="inference holds the linear layers as FP8 e4m3")
    ap.add_argument("--provider", default="tcp;ofi_rxm", help="tcp;ofi_rxm or shm (CPU)")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda: every process and arena on GPU 0")
    ap.add_argument("--window", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--attn", default="eager", choices=["eager", "sdpa"],
                    help="transformers attn_implementation in every process (CUDA: sdpa runs its math backend "
                         "only; both are deterministic, backward included)")
    ap.add_argument("--timeout-s", type=float, default=600.0,
                    help="the launcher gives up on ranks silent this long, after they print their stacks")
    args = ap.parse_args()
    if args.device.startswith("cuda"):
        args.device = "cuda:0"
    t0 = time.monotonic()
    cfg = config(args)
    print(f"{args.trainers} training -> {args.inference} inference processes, {args.model} ({args.size}), "
          f"{'FP8 linear layers' if args.fp8 else 'BF16'}, over "
          f"{'cuda_ipc (GPU 0)' if args.device != 'cpu' else args.provider}")
    res = run(cfg)
    print(f"done in {time.monotonic() - t0:.1f} s")
    return 0 if res else 1


if __name__ == "__main__":
    sys.exit(main())
