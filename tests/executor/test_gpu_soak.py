"""GPU soak (H200): thousands of engine steps with random arrivals on a real-shape model, and a burst at
the H200's default serving sizes.

Zero allocation growth, zero pointer changes, every output equal to its solo run,
and page and slot accounting back to empty at the end. Decode replays the captured
CUDA graphs (buckets up to 16) and prefill steps their buckets' pieces (up to 256
rows), so a request's steps run padded to different buckets in the batched run and
in its solo run. The model runs in
float32: bf16 GEMMs of different row counts may round differently, which flips a
greedy near-tie now and then and would make "equal to its solo run" a coin toss
over 800 requests.
"""

from __future__ import annotations

import gc
import random
import time

import pytest
import torch

from executor.engine import Engine, warm_up
from executor.scheduler import Request
from executor.serving import start_compile
from planner.loader import load_hardware
from tests.executor.harness import load_with_hf

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _release_the_model():
    """Each test's model (its arena a share of an H200's memory) is freed before the next test materializes
    its own: on an H100 two of them do not fit."""
    yield
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("name", ["qwen3-0.6b", "qwen3.5-0.8b"])
def test_soak_2000_steps(name):
    loaded = load_with_hf(name, "h200", "default", max_batch=16, max_context=512, max_prefill_tokens=256,
                          gpu_memory_utilization=0.15, dtype="float32")
    compiling = start_compile(loaded.plan, None)  # as ServedModel.open does: a cold cache fills in parallel
    if compiling is not None:
        compiling.wait()
    loaded.model.capture_decode_graphs()
    loaded.model.capture_prefill_graphs()
    assert loaded.model.prefill_graphs.buckets[-1] == 256
    rng = random.Random(0)
    vocab = loaded.plan.model.vocab_size
    prefixes = [[rng.randrange(vocab) for _ in range(64)] for _ in range(4)]
    requests, arrivals, step = [], [], 0
    for index in range(800):
        shared = prefixes[rng.randrange(4)][: rng.choice([0, 16, 32, 64])]
        prompt = shared + [rng.randrange(vocab) for _ in range(rng.randint(1, 120))]
        sampling = dict(temperature=0.7, top_k=50, seed=index) if index % 3 == 0 else {}
        requests.append(Request(index, prompt, rng.randint(1, 16), **sampling))
        step += rng.choice([0, 1, 3, 8])
        arrivals.append(step)
    pointers = {key: view.data_ptr() for key, view in loaded.arena._views.items()}
    engine = Engine(loaded.model, prefix_caching=True)
    report = engine.run(requests, arrivals)
    print(f"{name}: {report.steps} steps in {report.wall_s:.1f} s, {report.generated_tokens} tokens, allocations after warm-up "
          f"{report.allocations_after_warmup}, preemptions {report.stats.preemptions}, prefix hit rate "
          f"{report.stats.prefix_hit_rate:.3f}, recurrent-state snapshots {report.stats.state_snapshots_taken} taken, "
          f"{report.stats.state_snapshot_restores} resumed from, peak KV pages {report.stats.peak_kv_pages_used}, "
          f"kernels readied after warm-up {report.kernels_readied_after_warmup}")
    assert report.steps >= 2000
    assert report.stats.prefix_hit_rate > 0  # Qwen3.5: resumed from recurrent-state snapshots
    assert (report.stats.state_snapshot_restores > 0) == (loaded.plan.geometry.num_linear_layers > 0)
    assert report.allocations_after_warmup == 0
    assert {key: view.data_ptr() for key, view in loaded.arena._views.items()} == pointers
    engine.scheduler.check()
    assert engine.scheduler.num_slots_used == 0 and not engine.scheduler.has_unfinished
    solo = Engine(loaded.model, prefix_caching=False)
    differing, solo_start = [], time.perf_counter()
    for request, result in zip(requests, report.results):
        again = Request(request.request_id, request.prompt_ids, request.max_new_tokens,
                        temperature=request.temperature, top_k=request.top_k, seed=request.seed)
        if solo.run([again]).results[0].output_ids != result.output_ids:
            differing.append(request.request_id)
        if request.request_id % 100 == 99:
            print(f"{name}: {request.request_id + 1} solo runs, {time.perf_counter() - solo_start:.1f} s", flush=True)
    print(f"{name}: {len(requests) - len(differing)} of {len(requests)} outputs equal their solo runs "
          f"({time.perf_counter() - solo_start:.1f} s)")
    assert not differing, differing
    torch.cuda.synchronize()


