"""The engine on tiny models in the simulator: continuous batching gives every request the
output it gets alone (greedy or seeded sampling), with prefix caching on or off and with the
overlapped loop or the synchronous one, also after a warm-up, with requests arriving by step or by
wall clock, and at a larger batch and prefill budget than sim.yaml's, also with prompts split into
chunks; a request the plan cannot hold is rejected while the rest runs."""

from __future__ import annotations

import functools
import time

import pytest
import torch

import executor.engine
from executor.engine import Engine, warm_up
from executor.scheduler import Request
from tests.executor.harness import load_tiny, perturb_norms, shared_tiny


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


@functools.cache
def _alone(name: str) -> tuple[list[int], ...]:
    """Each request of the workload run alone, step by step, with the prefix cache off, after a warm-up
    (its scratch prefill + decode steps on pages 1.. and slots 0, 1 must leave no trace)."""
    loaded = shared_tiny(name)
    prompts, new_tokens, _ = _workload(loaded.plan.model.vocab_size)
    warm_up(loaded.model)
    return tuple(_outputs(Engine(loaded.model, prefix_caching=False, overlap=False).run(
        _requests([p], [n], first_id=i)))[0] for i, (p, n) in enumerate(zip(prompts, new_tokens)))


def test_continuous_batching_equals_each_request_alone(batched):
    name, loaded, prompts, new_tokens, report = batched
    alone = list(_alone(name))
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
    assert report.prefix_caching
    if name == "tiny-qwen3":
        assert stats.prefix_hit_tokens > 0
    else:  # request 2 snapshots the state where it leaves request 0's cached page; no later request resumes there
        assert stats.prefix_hit_tokens == 0 and stats.state_snapshots_taken == 1


def test_qwen3_5_resumes_a_shared_prefix_from_a_recurrent_state_snapshot():
    """Four prompts sharing two pages: the second (arriving once the first's pages are cached) computes
    from token 0 and snapshots the recurrent state at the end of the shared pages; the third and fourth
    resume there (KV pages shared, the snapshot copied into their slots). Each gets its output alone."""
    loaded = shared_tiny("tiny-qwen3.5")
    generator = torch.Generator().manual_seed(5)
    vocab, page = loaded.plan.model.vocab_size, loaded.plan.capacity.page_size
    shared = torch.randint(0, vocab, (2 * page,), generator=generator).tolist()
    prompts = [shared + torch.randint(0, vocab, (n,), generator=generator).tolist() for n in (2, 3, 1, 3)]
    new_tokens = [3, 2, 3, 2]
    report = Engine(loaded.model, prefix_caching=True).run(_requests(prompts, new_tokens), [0, 2, 4, 4])
    alone = [_outputs(Engine(loaded.model, prefix_caching=False, overlap=False).run(
        _requests([p], [n], first_id=i)))[0] for i, (p, n) in enumerate(zip(prompts, new_tokens))]
    assert _outputs(report) == alone
    stats = report.stats
    assert (stats.state_snapshots_taken, stats.state_snapshot_restores) == (1, 2)
    assert stats.prefix_hit_tokens == 2 * 2 * page  # the third's and the fourth's shared pages


def test_a_request_the_plan_cannot_hold_is_rejected_and_the_rest_runs(batched):
    _, _, _, new_tokens, report = batched
    rejected, *rest = report.results
    assert rejected.finish_reason == "rejected" and "max_context" in rejected.error and rejected.output_ids == []
    assert [(r.finish_reason, len(r.output_ids)) for r in rest] == [("length", n) for n in new_tokens]
    assert report.stats.rejected == 1


def test_step_timings_account_for_every_row_the_engine_ran(batched):
    """One timing a step; its decode rows are the ids sampled after each request's first, its prefill
    tokens the prompts less the prefix cache's hits (nothing is preempted in this workload)."""
    _, _, prompts, _, report = batched
    timings, stats = report.step_timings, report.stats
    assert stats.preemptions == 0
    assert len(timings) == report.steps and all(t.gap_s >= 0 and t.launch_s > 0 for t in timings)
    results = report.results[1:]  # the rejected request ran no row
    assert sum(t.decode_rows for t in timings) == sum(len(r.output_ids) - 1 for r in results)
    assert sum(t.prefill_tokens for t in timings) == sum(len(p) for p in prompts) - stats.prefix_hit_tokens


#: Wall-clock arrivals of the workload's requests: nothing has arrived when the run starts (the engine
#: sleeps until the first), request 2 arrives while the first step runs (a simulator step takes seconds).
ARRIVAL_TIMES_S = (0.3, 0.3, 0.31)


def test_wall_clock_arrivals_are_respected_and_outputs_equal_each_request_alone(monkeypatch):
    loaded = shared_tiny("tiny-qwen3")
    prompts, new_tokens, _ = _workload(loaded.plan.model.vocab_size)
    sleeps = []
    real_sleep = time.sleep

    def recording_sleep(seconds):
        sleeps.append(seconds)
        real_sleep(seconds)

    monkeypatch.setattr(executor.engine.time, "sleep", recording_sleep)
    report = Engine(loaded.model).run(_requests(prompts, new_tokens), arrival_times_s=ARRIVAL_TIMES_S)
    monkeypatch.undo()
    assert _outputs(report) == list(_alone("tiny-qwen3"))
    assert [r.arrival_s for r in report.results] == list(ARRIVAL_TIMES_S)
    assert all(r.token_times_s[0] > r.arrival_s and r.ttft_s > 0 for r in report.results)
    # One sleep, until the first arrival (no polling): request 2 arrived while a step ran.
    assert len(sleeps) == 1 and 0.2 < sleeps[0] <= ARRIVAL_TIMES_S[0]
    assert report.wall_s > ARRIVAL_TIMES_S[-1]
    assert report.stats.peak_running == 3


