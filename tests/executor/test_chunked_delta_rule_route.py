"""Qwen3.5 prefill on the chunked gated delta rule (executor/routing.py CHUNKED_DELTA_RULE_MIN_ROWS set):
the tiny model in the simulator, and Qwen3.5-0.8B's golden log-probs on the GPU, against HF."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from executor import routing
from executor.kernels.linear_attention.chunked_delta_rule import ChunkedGatedDeltaRule
from tests.executor.harness import hf_logits, load_tiny, random_sequences, run_teacher_forced


@dataclass
class Calls:
    """The rows of each call of the chunked launcher."""

    rows: list[int] = field(default_factory=list)


@pytest.fixture
def chunked_calls(monkeypatch) -> Calls:
    calls = Calls()
    original = ChunkedGatedDeltaRule.__call__

    def counting(self, *args, **kwargs):
        calls.rows.append(int(args[0].shape[0]))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(ChunkedGatedDeltaRule, "__call__", counting)
    return calls


def test_tiny_prefill_on_the_chunked_rule_matches_hf(monkeypatch, chunked_calls):
    """tiny-qwen3.5 with every prefill step on the chunked kernel: two prompts of 21 and 5 ids in one
    prefill step (the first spans two of the simulator's 16-row chunks) give HF's logits at their last
    positions within test_qwen3_5_vs_hf.py's 1e-3."""
    monkeypatch.setattr(routing, "CHUNKED_DELTA_RULE_MIN_ROWS", 1)
    loaded = load_tiny("tiny-qwen3.5", max_prefill_tokens=32)
    prompts = random_sequences(loaded.plan.model.vocab_size, [21, 5], seed=7)
    logits = run_teacher_forced(loaded, prompts, [len(p) for p in prompts])
    assert chunked_calls.rows == [26] * loaded.plan.geometry.num_linear_layers
    for prompt, mine in zip(prompts, logits):
        theirs = hf_logits(loaded.hf, prompt)[-1]
        assert float((mine[0] - theirs).abs().max() / theirs.abs().max()) <= 1e-3


@pytest.mark.gpu
def test_qwen3_5_hf_golden_bf16_on_the_chunked_rule(monkeypatch, chunked_calls):
    """test_gpu_models.py's Qwen3.5-0.8B bf16 golden (32 prompts of up to 256 tokens and two of 4,097 in
    chunks of 2,048, 2,048 and 1) with prefill steps of >= 64 rows on the chunked kernel, within the
    same gates."""
    from tests.executor.harness import load_with_hf
    from tests.executor.test_gpu_models import _gate, _logprob_deltas, _prompts

    monkeypatch.setattr(routing, "CHUNKED_DELTA_RULE_MIN_ROWS", 64)
    loaded = load_with_hf("qwen3.5-0.8b", "h200", "default", max_batch=34, max_context=4200, max_prefill_tokens=2048,
                          gpu_memory_utilization=0.25)
    sequences, lengths = _prompts(loaded.plan.model.vocab_size, 32, 256, 8, seed=2, long_prompts=2)
    _gate(_logprob_deltas(loaded, sequences, lengths, chunk=2048), 0.06, 0.2, "qwen3.5-0.8b chunked delta rule bf16")
    assert chunked_calls.rows, "no prefill step reached the chunked kernel"