@pytest.mark.parametrize("name", ["qwen3-0.6b", "qwen3.5-0.8b"])
def test_soak_at_the_h200_default_serving(name):
    """The H200's default_serving as served (bf16, 256 sequences, 8,192 batched tokens, graphs to 256):
    bursts of long prompts fill the batch, steps beyond the largest prefill graph bucket run eagerly,
    and after them nothing was allocated, no arena pointer moved and the page and slot accounting is
    back to empty. (bf16 rounding differs with the step's rows, so outputs are not compared to solo
    runs here; the float32 soak above does that.)"""
    serving = load_hardware("h200").default_serving
    loaded = load_with_hf(name, "h200", serving, max_context=4096, gpu_memory_utilization=0.3)  # fits an H100 too
    capacity = loaded.plan.capacity
    assert capacity.max_batch >= 256 and loaded.plan.serving.max_prefill_tokens >= 8192
    # The start-up compile: a cold kernel cache fills in parallel processes, not kernel by kernel at their
    # first launches in warm-up (one by one, qwen3.5-0.8b's take more than 170 s on an H100).
    compiling = start_compile(loaded.plan, None)
    if compiling is not None:
        compiling.wait()
    warm_up(loaded.model)  # as ServedModel.open does before capturing the graphs
    loaded.model.capture_decode_graphs()
    loaded.model.capture_prefill_graphs()
    rng = random.Random(1)
    vocab = loaded.plan.model.vocab_size
    requests, arrivals = [], []
    for index in range(1200):
        prompt = [rng.randrange(vocab) for _ in range(rng.choice([rng.randint(1, 64), rng.randint(64, 3000)]))]
        sampling = dict(temperature=0.8, top_p=0.95, seed=index) if index % 2 else {}
        requests.append(Request(index, prompt, rng.randint(1, 96), **sampling))
        arrivals.append(0 if index < 400 else 40 * (index // 200))  # a burst of 400, then 200 every 40 steps
    pointers = {key: view.data_ptr() for key, view in loaded.arena._views.items()}
    engine = Engine(loaded.model, prefix_caching=True)
    report = engine.run(requests, arrivals)
    stats = report.stats
    eager_steps = sum(t.prefill_tokens + t.decode_rows > loaded.model.prefill_graphs.buckets[-1]
                      for t in report.step_timings)
    print(f"{name}: {report.steps} steps ({eager_steps} beyond the largest prefill bucket) in {report.wall_s:.1f} s, "
          f"{report.generated_tokens} tokens, peak batch {stats.peak_running}, preemptions {stats.preemptions}, "
          f"allocations after warm-up {report.allocations_after_warmup}, peak KV pages {stats.peak_kv_pages_used}, "
          f"kernels readied after warm-up {report.kernels_readied_after_warmup}")
    assert all(r.finish_reason in ("length", "stop") for r in report.results)  # none rejected or lost
    assert stats.peak_running > capacity.max_batch // 2 and eager_steps > 0  # the largest decode bucket ran
    assert report.allocations_after_warmup == 0
    assert report.kernels_readied_after_warmup == {}  # warm-up and graph capture readied every kernel
    assert {key: view.data_ptr() for key, view in loaded.arena._views.items()} == pointers
    engine.scheduler.check()
    assert engine.scheduler.num_slots_used == 0 and not engine.scheduler.has_unfinished
    torch.cuda.synchronize()
