"""Tiny Qwen3 models built by transformers, run by memplan in the simulator, against HF in float32."""

from __future__ import annotations

import pytest
import torch

from tests.executor.harness import hf_logits, load_tiny, run_teacher_forced

TOLERANCE = 1e-3  # max |ours - HF| / max |HF logit|


def _sequences(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen3-g5"])
def test_prefill_and_8_decode_steps_match_hf(name):
    loaded = load_tiny(name)
    prompts = [5, 3]
    sequences = _sequences(loaded.plan.model.vocab_size, [p + 8 for p in prompts], seed=1)
    ours = run_teacher_forced(loaded, sequences, prompts)
    for seq, prompt, logits in zip(sequences, prompts, ours):
        reference = hf_logits(loaded.hf, seq)[prompt - 1 :]
        assert len(logits) == 9 == reference.shape[0] - 0
        for step, (mine, theirs) in enumerate(zip(logits, reference)):
            error = float((mine - theirs).abs().max() / theirs.abs().max())
            assert error <= TOLERANCE, f"{name} step {step}: relative error {error:.2e}"


def test_chunked_prefill_equals_one_pass():
    loaded = load_tiny("tiny-qwen3")
    sequence = _sequences(loaded.plan.model.vocab_size, [11], seed=2)
    whole = run_teacher_forced(loaded, sequence, [11])[0][0]
    chunked = run_teacher_forced(loaded, sequence, [11], chunk=4, first_page=20)[0][0]
    assert float((whole - chunked).abs().max() / whole.abs().max()) <= 1e-5
