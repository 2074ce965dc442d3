"""A transformers model's own MoE block run expert-parallel through fabric_lib.moe: a Qwen3-MoE
(AutoConfig.for_model("qwen3_moe"), random weights from one seed, nothing downloaded) in W rank
processes, each holding experts/W of every layer's experts, checked against one process running the
unmodified model.

    python3 examples/moe/moe_model.py [--mode all_to_all|deep_ep] [--ranks 4] [--node-size 2]
        [--provider tcp|shm] [--dtypes bf16,fp8] [--size tiny|gpu] [--device cpu|cuda]

Each rank is a data-parallel replica of everything but the experts (attention, norms, router,
embeddings) decoding its own prompts; every Qwen3MoeSparseMoeBlock's forward is replaced by one that
runs the block's own router (`block.gate`) on the rank's tokens, sends them to the ranks holding
their experts (`AllToAll.dispatch`, or `deep_ep.Buffer.low_latency_dispatch` with --mode deep_ep),
runs the block's own experts module (`block.experts`, cut down to this rank's experts) on the rows
received, and brings the outputs back weighted by the router's weights (`combine`). The rest of the
model is the model's own code.

Checks (the script exits 1 when one fails):
(a) The block, on random hidden states spread over the ranks, against the model's own block in one
    process. Exact where the arithmetic is the same: each rank's combined output equals, bit for bit,
    reference_combine_rows over the model's own experts applied to each (token, slot) (the library's
    combine: fp32 fused multiply-adds in slot order, rounded to BF16 once). Against the model's block
    output within the BF16 bound: the model (grouped_mm or batched_mm experts) rounds each weighted
    expert output w * y to BF16 before its fp32 sum, the combine does not, so per value
    |ep - model| <= (3 * 2^-8 + 2^-20) * sum_k |w_k y_k| (2^-8: BF16's unit roundoff, once for
    each product and once for each side's final rounding; 2^-20: the fp32 sums of at most 8 terms;
    eager experts, which add in BF16, get (k + 2) * 2^-8: sum_bound).
    FP8 dispatch: exact against the same with the experts applied to the dequantized tokens
    (quantize_fp8_tokens is what the send half does); against the unquantized model block within
    the FP8 bound: the BF16 bound plus the e4m3 error of the inputs (2^-4 relative, 3 mantissa
    bits, or 2^-10 of the block scale below e4m3's normal range) carried through the expert in
    exact arithmetic by its absolute weights (|G|, |U|, |D|, SiLU 1.1-Lipschitz), plus 2^-6 of the
    expert's |D| |h| for the BF16 roundings inside it, which differ between the two inputs.
    With a BF16 dispatch the block is also run with the router's weights applied where the model
    applies them, in the experts module (each w * y rounded to BF16; the expert rank runs the
    block's router on the row it received, the source's token bit for bit, to find that token's
    weight for its expert) and combined with weights 1: combine's fp32 sum in slot order, rounded
    once, is then the model's own `.sum(dim=1)`, and the block must equal the model's bit for bit.
(b) A greedy decode of every rank's prompts through all layers (prefill included, which goes
    through the EP blocks too), against the unmodified model decoding them in one process (each
    rank's prompts as a batch, the shapes the rank's attention sees; on the CPU the model gives the
    same bits at any batch size): the tokens and the largest logit difference. BF16 dispatch decodes with the
    weights in the experts, the model's arithmetic, and must give the same tokens and logits.
    (With the weights in combine it cannot be required: the logits are BF16, spaced 2^-8 near 1,
    and in this random model two of them are often equal; the unrounded products move a logit by
    about one such step, measured 0.0039-0.0049 after the prefill over seeds 0-5, while the
    smallest gap between a prompt's two best logits was 0 in two of those seeds and under 0.03 in
    all.) FP8 dispatch (weights in combine) changes the experts' inputs, so its tokens are reported,
    not required.
(c) One line per dispatch dtype:
    moe-model ranks=<W> mode=<all_to_all|deep_ep> dtype=<bf16|fp8> tokens_identical=<yes|no>
        max_logit_diff=<x> step_ms=<EP decode step p50> single_ms=<single-process step p50>
        ratio=<step/single> block_exact=<yes|no> block_bound=<max |diff| / bound, weights in combine>
        weights=<expert|combine: the decode's> experts=<transformers' experts implementation>
    step_ms: per decode step the slowest rank's time, p50 over the steps; single_ms: the
    unmodified model's step over all the prompts in one process, p50.

--device cuda: every rank process and the reference on GPU 0 (run them under MPS, as
tests/gpu/run.sh does), --size gpu (hidden 2048, 64 experts, top-8, 4 layers), 8 ranks as one
NVLink node. CUDA's GEMMs may pick other kernels for other row counts (the reference computes each
(token, slot) apart and decodes every prompt in one batch), so there block_exact is reported, not
required; the bounds and the BF16 tokens are.
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

SIZES = {
    # The test's: 2 layers of 16 experts, top-4, hidden 128 (one FP8 scale per row); 2 prompts of
    # 8 tokens per rank.
    "tiny": dict(hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32, inter=256, vocab=512, experts=16,
                 moe_inter=64, topk=4, prompts=2, prompt_len=8, new_tokens=8, block_tokens=8),
    # One GPU shared by 8 ranks: Qwen3-30B-A3B's widths (hidden 2048, 32 heads of 128, 4 KV heads,
    # experts of 768, top-8, its vocab) with 4 layers of 64 experts.
    "gpu": dict(hidden=2048, layers=4, heads=32, kv_heads=4, head_dim=128, inter=6144, vocab=151936, experts=64,
                moe_inter=768, topk=8, prompts=4, prompt_len=32, new_tokens=16, block_tokens=32),
}
PROVIDERS = {"tcp": "tcp;ofi_rxm", "shm": "shm"}
# What the fork server imports once, so each rank process starts with them (seconds each on a small
# machine). Nothing that could initialize CUDA; fabric_lib is imported by each rank.
PRELOAD = ["numpy", "torch", "torch.distributed", "transformers", "transformers.models.qwen3_moe.modeling_qwen3_moe"]
U_BF16 = 2.0 ** -8  # BF16's unit roundoff (8 significant bits)


# ----------------------------------------------------------------------------- the model


def setup(cfg: dict) -> None:
    """One torch thread per process (the ranks share the cores), no autograd, and on CUDA
    deterministic kernels (a fixed cuBLAS workspace) in every process alike."""
    import torch

    torch.set_grad_enabled(False)
    torch.set_num_threads(cfg["threads"])
    if cfg["device"] == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.cuda.set_device(0)


def build_model(cfg: dict):
    """The Qwen3-MoE of cfg's size, random weights from cfg["seed"] (the same bits in every process
    on the same device), BF16, eager attention (matmuls and a softmax: no backend choice)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    s = cfg["size"]
    config = AutoConfig.for_model(
        "qwen3_moe", hidden_size=s["hidden"], num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"], vocab_size=s["vocab"],
        intermediate_size=s["inter"], num_experts=s["experts"], num_experts_per_tok=s["topk"],
        moe_intermediate_size=s["moe_inter"], decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
        tie_word_embeddings=False, max_position_embeddings=4096)
    torch.manual_seed(cfg["seed"])
    with torch.device(device_of(cfg)):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="eager")
    return model.eval()


