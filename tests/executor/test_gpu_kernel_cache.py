"""GPU (H200): kernels loaded from the persistent cache give bit-identical outputs to freshly compiled
ones, whether Numba compiled them on the device (``store_compiled``) or the start-up compile's
processes compiled them with no device (``compile_image``: nvJitLink on the host); the start-up compile
covers warm-up and decode-graph capture (nothing compiles in the run's process after it); and
``memplan run`` twice over one cache compiles nothing the second time, with the same output ids."""

from __future__ import annotations

import json
import re

import pytest
import torch

from executor.compile import StartupCompile
from executor.engine import warm_up
from executor.kernel_cache import KernelCache
from executor.startup import KernelCensus
from executor.step import RequestChunk, plan_step
from planner.cli import main
from tests.executor.harness import load_with_hf

pytestmark = pytest.mark.gpu

SERVING = dict(max_batch=4, max_context=512, max_prefill_tokens=512, gpu_memory_utilization=0.1)


def _outputs(loaded) -> torch.Tensor:
    """The float32 logits of a two-request prefill step (a long chunk and a short one), a two-request
    decode step and a one-request decode step (the GEMV projections), run eagerly, as one tensor."""
    plan, model = loaded.plan, loaded.model
    pages = plan.capacity.pages_per_request
    first, second = list(range(1, 1 + pages)), list(range(1 + pages, 1 + 2 * pages))
    recurrent = plan.geometry.num_linear_layers > 0
    slot_a, slot_b = (0, 1) if recurrent else (-1, -1)
    for slot in (slot_a, slot_b):
        model.reset_slot(slot)
    logits = []
    # 297 tokens: a long chunk (the prefill_attention backend) beside a short one (the paged kernel).
    model.step(plan_step(plan, [RequestChunk(list(range(3, 300)), 0, first, slot=slot_a),
                                RequestChunk([5, 6, 7], 0, second, slot=slot_b)]))
    logits.append(model.logits(2).clone())
    model.step(plan_step(plan, [RequestChunk([7], 297, first, slot=slot_a), RequestChunk([9], 3, second, slot=slot_b)]))
    logits.append(model.logits(2).clone())
    model.step(plan_step(plan, [RequestChunk([11], 298, first, slot=slot_a)]))
    logits.append(model.logits(1).clone())
    torch.cuda.synchronize()
    return torch.cat([t.flatten() for t in logits])


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("name", ["qwen3-0.6b", "qwen3.5-0.8b"])
def test_kernels_from_the_cache_give_bit_identical_outputs(name, tmp_path, monkeypatch):
    monkeypatch.setenv("MEMPLAN_KERNEL_CACHE", "1")
    monkeypatch.setenv("MEMPLAN_CACHE_DIR", str(tmp_path / "stored"))
    fresh = load_with_hf(name, "h200", "default", seed=0, **SERVING)
    expected = _outputs(fresh)  # Numba compiles every kernel here and the cache stores its cubins
    census = KernelCensus.of(fresh.model)
    assert census.loaded == 0 and census.compiled > 10, census
    stored = load_with_hf(name, "h200", "default", seed=0, **SERVING)
    got = _outputs(stored)
    census = KernelCensus.of(stored.model)
    assert census.compiled == 0 and census.loaded > 10, census
    assert _bitwise_equal(got, expected)
    del fresh, stored

    # The start-up compile: processes with no device fill an empty cache; the model loads everything.
    monkeypatch.setenv("MEMPLAN_CACHE_DIR", str(tmp_path / "processes"))
    loaded = load_with_hf(name, "h200", "default", seed=0, **SERVING)
    report = StartupCompile(loaded.plan, KernelCache(tmp_path / "processes"), None).wait()
    assert not report.failed and report.processes > 1 and report.uncacheable == 0
    assert report.compiled == report.needed > 10, report.line()
    got = _outputs(loaded)
    warm_up(loaded.model)
    loaded.model.capture_decode_graphs()
    loaded.model.capture_prefill_graphs()
    census = KernelCensus.of(loaded.model)
    assert census.compiled == 0, census  # discovery found every kernel warm-up and both captures launch
    assert _bitwise_equal(got, expected)


def test_memplan_run_twice_over_one_cache_compiles_nothing_the_second_time(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MEMPLAN_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("MEMPLAN_KERNEL_CACHE", raising=False)
    command = ["run", "--model", "qwen3-0.6b", "--hardware", "h200", "--random-weights", "--max-batch", "8",
               "--max-context", "1024", "--gpu-memory-utilization", "0.3", "--batch", "4", "--prompt-len", "100",
               "--max-new-tokens", "8"]
    runs = []
    for _ in range(2):
        code = main(command)
        out, err = capsys.readouterr()
        with capsys.disabled():  # shown with -s, kept out of the next run's captured stdout
            print(err)
        assert code == 0, err
        runs.append(([json.loads(line)["output_ids"] for line in out.splitlines() if line.strip()], err))
    (first_ids, first), (second_ids, second) = runs
    assert first_ids == second_ids
    assert re.search(r"kernels: \d+ needed, 0 in the cache, \d+ compiled \(\d+ processes\)", first), first
    assert "(start-up manifest)" in second and "0 compiled here" in second, second
    for err in (first, second):
        assert re.search(r"  warm-up: \d+ kernels loaded from the cache, 0 compiled here", err), err
        assert re.search(r"  graph capture: \d+ kernels loaded from the cache, 0 compiled here", err), err
        assert "start-up: interpreter" in err and "first token" in err
