"""A real transformers model served disaggregated (examples/kv_transfer/kv_model.py): a tiny
Qwen3 (4 layers, hidden 256, random weights from one seed, nothing downloaded); the prefill
processes send each decoder layer's K and V (after RoPE) as the layer finishes into a vLLM-layout
paged cache of the decode processes, which rebuild a transformers cache from the pages and generate
greedily. The tokens must equal those of model.generate() in one process, over tcp and shm, at
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