def device_of(cfg: dict):
    import torch

    return torch.device("cuda", 0) if cfg["device"] == "cuda" else torch.device("cpu")


def moe_blocks(model) -> list:
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    return [m for m in model.modules() if isinstance(m, Qwen3MoeSparseMoeBlock)]


def prompts(cfg: dict):
    """Every rank's prompts, [ranks * prompts, prompt_len] token ids: rank r decodes rows
    r * prompts .. (r + 1) * prompts - 1."""
    import torch

    s = cfg["size"]
    g = torch.Generator().manual_seed(cfg["seed"] + 1)
    return torch.randint(0, s["vocab"], (cfg["ranks"] * s["prompts"], s["prompt_len"]), generator=g)


def block_input(cfg: dict):
    """Hidden states for check (a), [ranks * block_tokens, hidden] BF16: the scale of what a
    post-attention RMSNorm gives the block."""
    import torch

    s = cfg["size"]
    g = torch.Generator().manual_seed(cfg["seed"] + 2)
    return torch.randn(cfg["ranks"] * s["block_tokens"], s["hidden"], generator=g).to(torch.bfloat16)


def greedy(model, ids, new_tokens: int, sync) -> tuple:
    """Greedy decode with the model's own forward and cache: (tokens [B, new_tokens], logits
    [B, new_tokens, vocab] of each chosen token's step, ms of each decode step after the prefill)."""
    import inspect

    import torch
    from transformers import DynamicCache

    # transformers 5.2x names the forward's cache `cache`, earlier ones `past_key_values`.
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache = DynamicCache(config=model.config)
    out = model(ids, **{kw: cache}, use_cache=True, logits_to_keep=1)
    logits = [out.logits[:, -1]]
    tokens = [logits[-1].argmax(-1)]
    step_ms = []
    for _ in range(new_tokens - 1):
        t0 = time.perf_counter()
        out = model(tokens[-1][:, None], **{kw: cache}, use_cache=True, logits_to_keep=1)
        logits.append(out.logits[:, -1])
        tokens.append(logits[-1].argmax(-1))
        sync()
        step_ms.append((time.perf_counter() - t0) * 1e3)
    return torch.stack(tokens, 1).cpu(), torch.stack(logits, 1).cpu(), step_ms


