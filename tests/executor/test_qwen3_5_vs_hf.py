"""Tiny Qwen3.5 models (Gated DeltaNet + gated attention) against HF transformers in float32."""

from __future__ import annotations

import pytest
import torch

from tests.executor.harness import assert_teacher_forced_matches_hf, load_tiny, random_sequences, run_teacher_forced

TOLERANCE = 1e-3


def _perturb_norms(loaded) -> None:
    """HF initialises Qwen3.5's (1 + w) norms at w = 0; give them values so the offset is exercised."""
    from executor.weights import load_state_dict

    state = loaded.hf.state_dict()
    generator = torch.Generator().manual_seed(3)
    for name, tensor in state.items():
        if name.endswith("norm.weight"):
            tensor.copy_(tensor + 0.1 * torch.randn(tensor.shape, generator=generator))
    loaded.hf.load_state_dict(state)
    load_state_dict(loaded.arena, state)


@pytest.mark.parametrize("name", ["tiny-qwen3.5", "tiny-qwen3.5-g6"])
def test_prefill_and_8_decode_steps_match_hf(name):
    loaded = load_tiny(name)
    _perturb_norms(loaded)
    assert_teacher_forced_matches_hf(loaded, [6, 2], decode_steps=8, tolerance=TOLERANCE, seed=4)


def test_prefill_in_chunks_of_3_hands_state_across_chunks():
    loaded = load_tiny("tiny-qwen3.5")
    sequence = random_sequences(loaded.plan.model.vocab_size, [10], seed=5)
    whole = run_teacher_forced(loaded, sequence, [10])[0][0]
    chunked = run_teacher_forced(loaded, sequence, [10], chunk=3, first_page=30)[0][0]
    assert float((whole - chunked).abs().max() / whole.abs().max()) <= 1e-5
