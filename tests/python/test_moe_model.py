"""A transformers model's own MoE block run expert-parallel (examples/moe/moe_model.py): a tiny
Qwen3-MoE (2 layers of 16 experts, top-4, hidden 128, random weights from one seed, nothing
downloaded) in 4 rank processes (2 nodes of 2 over tcp;ofi_rxm), each holding 4 experts of every
layer, through fabric_lib.moe.AllToAll and through deep_ep.Buffer's low-latency calls, against one
process running the unmodified model:
- the block, BF16 and FP8 dispatch: bit for bit reference_combine_rows over the model's own experts
  (FP8: on the dequantized tokens), within the BF16 / FP8 bound of the model's own block output,
  and with the router's weights applied in the experts as the model applies them, bit for bit the
  model's block;
- a greedy decode of every rank's prompts, BF16 dispatch: the same tokens and logits as the
  unmodified model decoding them all in one batch.
No timing is asserted."""

import os
import sys

import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install '.[test]')")
pytest.importorskip("transformers", reason="transformers is not installed (pip install '.[models]' or '.[test]')")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples", "moe"))
import moe_model  # noqa: E402


@pytest.mark.parametrize("mode", ["all_to_all", "deep_ep"])
def test_the_models_moe_block_expert_parallel_decodes_the_models_tokens(mode):
    args = ["--mode", mode, "--ranks", "4", "--node-size", "2", "--provider", "tcp", "--dtypes", "bf16,fp8"]
    cfg = moe_model.config(moe_model.parse_args(args))
    lines = []
    found = moe_model.run(cfg, out=lines.append)  # raises AssertionError naming every failed check
    print("\n".join(lines))
    bf16, fp8 = found["bf16"], found["fp8"]
    # BF16 dispatch, the router's weights applied in the experts: the model's own arithmetic.
    assert bf16["tokens_identical"] and bf16["max_logit_diff"] == 0, bf16["line"]
    assert bf16["block_exact"] and bf16["block_bound"] <= 1, bf16["line"]
    # FP8 dispatch: exact against the experts on the dequantized tokens, and the FP8 bound. The
    # bound must be met with room and not be vacuous: the block moved, and by less than it.
    assert fp8["block_exact"] and 0 < fp8["block_bound"] <= 1, fp8["line"]
    assert len(lines) == 2 and all(line.startswith(f"moe-model ranks=4 mode={mode} dtype=") for line in lines), lines


def test_the_launcher_reads_every_rank_while_the_decode_logits_are_large():
    """Qwen3's real vocabulary (151,936 tokens): each rank's decode logits outgrow a pipe. Read rank
    by rank, a rank blocked sending them stalls the rank being read in the next collective call (the
    launcher of 76517fb hung here); read as they arrive, the decode finishes, token for token."""
    args = ["--mode", "all_to_all", "--ranks", "4", "--node-size", "2", "--provider", "tcp", "--dtypes", "bf16,fp8"]
    cfg = moe_model.config(moe_model.parse_args(args))
    cfg["size"]["vocab"] = 151_936
    lines = []
    found = moe_model.run(cfg, out=lines.append)
    assert found["bf16"]["tokens_identical"] and found["bf16"]["max_logit_diff"] == 0, found["bf16"]["line"]
