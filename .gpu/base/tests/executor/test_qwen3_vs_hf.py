"""Tiny Qwen3 models built by transformers, run by memplan in the simulator, against HF in float32."""

from __future__ import annotations

import pytest

from tests.executor.harness import assert_teacher_forced_matches_hf, reference_run, run_teacher_forced

TOLERANCE = 1e-3  # max |ours - HF| / max |HF logit|


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen3-g5"])
def test_prefill_and_8_decode_steps_match_hf(name):
    """Prompts of 5 and 3 ids prefilled in one batched step, then 8 teacher-forced decode steps
    (the 3-id request shares the first 3 of them): every step's logits within 1e-3 of HF's."""
    run = reference_run(name)
    assert run.prompts == [5, 3] and run.decode_steps[0] == 8
    assert_teacher_forced_matches_hf(run, TOLERANCE)


def test_chunked_prefill_equals_one_pass():
    """The 5-id prompt of the reference run, prefilled in chunks of 2 (2 + 2 + 1 ids over two pages),
    gives the logits of its one-pass prefill."""
    run = reference_run("tiny-qwen3")
    prompt = run.prompts[0]
    whole = run.logits[0][0]
    chunked = run_teacher_forced(run.loaded, [run.sequences[0][:prompt]], [prompt], chunk=2, first_page=40)[0][0]
    assert float((whole - chunked).abs().max() / whole.abs().max()) <= 1e-5
