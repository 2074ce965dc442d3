"""Disaggregated prefill/decode with a real transformers model: each layer's K and V go from the
prefill processes to the decode processes as the layer finishes, and decode generates from them.

    python3 examples/kv_transfer/kv_model.py [--provider shm] [--tp 2to1]      # CPU, tiny Qwen3
    python3 examples/kv_transfer/kv_model.py --device cuda [--tp 1to2]         # GPU, Qwen3-8B shape

The model is transformers' Qwen3 built from a config with random weights (the same seed in every
process, so every process holds the same weights; nothing is downloaded). The prompts are random
token ids (fixed seed).

- Prefill (TP P, P processes): a forward over the batch of prompts. A forward hook on each decoder
  layer copies that layer's K and V (after RoPE: what the attention just stored in the transformers
  cache) into a paged cache laid out as vLLM's FlashAttention backend keeps it (NHD pages, or HND
  with --kv-layout HND; see PagedCache), and calls
  KvSender.layer_done for every request: the layer's pages go out while the next layer computes.
  The last-token logits go as the request's extras (the first generated token comes from them).
  Every prefill rank runs the whole model (this example is about the cache, not about splitting the
  compute); like a TP-sharded attention, rank r keeps only its KV heads [r*H/P, (r+1)*H/P) in its
  paged cache, and the library splits and merges heads between the two TP sizes.
- Decode (TP D, D processes): admits one request per prompt into blocks scattered over its cache
  (as a block allocator hands them out), waits until every layer and the extras landed, and
  rebuilds a transformers DynamicCache from its pages. At TP 2, rank 1 sends its half of the heads
  to rank 0 (a pipe; not timed), which runs the model: greedy decode of --new-tokens tokens.
- Check, exact: the tokens equal those of model.generate() run in one process (the decode rank 0)
  on the same prompts; max_logit_diff, the largest |logit difference| at the first two generated
  positions (the prefill's last-position logits that came as extras, and decode's first forward
  over the received cache), is 0; the received cache equals generate()'s prefill cache bit for bit
  (kv_identical). For that every process runs the same deterministic kernels with the same inputs
  (--attn names the attention; see deterministic() and positions()); the script exits 1 otherwise
  and says which of the three differed.

Prints `kv-model model=... layers=... prompts=... prompt_len=... tp=PtoD tokens_identical=yes|no
max_logit_diff=... prefill_ms=... exposed_ms=... decode_tok_s=... kv_layout=NHD|HND kv_identical=yes|no
attn=sdpa|eager`: prefill_ms is the slowest
prefill rank's forward (hooks and copies into the pages included), exposed_ms the time from the
last layer finishing on the last prefill rank to that layer having landed for every request on
every decode rank (the transfer not hidden behind compute), decode_tok_s the generated tokens per
second of decode's forwards over the received cache (batch x steps after the first token / time).
CPU and CUDA share every line but device and dtype (CPU: float32 over tcp or shm; CUDA: BF16 on
GPU 0, every process sharing it through cuda_ipc).
"""

from __future__ import annotations

import argparse
import inspect
import multiprocessing as mp
import os
import queue
import sys
import threading
import time
import traceback
import uuid

import numpy as np

BLOCK = 16  # tokens per page (vLLM's default block_size)
PREFILL_GROUP, DECODE_GROUP = 1, 11