# ----------------------------------------------------------------------------- expert parallelism


def keep_local_experts(experts, rank: int, local: int) -> None:
    """Cuts the model's fused experts module (Qwen3MoeExperts: gate_up_proj [E, 2I, H], down_proj
    [E, H, I]) down to this rank's experts rank * local .. (rank + 1) * local - 1, indexed from 0:
    a rank holds only its share of the weights."""
    import torch

    lo, hi = rank * local, (rank + 1) * local
    experts.gate_up_proj = torch.nn.Parameter(experts.gate_up_proj.data[lo:hi].clone(), requires_grad=False)
    experts.down_proj = torch.nn.Parameter(experts.down_proj.data[lo:hi].clone(), requires_grad=False)
    experts.num_experts = local


def run_experts(block, first_expert: int, weights_at: str, recv_x, recv_scales, counts, out) -> None:
    """The block's own experts module over the rows a dispatch received, into out [local experts,
    rows, hidden] (rows as dispatch placed them). Each row goes in as a token with one slot, its
    expert. weights_at "combine": weight 1 (the router's weight is applied by combine). "expert":
    the router's weight of that (token, expert), multiplied in by the experts module as the model
    multiplies it (BF16), found by running the block's router on the row itself (it is the source's
    token bit for bit with a BF16 dispatch; the router's weights are on every rank). FP8 rows are
    dequantized to BF16 first (the experts compute in BF16)."""
    import torch

    from fabric_lib import moe as M

    c = counts.tolist()
    parts = []
    for el, n in enumerate(c):
        if n:
            rows = recv_x[el, :n]
            if recv_scales is not None:
                rows = M.dequantize_fp8_tokens(rows, recv_scales[el, :n]).to(torch.bfloat16)
            parts.append(rows)
    if not parts:
        return  # no token of any rank chose this rank's experts
    x = torch.cat(parts)
    idx = torch.repeat_interleave(torch.arange(len(c), device=x.device), torch.tensor(c, device=x.device))[:, None]
    w = torch.ones(x.shape[0], 1, dtype=x.dtype, device=x.device)
    if weights_at == "expert":
        _, router_w, router_idx = block.gate(x)
        mine = router_idx == idx + first_expert  # the slot of this row's expert: one per row
        if not bool(mine.sum(1).eq(1).all()):
            raise AssertionError("the router run on a received row does not pick the expert it was sent to")
        w = router_w[mine][:, None]
    y = block.experts(x, idx, w)
    off = 0
    for el, n in enumerate(c):
        out[el, :n] = y[off:off + n]
        off += n


