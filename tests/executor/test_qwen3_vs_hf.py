"""Tiny Qwen3 models built by transformers, run by memplan in the simulator, against HF in float32."""

from __future__ import annotations

import pytest

from tests.executor.harness import assert_teacher_forced_matches_hf, load_tiny, random_sequences, run_teacher_forced

TOLERANCE = 1e-3  # max |ours - HF| / max |HF logit|


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen3-g5"])
def test_prefill_and_8_decode_steps_match_hf(name):
    assert_teacher_forced_matches_hf(load_tiny(name), [5, 3], decode_steps=8, tolerance=TOLERANCE, seed=1)


def test_chunked_prefill_equals_one_pass():
    loaded = load_tiny("tiny-qwen3")
    sequence = random_sequences(loaded.plan.model.vocab_size, [11], seed=2)
    whole = run_teacher_forced(loaded, sequence, [11])[0][0]
    chunked = run_teacher_forced(loaded, sequence, [11], chunk=4, first_page=20)[0][0]
    assert float((whole - chunked).abs().max() / whole.abs().max()) <= 1e-5
