"""Tiny Qwen3.5 models (Gated DeltaNet + gated attention) against HF transformers in float32."""

from __future__ import annotations

import pytest

from tests.executor.harness import assert_teacher_forced_matches_hf, reference_run, run_teacher_forced

TOLERANCE = 1e-3


@pytest.mark.parametrize("name", ["tiny-qwen3.5", "tiny-qwen3.5-g6"])
def test_prefill_and_8_decode_steps_match_hf(name):
    """Two prompts prefilled in one batched step, then 8 teacher-forced decode steps (the shorter
    request shares the first 3 of them): every step's logits within 1e-3 of HF's. The shared model's
    (1 + w) norms are perturbed away from HF's w = 0 initialisation (harness.shared_tiny)."""
    run = reference_run(name)
    assert len(run.prompts) == 2 and run.decode_steps[0] == 8
    norms = [v for k, v in run.loaded.hf.state_dict().items() if k.endswith("norm.weight")]
    assert all(bool(v.abs().max() > 0) for v in norms)  # the offset is exercised
    assert_teacher_forced_matches_hf(run, TOLERANCE)


def test_prefill_in_chunks_of_3_hands_state_across_chunks():
    """The 7-id prompt of the reference run prefilled in chunks of 3 (3 + 3 + 1 ids; conv and
    delta-rule state handed over twice) gives the logits of its one-pass prefill."""
    run = reference_run("tiny-qwen3.5")
    prompt = run.prompts[0]
    assert prompt == 7
    whole = run.logits[0][0]
    chunked = run_teacher_forced(run.loaded, [run.sequences[0][:prompt]], [prompt], chunk=3, first_page=40)[0][0]
    assert float((whole - chunked).abs().max() / whole.abs().max()) <= 1e-5
