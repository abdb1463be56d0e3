"""The engine on tiny models in the simulator: continuous batching gives every request the
output it gets alone (greedy or seeded sampling), with prefix caching on or off."""

from __future__ import annotations

import pytest
import torch

from executor.engine import Engine
from executor.scheduler import Request
from tests.executor.harness import load_tiny


def _workload(vocab: int) -> tuple[list[list[int]], list[int], list[int]]:
    """Prompts with a shared 8-token prefix (two full pages), mixed lengths, staggered arrivals."""
    generator = torch.Generator().manual_seed(11)
    prefix = torch.randint(0, vocab, (8,), generator=generator).tolist()
    tails = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in (3, 1, 6, 2)]
    prompts = [prefix + tails[0], prefix + tails[1], tails[2], prefix + tails[3]]
    return prompts, [3, 2, 3, 2], [0, 0, 1, 3]


SAMPLED = {2: dict(temperature=0.8, top_k=20, seed=7)}  # request 2 samples; the rest are greedy


def _requests(prompts, new_tokens, first_id=0):
    return [Request(i, p, n, **SAMPLED.get(i, {})) for i, (p, n) in enumerate(zip(prompts, new_tokens), first_id)]


def _outputs(report) -> list[list[int]]:
    return [r.output_ids for r in report.results]


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen3.5"])
def test_continuous_batching_equals_each_request_alone(name):
    loaded = load_tiny(name)
    prompts, new_tokens, arrivals = _workload(loaded.plan.model.vocab_size)
    batched = Engine(loaded.model, prefix_caching=True).run(_requests(prompts, new_tokens), arrivals)
    alone = [_outputs(Engine(loaded.model, prefix_caching=False).run(_requests([p], [n], first_id=i)))[0]
             for i, (p, n) in enumerate(zip(prompts, new_tokens))]
    # Batched with the prefix cache on against each request alone with it off: one comparison
    # covers continuous batching and prefix caching on vs off.
    assert _outputs(batched) == alone
    assert all(r.finish_reason == "length" for r in batched.results)
    stats = batched.stats
    assert stats.peak_running > 1  # requests really shared steps
    if name == "tiny-qwen3":
        assert batched.prefix_caching and stats.prefix_hit_tokens > 0
    else:
        assert not batched.prefix_caching  # recurrent state is not paged


def test_a_request_the_plan_cannot_hold_is_rejected_and_the_rest_runs():
    loaded = load_tiny("tiny-qwen3")
    too_long = Request("long", list(range(60)), 10)  # 70 tokens > max_context 64
    fine = Request("ok", [1, 2, 3], 2)
    report = Engine(loaded.model).run([too_long, fine])
    assert report.results[0].finish_reason == "rejected" and "max_context" in report.results[0].error
    assert report.results[1].finish_reason == "length" and len(report.results[1].output_ids) == 2
