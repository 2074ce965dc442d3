"""RL weight updates with a real transformers model (examples/rl_weights/weights_model.py): 2 training
processes take 3 AdamW steps on a tiny Qwen3 / Qwen3-MoE (2 layers, hidden 256, built from a
config: nothing downloaded) and push every step's weights through fabric_lib.weights into 1 or 2
inference processes (TP: fused qkv and gate_up, split o/down, vocab-split embeddings; EP experts),
BF16 or FP8 block-quantized linear layers; after every update inference rank 0's logits on a probe
batch must equal training rank 0's bit for bit (FP8: against the FP8-rounded weights, which both
sides dequantize from the same bytes), and the greedy continuation must change over the steps."""

import os
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples", "rl_weights"))

import weights_model as R  # noqa: E402

STEPS = 3


# Every provider against both inference widths; the model and the FP8 switch vary across them so
# that each layout is split at least once: dense qkv / gate_up / o / down over TP 2 (qwen3, FP8),
# experts over EP 2 (qwen3_moe), FP8 experts and BF16 attention at TP 1.
@pytest.mark.parametrize("provider,inference,model,fp8", [
    ("tcp;ofi_rxm", 1, "qwen3", False),
    ("tcp;ofi_rxm", 2, "qwen3", True),
    ("shm", 1, "qwen3_moe", True),
    ("shm", 2, "qwen3_moe", False),
])
def test_every_update_gives_the_inference_model_the_trainers_logits(provider, inference, model, fp8):
    cfg = dict(model=model, size=dict(R.SIZES["tiny"]), trainers=2, inference=inference, steps=STEPS, lr=1e-2,
               fp8=fp8, provider=provider, device="cpu", window=2, seed=0, threads=1)
    lines = []
    res = R.run(cfg, out=lines.append)  # raises on a logit or token mismatch, or unchanged logits
    assert res["logits_equal"], "\n".join(lines)
    assert len(res["tokens"]) == STEPS + 1 and res["tokens"][-1] != res["tokens"][0]
    assert res["bytes"] > 0 and res["params"] > 1_000_000
    line = lines[-1]
    assert line.startswith(f"weights-model model={model} ") and f" trainers=2 inference={inference} " in line, line
    assert " logits_equal=yes" in line and " measured_over_predicted=" in line, line


def test_the_launcher_reads_every_rank_while_the_reference_logits_are_large():
    """Qwen3's real vocabulary (151,936 tokens): each step's probe logits are ~10 MB per message,
    more than a pipe holds. A launcher that reads the ranks one at a time waits on an inference rank
    whose next update needs the training rank blocked sending to it (the GPU run hung so); read as
    messages arrive, the run finishes (the launcher of 76517fb hung here past 2 minutes)."""
    size = dict(R.SIZES["tiny"], vocab=151_936)
    cfg = dict(model="qwen3", size=size, trainers=2, inference=2, steps=1, lr=1e-2, fp8=False,
               provider="tcp;ofi_rxm", device="cpu", window=2, seed=0, threads=1, timeout_s=120.0)
    lines = []
    res = R.run(cfg, out=lines.append)
    assert res["logits_equal"] and len(res["tokens"]) == 2, "\n".join(lines)