def test_arrivals_by_step_and_by_time_are_exclusive():
    loaded = shared_tiny("tiny-qwen3")
    with pytest.raises(ValueError, match="not both"):
        Engine(loaded.model).run([Request(0, [1], 1)], [0], arrival_times_s=[0.0])
    with pytest.raises(ValueError, match="arrival_times_s"):
        Engine(loaded.model).run([Request(0, [1], 1)], arrival_times_s=[-1.0])


#: Six requests (the workload's three, twice: each copy must give its original's solo output) on a plan
#: of max_batch 6 and a prefill budget that admits them all in the first step, as vLLM's H200 defaults
#: (256 sequences, 8,192 batched tokens) are larger than sim.yaml's 4 and 16.
LARGE_BATCH = dict(max_batch=6, max_prefill_tokens=64)
COPIES = (0, 1, 2, 0, 1, 2)


def test_a_larger_batch_and_prefill_budget_give_each_request_its_solo_output():
    loaded = load_tiny("tiny-qwen3", **LARGE_BATCH)  # the weights of shared_tiny("tiny-qwen3"): the same seed
    prompts, new_tokens, _ = _workload(loaded.plan.model.vocab_size)
    requests = [Request(i, prompts[c], new_tokens[c], **SAMPLED.get(c, {})) for i, c in enumerate(COPIES)]
    report = Engine(loaded.model).run(requests)
    alone = _alone("tiny-qwen3")
    assert _outputs(report) == [alone[c] for c in COPIES]
    assert report.stats.peak_running == len(COPIES)  # all six in one batch


#: The same six copies on max_batch 6 with a prefill budget of 12 tokens: their 28 prompt tokens take
#: several steps, a request's prompt is split across steps (Qwen3.5's recurrent state carried between its
#: chunks) and later chunks share steps with the decode rows of requests already prefilled.
CHUNKED = dict(max_batch=6, max_prefill_tokens=12)


@pytest.mark.parametrize("max_step_tokens", [None, 12])
def test_chunked_prefill_at_a_larger_batch_gives_each_request_its_solo_output(max_step_tokens):
    """Qwen3.5: six recurrent slots and prompts split across steps (Qwen3's larger batch is the test above);
    with max_step_tokens 12 a chunk beside decode rows takes only what they leave of 12 rows."""
    name = "tiny-qwen3.5"
    loaded = load_tiny(name, **CHUNKED, max_step_tokens=max_step_tokens)  # shared_tiny(name)'s seeds and norms
    perturb_norms(loaded)
    prompts, new_tokens, _ = _workload(loaded.plan.model.vocab_size)
    requests = [Request(i, prompts[c], new_tokens[c], **SAMPLED.get(c, {})) for i, c in enumerate(COPIES)]
    report = Engine(loaded.model).run(requests)
    alone = _alone(name)
    assert _outputs(report) == [alone[c] for c in COPIES]
    assert report.stats.peak_running == len(COPIES)
    assert sum(len(prompts[c]) for c in COPIES) > 2 * CHUNKED["max_prefill_tokens"]  # three prefill steps at least
    if max_step_tokens is not None:  # no step over the cap; one beside decode rows filled it
        timings = report.step_timings
        assert max(t.decode_rows + t.prefill_tokens for t in timings) == max_step_tokens
        assert any(t.decode_rows and t.decode_rows + t.prefill_tokens == max_step_tokens for t in timings)


def test_kernels_readied_count_each_build_of_a_kernel_apart():
    """Two builds of one kernel function (one name, two kernels) each readying the same argument types
    count twice; a kernel's types ready before the run count nothing."""
    before = {1: ("mod.build.<locals>.k", {("a",)}), 2: ("mod.build.<locals>.k", set())}
    after = {1: ("mod.build.<locals>.k", {("a",), ("b",)}), 2: ("mod.build.<locals>.k", {("a",), ("b",)}),
             3: ("mod.other", {("a",)})}
    assert executor.engine.readied_since(before, after) == {"mod.build.<locals>.k": 3, "mod.other": 1}
    assert executor.engine.readied_since(after, after) == {}


#: Plans whose warm-up prefill step outgrows a short step's route (executor/routing.py), so warm-up runs a
#: third step, a short chunk alone: Qwen3.5's 66 prefill rows take the chunked delta rule (a short chunk the
#: recurrent one), Qwen3's 203 rows the separate q/k norm + RoPE (a short chunk the fused launch).
SHORT_STEP_PLANS = {"tiny-qwen3.5": dict(max_batch=4, max_prefill_tokens=80, gemm_attention_min_tokens=64),
                    "tiny-qwen3": dict(max_batch=4, max_prefill_tokens=256, gemm_attention_min_tokens=200,
                                       max_context=256)}


@pytest.mark.parametrize("name", sorted(SHORT_STEP_PLANS))
def test_warm_up_s_short_prefill_step_runs_and_leaves_no_trace(name):
    loaded = load_tiny(name, **SHORT_STEP_PLANS[name])
    steps = executor.engine.warm_up_steps(loaded.plan)
    assert [len(chunk.token_ids) for chunk in steps[-1]] == [executor.engine.SHORT_CHUNK_ROWS]
    assert len(steps) == 3

    def outputs() -> list[list[int]]:
        requests = [Request(0, [5, 7, 9, 11, 13], 4), Request(1, list(range(1, 30)), 3, **SAMPLED[1])]
        return _outputs(Engine(loaded.model, prefix_caching=False, overlap=False).run(requests))

    cold = outputs()
    warm_up(loaded.model)
    assert outputs() == cold