class AllToAllPath:
    """Dispatch and combine through fabric_lib.moe.AllToAll (the native API)."""

    def __init__(self, engine, store, cfg: dict, rank: int, dtype: str) -> None:
        import torch

        from fabric_lib import moe as M

        s = cfg["size"]
        self.a2a = M.AllToAll(engine, rank=rank, world_size=cfg["ranks"], node_size=cfg["node_size"],
                              num_experts=s["experts"], experts_per_token=s["topk"], hidden=s["hidden"],
                              max_tokens=cfg["max_tokens"], dispatch_dtype=dtype, timeout_s=60.0,
                              device=device_of(cfg), store=store, job=f"{cfg['job']}.{dtype}")
        self.expert_out = torch.zeros(self.a2a.local_experts, self.a2a.rows_per_expert, s["hidden"],
                                      dtype=torch.bfloat16, device=device_of(cfg))

    def __call__(self, x, idx, weights, run):
        rx, rs, counts, _, handle = self.a2a.dispatch(x, idx)
        run(rx, rs, counts, self.expert_out)
        return self.a2a.combine(self.expert_out, weights, handle)

    def close(self) -> None:
        self.a2a.close()


class DeepEpPath:
    """The same through DeepEP's low-latency API (fabric_lib.moe.deep_ep.Buffer), as code written
    for DeepEP calls it: the expert outputs go into the combine buffer, combined with zero_copy."""

    def __init__(self, buffer, cfg: dict, dtype: str) -> None:
        self.buffer, self.fp8 = buffer, dtype == "fp8"
        self.T, self.E = cfg["max_tokens"], cfg["size"]["experts"]

    def __call__(self, x, idx, weights, run):
        recv_x, counts, handle, _, _ = self.buffer.low_latency_dispatch(x, idx, self.T, self.E, use_fp8=self.fp8)
        rx, rs = recv_x if self.fp8 else (recv_x, None)  # FP8 scales: DeepEP's column-major view
        y = self.buffer.get_next_low_latency_combine_buffer(handle)
        run(rx, rs, counts, y)
        out, _, _ = self.buffer.low_latency_combine(y, idx, weights, handle, zero_copy=True)
        return out

    def close(self) -> None:
        pass  # the Buffer's AllToAlls go with buffer.destroy()


class ExpertParallel:
    """Replaces the forward of every MoE block of a model: the block's router on this rank's
    tokens, dispatch, the block's experts (this rank's share) on the rows received, combine.
    `path` (an AllToAllPath or DeepEpPath) and `weights_at` may be switched between calls:
    "combine" hands the router's weights to combine (DeepEP's convention: the products w * y are
    not rounded), "expert" applies them in the experts module as the model does (each w * y
    rounded to BF16) and combines with weights 1, which is then the model's own arithmetic."""

    def __init__(self, model, rank: int, ranks: int) -> None:
        self.path, self.weights_at = None, "combine"
        for block in moe_blocks(model):
            local = block.experts.num_experts // ranks
            keep_local_experts(block.experts, rank, local)
            block.forward = self._forward_of(block, rank * local)

    def _forward_of(self, block, first_expert: int):
        import torch

        def run(rx, rs, counts, out):
            run_experts(block, first_expert, self.weights_at, rx, rs, counts, out)

        def forward(hidden_states):
            b, s, h = hidden_states.shape
            x = hidden_states.reshape(-1, h).contiguous()
            _, weights, idx = block.gate(x)  # the model's router: BF16 weights (normalized top-k), int64 experts
            w = weights.float() if self.weights_at == "combine" else torch.ones(idx.shape, device=x.device)
            return self.path(x, idx.contiguous(), w.contiguous(), run).view(b, s, h)

        return forward


# ----------------------------------------------------------------------------- a rank


