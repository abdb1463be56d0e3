"""The engine on tiny models in the simulator: continuous batching gives every request the
output it gets alone (greedy or seeded sampling), with prefix caching on or off and with the
overlapped loop or the synchronous one, also after a warm-up; a request the plan cannot hold is
rejected while the rest runs."""

from __future__ import annotations

import pytest
import torch

from executor.engine import Engine, warm_up
from executor.scheduler import Request
from tests.executor.harness import shared_tiny


def _workload(vocab: int) -> tuple[list[list[int]], list[int], list[int]]:
    """Prompts with a shared 4-token prefix (one full page), mixed lengths, staggered arrivals:
    request 2 arrives before step 2, while 1 decodes (a step of a decode row and a prefill chunk),
    after request 0's prefill put the prefix page in the cache (its update comes a step late when
    overlapped: before step 2, not step 1); then 1 and 2 decode together."""
    generator = torch.Generator().manual_seed(11)
    prefix = torch.randint(0, vocab, (4,), generator=generator).tolist()
    tails = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in (1, 3, 2)]
    prompts = [prefix + tails[0], tails[1], prefix + tails[2]]
    return prompts, [2, 3, 2], [0, 0, 2]


SAMPLED = {1: dict(temperature=0.8, top_k=20, seed=7)}  # request 1 samples; the rest are greedy
TOO_LONG = 60  # prompt ids; + 10 new tokens = 70 > max_context 64


def _requests(prompts, new_tokens, first_id=0):
    return [Request(i, p, n, **SAMPLED.get(i, {})) for i, (p, n) in enumerate(zip(prompts, new_tokens), first_id)]


def _outputs(report) -> list[list[int]]:
    return [r.output_ids for r in report.results]


@pytest.fixture(scope="module", params=["tiny-qwen3", "tiny-qwen3.5"])
def batched(request):
    """The workload (plus a request over max_context, arriving first) run batched with the prefix
    cache on, overlapped (the engine's default): (name, model, prompts, new_tokens, report)."""
    loaded = shared_tiny(request.param)
    prompts, new_tokens, arrivals = _workload(loaded.plan.model.vocab_size)
    too_long = Request("long", list(range(TOO_LONG)), 10)
    report = Engine(loaded.model, prefix_caching=True).run([too_long, *_requests(prompts, new_tokens)],
                                                           [0, *arrivals])
    return request.param, loaded, prompts, new_tokens, report


def test_continuous_batching_equals_each_request_alone(batched):
    name, loaded, prompts, new_tokens, report = batched
    warm_up(loaded.model)  # scratch prefill + decode steps on pages 1.. and slots 0, 1 leave no trace
    alone = [_outputs(Engine(loaded.model, prefix_caching=False, overlap=False).run(_requests([p], [n], first_id=i)))[0]
             for i, (p, n) in enumerate(zip(prompts, new_tokens))]
    # Batched with the prefix cache on and overlapped steps against each request alone with it off,
    # step by step: one comparison covers continuous batching, prefix caching on vs off and the
    # overlapped loop (decode tokens fed from the device) against the synchronous one.
    results = report.results[1:]
    assert [r.output_ids for r in results] == alone
    assert all(len(r.token_times_s) == len(r.output_ids) and r.token_times_s == sorted(r.token_times_s)
               for r in results)  # one time stamp per kept id, in order
    assert all(r.finish_reason == "length" for r in results)
    stats = report.stats
    assert stats.peak_running > 1  # requests really shared steps
    if name == "tiny-qwen3":
        assert report.prefix_caching and stats.prefix_hit_tokens > 0
    else:
        assert not report.prefix_caching  # recurrent state is not paged


def test_a_request_the_plan_cannot_hold_is_rejected_and_the_rest_runs(batched):
    _, _, _, new_tokens, report = batched
    rejected, *rest = report.results
    assert rejected.finish_reason == "rejected" and "max_context" in rejected.error and rejected.output_ids == []
    assert [(r.finish_reason, len(r.output_ids)) for r in rest] == [("length", n) for n in new_tokens]
    assert report.stats.rejected == 1