# Model shapes (transformers Qwen3Config keywords). "qwen3-8b": Qwen3-8B's shapes (its config.json);
# --layers can cut the depth where memory is short.
SHAPES = {
    "qwen3-tiny": dict(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=32),
    "qwen3-8b": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                     max_position_embeddings=40960, tie_word_embeddings=False),
}
# What a preloaded fork server imports once, so that each role process starts with them (importing
# torch and transformers costs seconds per process on a small machine). Nothing that could touch
# CUDA: a process forked after CUDA was initialized cannot use it. fabric_lib (0.2 s) is imported
# by each role, as a CUDA build's extension might initialize CUDA when loaded.
PRELOAD = ["numpy", "torch", "transformers", "transformers.models.qwen3.modeling_qwen3"]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--provider", default="tcp;ofi_rxm", help="CPU: tcp;ofi_rxm or shm (CUDA: cuda_ipc)")
    ap.add_argument("--tp", default="1to1", help="prefill TP 'to' decode TP: 1to1, 2to1, 1to2, 2to2")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], help="default: float32 on cpu, bfloat16 on cuda")
    ap.add_argument("--shape", choices=sorted(SHAPES), help="default: qwen3-tiny on cpu, qwen3-8b on cuda")
    ap.add_argument("--layers", type=int, help="decoder layers (default: the shape's)")
    ap.add_argument("--prompts", type=int, help="default: 4 on cpu, 8 on cuda")
    ap.add_argument("--prompt-len", type=int, help="tokens per prompt (default: 60 on cpu, 2048 on cuda)")
    ap.add_argument("--new-tokens", type=int, help="tokens to generate (default: 8 on cpu, 32 on cuda)")
    ap.add_argument("--kv-layout", choices=["NHD", "HND"], default="NHD",
                    help="the paged cache's memory order (vLLM's get_kv_cache_layout): NHD token-major, "
                         "HND head-major (one WRITE per block where prefill and decode TP differ)")
    ap.add_argument("--attn", choices=["sdpa", "eager"], default="sdpa",
                    help="transformers attn_implementation, the same in every process (prefill, decode and the "
                         "generate() reference); on CUDA, SDPA runs FlashAttention only (see deterministic())")
    ap.add_argument("--threads", type=int, default=1,
                    help="CPU: torch threads per process (the same in every process: results are bit-equal)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds for pairing and for each wait")
    ap.add_argument("--verbose", action="store_true", help="each process prints its phases (stderr)")
    a = ap.parse_args(argv)
    cuda = a.device == "cuda"
    a.dtype = a.dtype or ("bfloat16" if cuda else "float32")
    a.shape = a.shape or ("qwen3-8b" if cuda else "qwen3-tiny")
    a.layers = a.layers or SHAPES[a.shape]["num_hidden_layers"]
    a.prompts = a.prompts or (8 if cuda else 4)
    a.prompt_len = a.prompt_len or (2048 if cuda else 60)
    a.new_tokens = a.new_tokens or (32 if cuda else 8)
    try:
        a.prefill_tp, a.decode_tp = (int(x) for x in a.tp.split("to"))
    except ValueError:
        ap.error(f"--tp {a.tp!r}: want PtoD, e.g. 2to1")
    heads = SHAPES[a.shape]["num_key_value_heads"]
    if heads % a.prefill_tp or heads % a.decode_tp:
        ap.error(f"{heads} KV heads do not split over TP {a.prefill_tp} and {a.decode_tp}")
    return a


# ---- the model (shared by every role) ----

def device_dtype(a):
    import torch

    return torch.device("cuda", 0) if a.device == "cuda" else torch.device("cpu"), getattr(torch, a.dtype)


def build_model(a):
    """The same random-weight Qwen3 in every process: built from a config under one seed, directly on
    the device in the run's dtype (no CPU copy of an 8B model)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    device, dtype = device_dtype(a)
    cfg = AutoConfig.for_model("qwen3", **dict(SHAPES[a.shape], num_hidden_layers=a.layers))
    torch.manual_seed(a.seed)  # seeds the CPU and the CUDA generators
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg, attn_implementation=a.attn)
    finally:
        torch.set_default_dtype(previous)
    # Named, not left to transformers' default: the reference and decode must run the same kernels.
    assert model.config._attn_implementation == a.attn, model.config._attn_implementation
    model.generation_config.eos_token_id = None  # generate exactly --new-tokens tokens
    model.generation_config.pad_token_id = 0
    return model.eval()


def fingerprint(model) -> float:
    """A sum over every weight: equal in every process, or the weights differ."""
    import torch

    with torch.no_grad():
        return float(sum(p.sum(dtype=torch.float64) for p in model.parameters()))  # no float64 copy


def prompts(a):
    import torch

    g = torch.Generator().manual_seed(a.seed + 1)
    return torch.randint(0, SHAPES[a.shape]["vocab_size"], (a.prompts, a.prompt_len), generator=g)


def cache_kwarg(model) -> str:
    """The forward's cache keyword: `cache` from transformers 5.2x, `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def new_cache(model):
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:  # transformers without DynamicCache(config=...)
        return DynamicCache()


def layer_kv(cache, layer: int):
    """One layer's (keys, values) of a transformers cache: [batch, kv_heads, tokens, head_dim]."""
    if hasattr(cache, "layers"):  # transformers >= 4.56
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- the paged cache ----