def make_engine(cfg: dict):
    """The rank's engine: it carries the rows between nodes. On CUDA the ranks are one node, whose
    rows go GPU to GPU through the node's IPC-mapped buffers; the engine is still what the AllToAll
    is built on (as bench/moe_bench.py builds it)."""
    import fabric_lib as fl

    provider = cfg["provider"]
    return fl.TransferEngine(provider=provider, nics=[""] if provider == "shm" else ["127.0.0.1"])


def placements(dtype: str) -> tuple:
    """Where check (a) applies the router's weights: in combine, and with a BF16 dispatch also in
    the experts (the router run on the received rows needs the source's exact tokens)."""
    return ("combine", "expert") if dtype == "bf16" else ("combine",)


def decode_placement(dtype: str) -> str:
    """The decode's: the model's own arithmetic where it can be had (BF16 dispatch), so its tokens
    can be required equal; a tie between two BF16 logits is common in a random model (the logits
    are BF16, spaced 2^-8 near 1), and the combine's unrounded products move logits by about that."""
    return "expert" if dtype == "bf16" else "combine"


def rank_main(conn, cfg: dict) -> None:
    """One EP rank: builds the model, replaces its MoE blocks, then for every dispatch dtype runs
    check (a) on its slice of the block input and the greedy decode of its prompts, sending the
    results to the launcher: (("block", dtype, weights_at), out) and (("decode", dtype), (tokens,
    logits, step_ms))."""
    try:
        import torch
        import torch.distributed as dist

        setup(cfg)
        rank, W, s = cfg["rank"], cfg["ranks"], cfg["size"]
        dev = device_of(cfg)
        model = build_model(cfg)
        ep = ExpertParallel(model, rank, W)
        store = dist.TCPStore("127.0.0.1", cfg["port"], is_master=False, wait_for_workers=False)
        engine = make_engine(cfg)
        buffer = None
        if cfg["mode"] == "deep_ep":
            from fabric_lib.moe import deep_ep

            dist.init_process_group("gloo", store=dist.PrefixStore(cfg["job"], store), rank=rank, world_size=W)
            buffer = deep_ep.Buffer(None, engine=engine, node_size=cfg["node_size"], timeout_s=60.0,
                                    explicitly_destroy=True)
        paths = {}
        for dtype in cfg["dtypes"]:
            paths[dtype] = DeepEpPath(buffer, cfg, dtype) if buffer else AllToAllPath(engine, store, cfg, rank, dtype)
        conn.send("ready")
        block = moe_blocks(model)[0]
        T = s["block_tokens"]
        x = block_input(cfg)[rank * T:(rank + 1) * T].to(dev)
        ids = prompts(cfg)[rank * s["prompts"]:(rank + 1) * s["prompts"]].to(dev)
        sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
        for dtype in cfg["dtypes"]:
            ep.path = paths[dtype]
            # numpy over the pipe (exact: BF16 into float32): a torch tensor would travel as a shared
            # memory handle that dies with this process.
            for ep.weights_at in placements(dtype):
                conn.send((("block", dtype, ep.weights_at), block(x[None])[0].float().cpu().numpy()))
            ep.weights_at = decode_placement(dtype)
            tokens, logits, step_ms = greedy(model, ids, s["new_tokens"], sync)
            conn.send((("decode", dtype), (tokens.numpy(), logits.float().numpy(), step_ms)))
        for p in paths.values():
            p.close()
        if buffer is not None:
            buffer.destroy()
            dist.destroy_process_group()
        engine.close()
        conn.send("bye")
    except Exception:  # noqa: BLE001 - the failure goes back to the launcher
        conn.send("error " + traceback.format_exc())


# ----------------------------------------------------------------------------- the reference


def fp8_round_trip(x):
    """x as the experts see it after an FP8 dispatch: quantized as the send half quantizes
    (bit for bit), dequantized to BF16 as run_experts does."""
    import torch

    from fabric_lib import moe as M

    return M.dequantize_fp8_tokens(*M.quantize_fp8_tokens(x)).to(torch.bfloat16)


