"""A real transformers model served disaggregated (examples/kv_transfer/kv_model.py): a tiny
Qwen3 (4 layers, hidden 256, random weights from one seed, nothing downloaded); the prefill
processes send each decoder layer's K and V (after RoPE) as the layer finishes into a vLLM-layout
paged cache of the decode processes, which rebuild a transformers cache from the pages and generate
greedily. The tokens, the logits and the cache must equal those of model.generate() in one process
(bit for bit; the second test checks that both run the same ops on tensors of the same shapes and
strides, which is what a GPU picks its kernels by), over tcp and shm, at
prefill TP -> decode TP 1 -> 1, 2 -> 1 (each prefill rank holds half the KV heads) and 1 -> 2 (each
decode rank receives half), with vLLM's NHD pages and, split, its HND pages. No timing is
asserted."""

import os
import sys

import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install '.[test]')")
pytest.importorskip("transformers", reason="transformers is not installed (pip install '.[models]' or '.[test]')")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples", "kv_transfer"))
import kv_model  # noqa: E402


# vLLM's default NHD pages everywhere; its HND pages (what it uses under its NIXL connector: where
# the TP sizes differ, one WRITE per block instead of one per token) where the heads are split.
CASES = [(provider, tp, "NHD") for provider in ("tcp;ofi_rxm", "shm") for tp in ("1to1", "2to1", "1to2")]
CASES += [("tcp;ofi_rxm", "2to1", "HND"), ("tcp;ofi_rxm", "1to2", "HND")]


@pytest.mark.parametrize("provider,tp,kv_layout", CASES)
def test_a_real_model_decodes_the_same_tokens_from_the_transferred_cache(provider, tp, kv_layout):
    # --verbose: each process's phases go to stderr, which pytest shows only when the test fails.
    a = kv_model.parse_args(["--provider", provider, "--tp", tp, "--kv-layout", kv_layout, "--timeout", "60",
                               "--verbose"])
    r = kv_model.run(a)
    assert r["ok"], r["error"]
    print(kv_model.line(r))
    assert r["tokens_identical"], f"decode {r['tokens']}\nreference {r['ref_tokens']}"
    # Exact: the received cache is generate()'s prefill cache bit for bit, and so are the logits.
    assert r["kv_identical"] and r["max_logit_diff"] == 0 and r["exact"], kv_model.line(r)


@pytest.mark.parametrize("attn,kv_layout", [("sdpa", "NHD"), ("sdpa", "HND"), ("eager", "NHD")])
def test_decode_from_the_pages_runs_generates_ops(attn, kv_layout):
    """Apples to apples, in one process: every floating-point op of the prefill forward and of a
    decode step from a cache rebuilt out of the paged layout has the shapes, strides, dtypes and
    offsets of generate()'s own (a GPU picks kernels by these; bit-equal results on the CPU alone
    would not show a difference there). The mask and position bookkeeping (integer and boolean
    tensors, float scalars) is left out: generate() drops an all-ones mask before the forward, the
    forward drops it itself (SDPA) or expands it (eager), the same values either way. BF16, as on
    the GPU. Before the position ids were passed, the RoPE ops differed here ([1, tokens] tables
    broadcast over the batch against generate()'s [batch, tokens])."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    a = kv_model.parse_args(["--dtype", "bfloat16", "--attn", attn, "--kv-layout", kv_layout])
    kv_model._setup(a)
    model = kv_model.build_model(a)

    class Trace(TorchDispatchMode):
        on, ops = False, []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            flat, _ = tree_flatten((args, kwargs or {}))
            ts = [t for t in flat if isinstance(t, torch.Tensor)]
            if self.on and any(t.is_floating_point() and t.dim() for t in ts):
                self.ops.append((str(func), [(tuple(t.shape), t.stride(), t.dtype, t.storage_offset()) for t in ts]))
            return func(*args, **(kwargs or {}))

    trace = Trace()
    model.model.register_forward_pre_hook(lambda *_: setattr(trace, "on", True))
    model.model.register_forward_hook(lambda *_: setattr(trace, "on", False))

    def forwards():  # the recorded ops, one list per model forward
        out, cur = [], None
        for op in trace.ops + [None]:
            if op is None or "embedding" in op[0]:
                if cur:
                    out.append(cur)
                cur = []
            if op is not None:
                cur.append(op)
        trace.ops.clear()
        return out

    ids = kv_model.prompts(a)
    mask = torch.ones_like(ids)
    kw = kv_model.cache_kwarg(model)
    heads = kv_model.SHAPES[a.shape]["num_key_value_heads"]
    pages = kv_model.PagedCache(a.layers, 2 * a.prompts * 4, heads, 32, torch.bfloat16, "cpu", kv_layout)
    table = torch.randperm(2 * a.prompts * 4)[:a.prompts * 4].view(a.prompts, 4)
    with torch.no_grad(), trace:
        live = kv_model.new_cache(model)
        out = model(ids, attention_mask=mask, position_ids=kv_model.positions(mask), **{kw: live}, use_cache=True,
                    logits_to_keep=1)
        for layer in range(a.layers):
            pages.write(layer, table, *kv_model.layer_kv(live, layer))
        cache = kv_model.new_cache(model)
        for layer in range(a.layers):
            cache.update(*pages.read(layer, table, a.prompt_len), layer)
        step_mask = torch.ones(a.prompts, a.prompt_len + 1, dtype=torch.long)
        token = out.logits[:, -1].float().argmax(-1)
        model(token[:, None], attention_mask=step_mask, position_ids=kv_model.positions(step_mask)[:, -1:].contiguous(),
              **{kw: cache}, use_cache=True, logits_to_keep=1)
        ours = forwards()
        model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
        ref = forwards()
    assert len(ours) == len(ref) == 2
    for name, x, y in zip(("prefill", "decode"), ours, ref):
        assert len(x) == len(y), f"{name}: {len(x)} ops, generate() {len(y)}"
        for i, (p, q) in enumerate(zip(x, y)):
            assert p == q, f"{name} op {i}: {p} vs generate()'s {q}"