class PagedCache:
    """One rank's paged KV cache in vLLM's FlashAttention layout: per layer one tensor of shape
    [2, num_blocks, block_size, num_kv_heads, head_dim] (FlashAttentionBackend.get_kv_cache_shape,
    vllm/v1/attention/backends/flash_attn.py), K = [0] and V = [1], each contiguous: fabric_lib's
    pages, one per block, K and V as separate tensors. Memory order (vLLM's get_kv_cache_layout):
    NHD, the default, [.., block_size, kv_heads, head_dim] (PageOrder.TOKEN_MAJOR); HND, what vLLM
    switches to under its NIXL connector "for faster transfer" (get_kv_connector_cache_layout),
    [.., kv_heads, block_size, head_dim] (PageOrder.HEAD_MAJOR: a rank's heads of a block are one
    run, so where prefill and decode TP differ it is one WRITE per block instead of one per token)."""

    def __init__(self, layers: int, blocks: int, heads: int, head_dim: int, dtype, device,
                 order: str = "NHD") -> None:
        import torch

        from fabric_lib import kv

        inner = (BLOCK, heads, head_dim) if order == "NHD" else (heads, BLOCK, head_dim)
        self.kv = [torch.zeros(2, blocks, *inner, dtype=dtype, device=device) for _ in range(layers)]
        self.k = [t[0] for t in self.kv]  # registered: contiguous, in memory order
        self.v = [t[1] for t in self.kv]
        # [2, blocks, block_size, heads, head_dim] views whatever the memory order
        self.logical = [t if order == "NHD" else t.transpose(2, 3) for t in self.kv]
        self.layout = kv.make_layout(num_layers=layers, num_pages=blocks, page_tokens=BLOCK, kv_heads=heads,
                                     head_dim=head_dim, dtype_bytes=self.kv[0].element_size(),
                                     order=kv.PageOrder.TOKEN_MAJOR if order == "NHD" else kv.PageOrder.HEAD_MAJOR)

    @staticmethod
    def slots(table, tokens: int):
        """vLLM's slot mapping, as (block, offset): token t of request b is in block table[b, t // 16]
        at offset t % 16. Flattened over [batch, tokens]."""
        import torch

        t = torch.arange(tokens, device=table.device)
        return table[:, t // BLOCK].reshape(-1), (t % BLOCK).repeat(table.shape[0])

    def write(self, layer: int, table, keys, values) -> None:
        """keys, values: [batch, heads, tokens, head_dim] (this rank's heads) into the blocks of table."""
        b, h, s, d = keys.shape
        block, offset = self.slots(table, s)
        for i, x in ((0, keys), (1, values)):
            self.logical[layer][i][block, offset] = x.transpose(1, 2).reshape(b * s, h, d)

    def read(self, layer: int, table, tokens: int):
        """(keys, values) [batch, heads, tokens, head_dim] of the blocks of table."""
        block, offset = self.slots(table, tokens)
        b = table.shape[0]
        return tuple(self.logical[layer][i][block, offset].view(b, tokens, *self.logical[layer].shape[3:])
                     .transpose(1, 2).contiguous() for i in (0, 1))


# ---- the roles ----

def _engine(a):
    import fabric_lib as fl

    if a.device == "cuda":  # same-host GPU peers through CUDA IPC (NVLink), as tests/gpu does
        return fl.TransferEngine(cuda_device=0, cuda_ipc=True, transfer_timeout_s=10.0)
    return fl.TransferEngine(provider=a.provider, nics=[""] if a.provider == "shm" else ["127.0.0.1"],
                             transfer_timeout_s=10.0)


def _directory(a, port: int):
    """The membership directory: a torch TCPStore the launcher serves (no etcd needed)."""
    import torch.distributed as dist

    from fabric_lib.directory import StoreDirectory

    store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
    return StoreDirectory(store, ttl_s=5.0, prefix=f"kv-model/{a.cluster}/")


def _log(a, who: str, what: str) -> None:
    if a.verbose:
        print(f"{time.time() - a.t0:8.3f} s  {who}: {what}", file=sys.stderr, flush=True)


def deterministic(a) -> None:
    """Every process computes with the same kernels, each deterministic, so that decode from the
    received cache is bit for bit the generate() of one process (checked: tokens, logits and the cache
    itself). On the CPU that held already; on CUDA (an H100, BF16, 2 -> 1 at 18 layers) the tokens
    and logits differed (max_logit_diff 0.113) while the code paths were the same. What may vary
    between two processes there, and is pinned here:
    - SDPA's backend. PyTorch picks among FlashAttention, memory-efficient, cuDNN and math per call
      (by dtype, strides, mask, shape, and on Hopper it may prefer cuDNN, whose plans come from
      heuristics over the build and the tensors and whose backward is non-deterministic). Only
      FlashAttention stays on (math as the fallback, in both processes alike): its forward is
      deterministic and its choices (split-KV for the single-token steps among them) depend on the
      shapes alone, which both sides share. --attn eager avoids SDPA altogether.
    - cuBLAS: a fixed workspace (CUBLAS_WORKSPACE_CONFIG, read when a handle is made: before the
      first matmul) and torch's deterministic algorithms (warn_only: an op without a deterministic
      CUDA kernel warns in the output instead of failing the run)."""
    import torch

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    if a.device == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        torch.backends.cuda.enable_flash_sdp(True)
        torch.backends.cuda.enable_math_sdp(True)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False


def positions(mask):
    """Position ids as generate() makes them from the attention mask (cumsum - 1), [batch, tokens]:
    the forward given none would make them [1, tokens] from cache_position, the same values through
    other shapes (the RoPE tables broadcast over the batch instead of one per row); prefill and
    decode pass these so that every op sees what it sees under generate()."""
    return mask.long().cumsum(-1) - 1


def _setup(a):
    import torch

    if a.device == "cpu":
        torch.set_num_threads(a.threads)
    torch.set_grad_enabled(False)
    deterministic(a)


class LayerNotifier:
    """Tells the KvSender that a layer's pages (or the extras) are written. On the CPU a copy is done
    when it returns: layer_done is called at once. On CUDA the forward runs ahead of the GPU: a CUDA
    event is recorded after the copies and a thread calls layer_done once it completed, so the
    forward is never stalled. (A CUDA graph would instead bump KvSender.gpu_trigger() from a kernel;
    tests/gpu/test_python_gpu.py shows that path.) extras: this rank writes the requests' extras
    (TP rank 0) and says when they are ready; on the other ranks a request ends once its last layer
    is written, and extras_done would no longer find it."""

    def __init__(self, tx, requests, device, *, extras: bool) -> None:
        self.tx, self.requests, self.device, self.extras = tx, list(requests), device, extras
        self.finished: dict = {}  # layer (or "extras") -> time.time() when it was written
        self.errors: list = []
        self._q: "queue.Queue" = queue.Queue()
        self._thread = None
        if device.type == "cuda":
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()

    def mark(self, what) -> None:
        import torch

        if self._thread is None:
            self._done(what)
            return
        ev = torch.cuda.Event()
        ev.record()
        self._q.put((what, ev))

    def _run(self) -> None:
        while True:
            what, ev = self._q.get()
            if what is None:
                return
            ev.synchronize()
            self._done(what)

    def _done(self, what) -> None:
        self.finished[what] = time.time()
        if what == "extras" and not self.extras:
            return  # a rank that writes no extras has nothing to say (its requests may have ended)
        for r in self.requests:
            try:
                if what == "extras":
                    self.tx.extras_done(r)
                else:
                    self.tx.layer_done(r, what)
            except Exception as e:  # noqa: BLE001 - the request was cancelled by its decode side
                self.errors.append(f"request {r} {what}: {e}")

    def close(self) -> None:
        if self._thread is not None:
            self._q.put((None, None))
            self._thread.join()


def prefill_main(rank: int, a, port: int, results, sync_point, leave) -> None:
    """A prefill rank: waits for the decode side's requests (one per prompt), then one hooked forward
    over the batch; every layer's pages go out as the layer ends, the logits last (extras). It stays
    in the directory until `leave` is set (every process reported): a decode rank that admits after
    the data was sent still needs to find the prefill group there (Decoder.admit counts its ranks)."""
    try:
        import torch

        from fabric_lib import kv

        who = f"prefill {rank}"
        _log(a, who, "started")
        _setup(a)
        device, dtype = device_dtype(a)
        model = build_model(a)
        _log(a, who, "model built")
        ids = prompts(a).to(device)
        mask = torch.ones_like(ids)
        cfg = SHAPES[a.shape]
        heads = cfg["num_key_value_heads"] // a.prefill_tp
        mine = slice(rank * heads, (rank + 1) * heads)  # the KV heads a TP-sharded attention holds here
        per_request = -(-a.prompt_len // BLOCK)
        # This rank's blocks: request b holds blocks b * per_request ... (any placement would do).
        table = torch.arange(a.prompts * per_request, device=device).view(a.prompts, per_request)
        cache = PagedCache(a.layers, a.prompts * per_request, heads, cfg["head_dim"], dtype, device, a.kv_layout)
        extras = torch.zeros(a.prompts, cfg["vocab_size"], dtype=dtype, device=device)  # last-token logits
        kw = cache_kwarg(model)
        model(ids[:, :BLOCK], attention_mask=mask[:, :BLOCK], position_ids=positions(mask[:, :BLOCK]),
              **{kw: new_cache(model)}, use_cache=True, logits_to_keep=1)  # warm-up (kernels, allocator): not timed, not sent
        sync(device)
        with _engine(a) as engine, _directory(a, port) as d:
            tx = kv.KvSender(engine, cache.layout, cache.k, cache.v, group=PREFILL_GROUP, tp_size=a.prefill_tp,
                             tp_rank=rank, total_heads=cfg["num_key_value_heads"], extras=extras,
                             extra_slots=a.prompts)
            pf = kv.Prefiller(engine, tx, d, cluster=a.cluster)
            pf.watch(0.2)
            _log(a, who, "in the directory, waiting for requests")
            admitted = {}
            while len(admitted) < a.prompts:  # request b + 1 is prompt b (admits may come in any order)
                req = pf.next_request(timeout=a.timeout)
                if req is None:
                    raise TimeoutError(f"prefill rank {rank}: {len(admitted)} of {a.prompts} requests came")
                admitted[req.request] = req
            sent, all_sent = [], threading.Event()

            def on_sent(status):
                sent.append(status)
                if len(sent) == a.prompts:
                    all_sent.set()

            for b in range(a.prompts):  # extras: TP rank 0 writes them, to every decode rank
                pf.begin(admitted[b + 1], table[b].tolist(), extra_slot=b if rank == 0 else None,
                         on_sent=on_sent)
            sync_point.wait(a.timeout)  # every decode rank admitted: the timings measure the transfer only
            _log(a, who, "requests begun, forward")
            notifier = LayerNotifier(tx, range(1, a.prompts + 1), device, extras=rank == 0)
            live = new_cache(model)

            def hook(layer):
                def after_layer(module, args, output):
                    keys, values = layer_kv(live, layer)  # RoPE applied, as the attention stored them
                    cache.write(layer, table, keys[:, mine], values[:, mine])
                    notifier.mark(layer)
                return after_layer

            handles = [m.register_forward_hook(hook(i)) for i, m in enumerate(model.model.layers)]
            t0 = time.time()
            out = model(ids, attention_mask=mask, position_ids=positions(mask), **{kw: live}, use_cache=True,
                        logits_to_keep=1)
            extras.copy_(out.logits[:, -1])
            notifier.mark("extras")
            sync(device)
            prefill_s = time.time() - t0
            notifier.close()
            for h in handles:
                h.remove()
            if not all_sent.wait(a.timeout):
                raise TimeoutError(f"prefill rank {rank}: {len(sent)} of {a.prompts} requests sent")
            bad = [s.message for s in sent if not s.ok] + notifier.errors
            _log(a, who, f"forward {prefill_s * 1e3:.1f} ms, every request sent")
            results.put(dict(role="prefill", rank=rank, ok=not bad, error="; ".join(bad),
                             prefill_ms=prefill_s * 1e3, last_layer_t=notifier.finished[a.layers - 1],
                             fingerprint=fingerprint(model)))
            leave.wait(3 * a.timeout)
            pf.close()
    except Exception:  # noqa: BLE001 - reported to the launcher
        results.put(dict(role="prefill", rank=rank, ok=False, error=traceback.format_exc()))


def _to_wire(tensors):
    """Tensors as (dtype name, shape, bytes) for a pipe (bfloat16 has no numpy type)."""
    import torch

    return [(str(t.dtype), tuple(t.shape), t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
            for t in tensors]


def _from_wire(items, device):
    import torch

    return [torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(getattr(torch, dt.split(".")[1]))
            .view(shape).to(device) for dt, shape, raw in items]


def decode_main(rank: int, a, port: int, results, sync_point, leave, pipes) -> None:
    """A decode rank: admits the prompts' requests, waits for every layer and the extras, rebuilds
    the cache; rank 0 gathers the other ranks' heads and generates (pipes: rank 0 reads one per
    other rank; rank k > 0 writes its own). It stays in the directory, its engine open, until
    `leave` is set: a prefill rank that saw the group go would end its requests as cancelled, even
    those whose writes all landed but whose completions it has not seen yet."""
    try:
        import torch

        from fabric_lib import kv

        who = f"decode {rank}"
        _log(a, who, "started")
        _setup(a)
        device, dtype = device_dtype(a)
        cfg = SHAPES[a.shape]
        heads = cfg["num_key_value_heads"] // a.decode_tp
        per_request = -(-a.prompt_len // BLOCK)
        blocks = 2 * a.prompts * per_request
        # Blocks scattered over the cache, as an allocator hands them out; the same on every rank.
        order = np.random.default_rng(a.seed + 2).permutation(blocks)[:a.prompts * per_request]
        table = torch.as_tensor(order, device=device).view(a.prompts, per_request)
        cache = PagedCache(a.layers, blocks, heads, cfg["head_dim"], dtype, device, a.kv_layout)
        extras = torch.zeros(a.prompts, cfg["vocab_size"], dtype=dtype, device=device)
        model = build_model(a) if rank == 0 else None
        landed_t, done, statuses = [], threading.Event(), []

        def on_layer(layer):
            if layer == a.layers - 1:
                landed_t.append(time.time())

        def on_done(status):
            statuses.append(status)
            if len(statuses) == a.prompts:
                done.set()

        with _engine(a) as engine, _directory(a, port) as d:
            rx = kv.KvReceiver(engine, cache.layout, cache.k, cache.v, group=DECODE_GROUP, tp_size=a.decode_tp,
                               tp_rank=rank, total_heads=cfg["num_key_value_heads"], extras=extras,
                               extra_slots=a.prompts)
            dec = kv.Decoder(engine, rx, d, cluster=a.cluster)
            _log(a, who, "in the directory, pairing")
            dec.wait_paired(PREFILL_GROUP, timeout_s=a.timeout)
            _log(a, who, "paired, admitting")
            for b in range(a.prompts):
                dec.admit(b + 1, table[b].tolist(), prefill_group=PREFILL_GROUP, extra_slot=b,
                          timeout_s=a.timeout, on_layer=on_layer, on_done=on_done)
            sync_point.wait(a.timeout)
            if not done.wait(a.timeout + 10):
                raise TimeoutError(f"decode rank {rank}: {len(statuses)} of {a.prompts} requests ended")
            bad = [s.message for s in statuses if not s.ok]
            _log(a, who, "every request landed")
            if bad:
                raise RuntimeError(f"decode rank {rank}: requests failed: {bad}")
            received = [cache.read(layer, table, a.prompt_len) for layer in range(a.layers)]
            result = dict(role="decode", rank=rank, ok=True, error="", landed_t=max(landed_t))
            if rank > 0:  # rank 0 runs the model on every head
                pipes.send(_to_wire([t for kv_ in received for t in kv_]))
            else:
                for pipe in pipes:  # the other ranks' heads, in rank order: heads [k * H / D, ...)
                    flat = _from_wire(pipe.recv(), device)
                    received = [(torch.cat([k, flat[2 * i]], 1), torch.cat([v, flat[2 * i + 1]], 1))
                                for i, (k, v) in enumerate(received)]
                _log(a, who, "cache gathered, generating")
                result.update(generate_and_check(a, model, received, extras))
                _log(a, who, "generated and checked")
            results.put(result)
            leave.wait(3 * a.timeout)
            dec.close()
    except Exception:  # noqa: BLE001 - reported to the launcher
        results.put(dict(role="decode", rank=rank, ok=False, error=traceback.format_exc()))


def generate_and_check(a, model, received, extras) -> dict:
    """Greedy decode from the received cache, then the same model's generate() on the prompts in
    this process, compared: the tokens, the logits at the first two positions, and the received
    cache against the one generate()'s own prefill made (bit for bit: a difference there is the
    transfer's or the prefill's, one only in the logits is decode's)."""
    import torch

    device, _ = device_dtype(a)
    ids = prompts(a).to(device)
    kw = cache_kwarg(model)
    cache = new_cache(model)
    for layer, (k, v) in enumerate(received):
        cache.update(k, v, layer)  # contiguous [batch, heads, tokens, head_dim], as generate()'s cache
    received.clear()  # the cache holds its own copy
    first = extras.float()  # the prefill's last-position logits
    token = first.argmax(-1)
    tokens, step_logits = [token], []
    mask = torch.ones(a.prompts, a.prompt_len + 1, dtype=torch.long, device=device)
    sync(device)
    t0 = time.time()
    for _ in range(a.new_tokens - 1):  # as generate() calls it: the new token, the mask, its position, the cache
        out = model(token[:, None], attention_mask=mask, position_ids=positions(mask)[:, -1:].contiguous(),
                    **{kw: cache}, use_cache=True, logits_to_keep=1)
        logits = out.logits[:, -1].float()
        if not step_logits:
            step_logits.append(logits)
        token = logits.argmax(-1)
        tokens.append(token)
        mask = torch.cat([mask, mask[:, :1]], 1)
    sync(device)
    decode_s = time.time() - t0
    tokens = torch.stack(tokens, 1)
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=a.new_tokens,
                         do_sample=False, output_logits=True, return_dict_in_generate=True)
    ref_tokens = ref.sequences[:, a.prompt_len:]
    first_diff = (first - ref.logits[0].float()).abs().max().item()
    step_diff = (step_logits[0] - ref.logits[1].float()).abs().max().item() if step_logits else 0.0
    ref_cache = next((ref[k] for k in ("cache", "past_key_values") if k in ref), None)  # 5.2x: "cache"
    kv_diff, kv_bad_layers = 0.0, []
    if ref_cache is not None:
        P = a.prompt_len
        for layer in range(a.layers):
            for x, y in zip(layer_kv(cache, layer), layer_kv(ref_cache, layer)):
                x, y = x[:, :, :P], y[:, :, :P]
                if not torch.equal(x, y):
                    kv_bad_layers.append(layer)
                    kv_diff = max(kv_diff, (x.float() - y.float()).abs().max().item())
    steps = a.prompts * (a.new_tokens - 1)
    return dict(tokens_identical=bool(torch.equal(tokens, ref_tokens)), max_logit_diff=max(first_diff, step_diff),
                first_logit_diff=first_diff, step_logit_diff=step_diff,
                kv_identical=None if ref_cache is None else not kv_bad_layers, kv_max_diff=kv_diff,
                kv_bad_layers=sorted(set(kv_bad_layers)),
                decode_tok_s=steps / decode_s if decode_s > 0 else 0.0, fingerprint=fingerprint(model),
                tokens=tokens.tolist(), ref_tokens=ref_tokens.tolist())


# ---- the launcher ----

def run(a) -> dict:
    """Starts the P prefill and D decode processes and gathers what they measured. Returns the
    fields of the kv-model line, with ok (every process succeeded and the weights agree) and error."""
    import torch.distributed as dist

    a.cluster = uuid.uuid4().hex
    a.t0 = time.time()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("forkserver")
    # torch.cuda.is_available() through NVML, should anything call it in the fork server: the CUDA
    # runtime's own check would initialize CUDA there, and the forked roles could not use it.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    ctx.set_forkserver_preload(PRELOAD)  # once per launcher process; later calls change nothing
    results = ctx.Queue()
    # Every process passes sync_point once the requests are admitted on every decode rank (and begun
    # on every prefill rank); they leave the directory and close their engines when `leave` is set,
    # once every process reported (or one failed).
    sync_point, leave = ctx.Barrier(a.prefill_tp + a.decode_tp), ctx.Event()
    pipes = [ctx.Pipe(duplex=False) for _ in range(a.decode_tp - 1)]  # (rank 0 reads, rank k writes)
    procs = [ctx.Process(target=prefill_main, args=(r, a, store.port, results, sync_point, leave), daemon=True)
             for r in range(a.prefill_tp)]
    procs += [ctx.Process(target=decode_main, daemon=True,
                          args=(r, a, store.port, results, sync_point, leave,
                                [p[0] for p in pipes] if r == 0 else pipes[r - 1][1]))
              for r in range(a.decode_tp)]
    for p in procs:
        p.start()
    got, deadline = [], time.monotonic() + 3 * a.timeout + 60
    while len(got) < len(procs) and time.monotonic() < deadline:
        try:
            got.append(results.get(timeout=1.0))
            if not got[-1]["ok"]:
                break  # one failed: the others may wait for it forever
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                break
    leave.set()
    if len(got) < len(procs) or not all(g["ok"] for g in got):
        sync_point.abort()  # a process waiting there gives up (BrokenBarrierError)
        time.sleep(1.0)  # the others report what they saw
        while True:
            try:
                got.append(results.get_nowait())
            except queue.Empty:
                break
    for p in procs:
        p.join(5 if len(got) == len(procs) and all(g["ok"] for g in got) else 0.1)
        if p.is_alive():
            _log(a, "launcher", f"pid {p.pid} still running: killed")
            p.kill()
            p.join()
    _log(a, "launcher", "every process ended")
    del store
    errors = [f"{g['role']} rank {g['rank']}: {g['error']}" for g in got if not g["ok"]]
    if len(got) < len(procs) and not errors:
        errors.append(f"{len(procs) - len(got)} process(es) gave no result (exit codes "
                      f"{[p.exitcode for p in procs]})")
    out = dict(ok=not errors, error="\n".join(errors), model=a.shape, layers=a.layers, prompts=a.prompts,
               prompt_len=a.prompt_len, tp=a.tp, kv_layout=a.kv_layout)
    if errors:
        return out
    pre = [g for g in got if g["role"] == "prefill"]
    dec = [g for g in got if g["role"] == "decode"]
    lead = next(g for g in dec if g["rank"] == 0)
    prints = {g["fingerprint"] for g in pre} | {lead["fingerprint"]}
    out.update(tokens_identical=lead["tokens_identical"], max_logit_diff=lead["max_logit_diff"],
               prefill_ms=max(g["prefill_ms"] for g in pre),
               exposed_ms=(max(g["landed_t"] for g in dec) - max(g["last_layer_t"] for g in pre)) * 1e3,
               decode_tok_s=lead["decode_tok_s"], tokens=lead["tokens"], ref_tokens=lead["ref_tokens"],
               **{k: lead[k] for k in ("first_logit_diff", "step_logit_diff", "kv_identical", "kv_max_diff",
                                       "kv_bad_layers")}, attn=a.attn)
    # Exact, not close: with the same deterministic kernels on both sides (deterministic()) the
    # transferred cache, the logits and so the tokens are bit for bit generate()'s. A tolerance would
    # hide what matters here (a wrong head, token or layer moves the logits by little), and with
    # random weights BF16 logits tie or nearly tie often, so "close" logits need not give the
    # same greedy tokens anyway.
    out["exact"] = bool(out["tokens_identical"] and out["max_logit_diff"] == 0 and out["kv_identical"] is not False)
    if len(prints) != 1:
        out.update(ok=False, error=f"the processes' weights differ (fingerprints {sorted(prints)})")
    return out


def line(r: dict) -> str:
    return (f"kv-model model={r['model']} layers={r['layers']} prompts={r['prompts']} prompt_len={r['prompt_len']} "
            f"tp={r['tp']} tokens_identical={'yes' if r['tokens_identical'] else 'no'} "
            f"max_logit_diff={r['max_logit_diff']:.3g} prefill_ms={r['prefill_ms']:.2f} "
            f"exposed_ms={r['exposed_ms']:.2f} decode_tok_s={r['decode_tok_s']:.1f} kv_layout={r['kv_layout']} "
            f"kv_identical={ {True: 'yes', False: 'no', None: 'n/a'}[r['kv_identical']] } attn={r['attn']}")


def main() -> int:
    a = parse_args()
    where = "cuda_ipc, GPU 0" if a.device == "cuda" else a.provider
    print(f"kv-model: {a.shape} ({a.layers} layers), {a.prompts} prompts x {a.prompt_len} tokens, "
          f"{a.new_tokens} new tokens, prefill TP {a.prefill_tp} -> decode TP {a.decode_tp}, {where}", flush=True)
    r = run(a)
    _log(a, "launcher", "done")
    if not r["ok"]:
        print(f"kv-model FAILED: {r['error']}", file=sys.stderr)
        return 1
    if not r["exact"]:
        print(f"kv-model NOT EXACT: first-token logits (prefill's extras vs generate()'s prefill) differ by "
              f"{r['first_logit_diff']:.3g}, the first decode step's by {r['step_logit_diff']:.3g}; received cache "
              f"vs generate()'s: layers {r['kv_bad_layers']} differ (max {r['kv_max_diff']:.3g})\n"
              f"decode tokens {r['tokens']}\nreference    {r['ref_tokens']}", file=sys.stderr)
    print(line(r), flush=True)
    return 0 if r["exact"] else 1


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