def slot_outputs(experts, x, idx):
    """The model's own experts module on each (token, slot) apart: [n, top-k, hidden] BF16, the
    expert output y_k of token t through expert idx[t, k], weight 1."""
    import torch

    n, k = idx.shape
    y = experts(x.repeat_interleave(k, 0), idx.reshape(-1, 1), torch.ones(n * k, 1, dtype=x.dtype, device=x.device))
    return y.view(n, k, -1)


def fp8_input_error(experts, x, idx, weights):
    """What the e4m3 rounding of the inputs can move the block's output by, per value: each
    input's error bound (2^-4 |x|, or 2^-10 of its block's scale below the normal range) carried
    through each chosen expert in exact arithmetic by its absolute weights, plus 2^-6 of |D| |h|
    for the BF16 roundings inside the expert (which differ between the two inputs); weighted and
    summed over the slots. fp32, [n, hidden]."""
    import torch

    from fabric_lib import moe as M

    xf = x.float()
    n, h = xf.shape
    scale = xf.view(n, h // M.BLOCK, M.BLOCK).abs().amax(2, keepdim=True) / M.E4M3_MAX
    dx = (2.0 ** -4 * xf.abs().view(n, h // M.BLOCK, M.BLOCK) + 2.0 ** -10 * scale).view(n, h)
    inter = experts.down_proj.shape[2]
    out = torch.zeros(n, h, device=x.device)
    for e in idx.unique().tolist():
        t, k = torch.nonzero(idx == e, as_tuple=True)
        gu, down = experts.gate_up_proj[e].float(), experts.down_proj[e].float()
        g, u = (xf[t] @ gu.T).split(inter, 1)
        a, b = (dx[t] @ gu.abs().T).split(inter, 1)
        sg = torch.nn.functional.silu(g)
        dh = 1.1 * a * (u.abs() + b) + sg.abs() * b
        dy = (dh + 2.0 ** -6 * (sg * u).abs()) @ down.abs().T
        out.index_add_(0, t, weights[t, k, None] * dy)
    return out


def sum_bound(model, k: int) -> float:
    """How far, relative to sum_k |w_k y_k|, the model's weighted sum of its experts' outputs may be
    from the combine's: grouped_mm and batched_mm (transformers' defaults) round each w * y to BF16
    and sum in fp32 (3 roundings of 2^-8: the products, each side's final one; 2^-20 for fp32
    sums of up to 8 terms); eager (index_add_ in BF16, expert by expert) rounds after every add:
    k + 2 of them."""
    impl = getattr(model.config, "_experts_implementation", None)
    return (3 if impl in ("grouped_mm", "batched_mm") else k + 2) * U_BF16 + 2.0 ** -20


def block_reference(model, x, dtype: str) -> dict:
    """Check (a)'s reference on the model's first MoE block, all tokens in one process:
    `model`: the unmodified block's output; `exact`: reference_combine_rows over the block's experts
    on each (token, slot) (FP8: on the dequantized tokens), what the EP output must equal bit for
    bit; `bound`: per value, how far the EP output may be from `model`."""
    from fabric_lib import moe as M

    block = moe_blocks(model)[0]
    _, weights, idx = block.gate(x)
    w = weights.float()
    xin = fp8_round_trip(x) if dtype == "fp8" else x
    rows = slot_outputs(block.experts, xin, idx)
    exact = M.reference_combine_rows(idx, w, rows)
    bound = sum_bound(model, idx.shape[1]) * (w.unsqueeze(2).cpu() * rows.float().abs().cpu()).sum(1)
    if dtype == "fp8":
        bound += fp8_input_error(block.experts, x, idx, w).cpu()
    return dict(model=block(x[None])[0].cpu(), exact=exact.cpu(), bound=bound)


def reference(cfg: dict) -> dict:
    """The unmodified model in this process: check (a)'s references per dtype; the greedy decode of
    each rank's prompts as a batch of its own (the shapes each rank's attention and projections
    see: a GPU picks its kernels by them); the step time of decoding all prompts in one batch
    (what one process serving them all takes)."""
    import torch

    setup(cfg)
    model = build_model(cfg)
    dev = device_of(cfg)
    x = block_input(cfg).to(dev)
    blocks = {dtype: block_reference(model, x, dtype) for dtype in cfg["dtypes"]}
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    ids, P, N = prompts(cfg).to(dev), cfg["size"]["prompts"], cfg["size"]["new_tokens"]
    per_rank = [greedy(model, ids[r * P:(r + 1) * P], N, sync) for r in range(cfg["ranks"])]
    step_ms = greedy(model, ids, N, sync)[2]
    experts = getattr(model.config, "_experts_implementation", None)
    del model
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return dict(blocks=blocks, experts=experts,
                tokens=torch.cat([t for t, _, _ in per_rank]),
                logits=torch.cat([lg for _, lg, _ in per_rank]), step_ms=step_ms)


# ----------------------------------------------------------------------------- the launcher


def run(cfg: dict, out=print) -> dict:
    """The reference first (alone, so its step time is not shared with the ranks), then the W
    rank processes (from a fork server that preloaded torch and transformers). Prints one
    `moe-model` line per dispatch dtype through `out`; returns per dtype what was found."""
    import torch.distributed as dist

    s = cfg["size"]
    cfg = dict(cfg, job=cfg.get("job") or uuid.uuid4().hex[:16],
               max_tokens=max(s["prompts"] * s["prompt_len"], s["block_tokens"]))
    ref = reference(cfg)
    ctx = mp.get_context("forkserver")
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # no CUDA init by an import in the fork server
    ctx.set_forkserver_preload(PRELOAD)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    procs = []
    try:
        for r in range(cfg["ranks"]):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=rank_main, args=(child, dict(cfg, rank=r, port=store.port)), daemon=True)
            p.start()
            procs.append((parent, p))
        got = collect([conn for conn, _ in procs])
    finally:
        for _, p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    found = {dtype: verdict(cfg, ref, got, dtype, out) for dtype in cfg["dtypes"]}  # every line printed first
    problems = [f"{r['line']}\n" + "\n".join(r["problems"]) for r in found.values() if r["problems"]]
    if problems:
        raise AssertionError("\n".join(problems))
    return found


def collect(conns: list, timeout: float = 600) -> list:
    """Every rank's messages up to "bye", read as they arrive: per rank {("block", dtype,
    weights_at): out, ("decode", dtype): (tokens, logits, ms)}. Read rank by rank instead, a rank
    blocked sending its decode logits (~40 MB at the real vocabulary, more than a pipe holds) would
    stall the collective calls of the rank being read. A rank's error raises at once."""
    from multiprocessing.connection import wait

    got = [{} for _ in conns]
    open_ranks = dict((conn, r) for r, conn in enumerate(conns))
    while open_ranks:
        arrived = wait(list(open_ranks), timeout)
        if not arrived:
            raise RuntimeError(f"ranks {sorted(open_ranks.values())}: nothing in {timeout} s")
        for conn in arrived:
            r = open_ranks[conn]
            try:
                msg = conn.recv()
            except EOFError:
                raise RuntimeError(f"rank {r}: its process ended after {sorted(got[r])}") from None
            if isinstance(msg, str) and msg.startswith("error"):
                raise RuntimeError(f"rank {r}: {msg}")
            if msg == "bye":
                del open_ranks[conn]
            elif msg != "ready":
                got[r][msg[0]] = msg[1]
    return got


def verdict(cfg: dict, ref: dict, got: list, dtype: str, out) -> dict:
    """Checks (a) and (b) for one dispatch dtype and prints the line; returns what was found,
    with `problems`: each required check that failed, said."""
    import torch

    W, s = cfg["ranks"], cfg["size"]
    b = ref["blocks"][dtype]

    def ep_block(weights_at):
        return torch.cat([torch.from_numpy(g[("block", dtype, weights_at)]) for g in got]).to(torch.bfloat16)

    def equal(x, y):
        return torch.equal(x.view(torch.int16), y.view(torch.int16))

    # Exact: weights in combine against reference_combine_rows over the model's experts; weights in
    # the experts (BF16) against the model's block itself.
    exact = {"combine": equal(ep_block("combine"), b["exact"])}
    if "expert" in placements(dtype):
        exact["expert"] = equal(ep_block("expert"), b["model"])
    block_exact = all(exact.values())
    diff = (ep_block("combine").float() - b["model"].float()).abs()
    block_ratio = (diff / b["bound"]).nan_to_num(0.0, posinf=float("inf")).max().item()
    tokens = torch.cat([torch.from_numpy(g[("decode", dtype)][0]) for g in got])
    logits = torch.cat([torch.from_numpy(g[("decode", dtype)][1]) for g in got])
    same_tokens = torch.equal(tokens, ref["tokens"])
    max_logit_diff = (logits.float() - ref["logits"].float()).abs().max().item()
    # A decode step is as slow as its slowest rank.
    per_step = [max(g[("decode", dtype)][2][i] for g in got) for i in range(s["new_tokens"] - 1)]
    step_ms, single_ms = statistics.median(per_step), statistics.median(ref["step_ms"])
    line = (f"moe-model ranks={W} mode={cfg['mode']} dtype={dtype} tokens_identical={'yes' if same_tokens else 'no'} "
            f"max_logit_diff={max_logit_diff:.4g} step_ms={step_ms:.2f} single_ms={single_ms:.2f} "
            f"ratio={step_ms / single_ms:.2f} block_exact={'yes' if block_exact else 'no'} "
            f"block_bound={block_ratio:.3f} weights={decode_placement(dtype)} experts={ref['experts']}")
    out(line)
    problems = []
    if block_ratio > 1:
        problems.append(f"the EP block is {block_ratio:.3f} x its {dtype} bound away from the model's block")
    if cfg["device"] == "cpu" and not block_exact:
        problems.append(f"the EP block is not bit for bit its reference (weights in combine, weights in the "
                        f"experts): {exact}")
    if dtype == "bf16" and not same_tokens:
        rows = (tokens != ref["tokens"]).any(1).nonzero().flatten().tolist()
        problems.append(f"prompts {rows} decoded other tokens: {tokens[rows].tolist()} vs {ref['tokens'][rows].tolist()}")
    return dict(line=line, problems=problems, tokens_identical=same_tokens, max_logit_diff=max_logit_diff, block_exact=block_exact,
                block_bound=block_ratio, step_ms=step_ms, single_ms=single_ms)


def config(args) -> dict:
    cuda = args.device == "cuda"
    ranks = args.ranks or (8 if cuda else 4)
    return dict(mode=args.mode, ranks=ranks, node_size=args.node_size or (ranks if cuda else 2),
                provider=PROVIDERS.get(args.provider, args.provider), dtypes=args.dtypes.split(","),
                size=dict(SIZES[args.size or ("gpu" if cuda else "tiny")]), device=args.device, seed=args.seed,
                threads=args.threads)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", default="all_to_all", choices=["all_to_all", "deep_ep"])
    ap.add_argument("--ranks", type=int, default=None, help="EP ranks (4 on the CPU, 8 on CUDA)")
    ap.add_argument("--node-size", type=int, default=None, help="ranks per node (2 on the CPU, all on CUDA)")
    ap.add_argument("--provider", default="tcp", help="tcp or shm: the engine between nodes (on CUDA the ranks are one node)")
    ap.add_argument("--dtypes", default="bf16,fp8", help="dispatch dtypes, each checked and decoded")
    ap.add_argument("--size", default=None, choices=sorted(SIZES), help="tiny on the CPU, gpu on CUDA")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    return ap.parse_args(argv)


def main() -> int:
    args = parse_args()
    cfg = config(args)
    t0 = time.monotonic()
    import transformers

    print(f"transformers {transformers.__version__}; {cfg['ranks']} EP ranks ({cfg['mode']}, node_size {cfg['node_size']}, "
          f"{'GPU 0' if args.device == 'cuda' else cfg['provider']}), qwen3_moe {cfg['size']}")
    try:
        run(cfg)
    except AssertionError as e:
        print(f"FAILED: {e}")
        return 1
    print(f"done in {time.monotonic() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
