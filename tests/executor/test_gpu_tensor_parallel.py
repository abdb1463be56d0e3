"""GPU gates of tensor parallelism (2 or more H200s of one host, NCCL with NVLink multicast off):
Qwen3-0.6B and Qwen3.5-0.8B shapes at TP 2 against HF's bf16 log-probs within the single-GPU gates
(tests/executor/test_gpu_models.py), batched and at batch 1 (the fused GEMV path, whose row-parallel
adds all-reduce the residual stream); nothing allocates after warm-up on any rank, every rank's arena is
its per-rank plan; ``memplan run -tp 2`` reports both ranks; a rank that raises inside a step ends the
run naming it (the NCCL collective it left is aborted), in a subprocess so the abort stays there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from executor.serving import RANDOM_WEIGHTS, ServedModel
from executor.workload import RequestSpec
from planner.cli import main
from planner.loader import load_hardware, load_model, load_serving
from planner.plan import build_plan
from tests.executor.harness import Loaded
from tests.executor.test_gpu_models import _gate, _logprob_deltas, _prompts
from tests.hf_reference import hf_model
from tests.subprocess_env import python_path

pytestmark = [pytest.mark.gpu, pytest.mark.multi_gpu]

ROOT = Path(__file__).resolve().parents[2]
MODELS = ["qwen3-0.6b", "qwen3.5-0.8b"]


def _plan(name: str, tp: int, **serving):
    fields = {"max_batch": 16, "max_context": 512, "max_prefill_tokens": 4096, "gpu_memory_utilization": 0.25,
              "tensor_parallel_size": tp, **serving}
    return build_plan(load_model(name), load_hardware("h200"), load_serving("default", fields))


def _needs(gpus: int) -> None:
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs, the host has {torch.cuda.device_count()}")


@pytest.fixture(scope="module", params=MODELS)
def tp2(request, tmp_path_factory):
    """A random bf16 HF model of the real shape saved as a checkpoint, served at TP 2 (graphs captured),
    with the HF model on GPU 0 as the reference."""
    name = request.param
    directory = tmp_path_factory.mktemp(name)
    hf = hf_model(load_model(name), device="cuda", dtype=torch.bfloat16, seed=0)
    hf.save_pretrained(directory)
    plan = _plan(name, 2)
    served = ServedModel.open(plan, "cuda", weights=directory)
    yield name, Loaded(plan, served.arena, served.model, hf)
    served.close()


def test_tp2_hf_golden_bf16(tp2):
    name, loaded = tp2
    sequences, lengths = _prompts(loaded.plan.model.vocab_size, 16, 256, 16, seed=0)
    _gate(_logprob_deltas(loaded, sequences, lengths), 0.06, 0.2, f"{name} TP 2 bf16")


def test_tp2_batch_1_decode_hf_golden_bf16(tp2):
    """Batch-1 decode steps take the fused GEMVs: ranks > 0 add their partial into a zeroed stream and the
    stream is all-reduced (executor/models/projections.py)."""
    name, loaded = tp2
    assert loaded.plan.capacity.decode_gemv_batch == 1
    sequences, lengths = _prompts(loaded.plan.model.vocab_size, 3, 128, 24, seed=3)
    deltas = np.concatenate([_logprob_deltas(loaded, [seq], [n]) for seq, n in zip(sequences, lengths)])
    _gate(deltas, 0.06, 0.2, f"{name} TP 2 batch-1 decode (GEMV projections) bf16")


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", MODELS)
def test_nothing_allocates_after_warm_up_on_any_rank(name, tp):
    """A workload of mixed prompt lengths (prefill chunks, decode through graphs and eagerly past the
    buckets): every rank's arena is the per-rank plan and no rank allocates during the run."""
    _needs(tp)
    plan = _plan(name, tp, max_prefill_tokens=512)
    served = ServedModel.open(plan, "cuda", weights=RANDOM_WEIGHTS, seed=1)
    try:
        specs = [RequestSpec(prompt_ids=list(range(1, 1 + n)), max_new_tokens=12, arrival_step=index)
                 for index, n in enumerate([5, 400, 1, 33, 300, 9, 64, 2, 480, 17, 3, 128, 250, 6, 90, 11])]
        report = served.run(specs)
    finally:
        served.close()
    planned = sum(pool.bytes for pool in plan.pools if pool.materialized)
    assert [rank.rank for rank in report.ranks] == list(range(tp))
    print("\n".join(str(rank) for rank in report.ranks))
    for rank in report.ranks:
        assert rank.allocated_bytes == planned, rank
    assert report.generated_tokens == 12 * len(specs)
    lines = report.text.splitlines()
    assert sum("allocations during the run 0" in line for line in lines) == tp, report.text


def test_memplan_run_tp2_reports_every_rank(capsys):
    code = main(["run", "--model", "qwen3-0.6b", "--hardware", "h200", "--random-weights", "--max-model-len", "2048",
                 "--gpu-memory-utilization", "0.25", "--batch", "4", "--prompt-len", "100", "--max-new-tokens", "16",
                 "--tensor-parallel-size", "2"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert len([json.loads(line) for line in captured.out.splitlines() if line.strip()]) == 4
    for rank in range(2):
        assert f"rank {rank}: planned" in captured.err and "allocations during the run 0" in captured.err, captured.err


FAILING_RUN = """
import sys
from executor.parallel import RankError
from executor.serving import RANDOM_WEIGHTS, ServedModel
from executor.workers import Ranks
from tests.executor import rank_faults
from tests.executor.test_gpu_tensor_parallel import _plan

if __name__ == "__main__":
    plan = _plan("qwen3-0.6b", 2)
    ranks = Ranks.start(plan, "cuda", RANDOM_WEIGHTS, 0, timeout_s=60, worker=rank_faults.fail_at_first_step)
    try:
        ServedModel.open(plan, "cuda", weights=RANDOM_WEIGHTS, ranks=ranks)  # the warm-up's first step fails
    except RankError as error:
        print(f"raised: {error}", flush=True)
        sys.exit(3)
    sys.exit(0)
"""


def test_a_rank_that_raises_in_a_step_ends_the_run_naming_it(tmp_path):
    """Rank 1 raises in the warm-up's first step while rank 0's NCCL all-reduce waits for it on the GPU:
    the run ends (RankError raised, or the watch thread's exit 2) within the timeout, naming rank 1."""
    script = tmp_path / "failing_run.py"
    script.write_text(FAILING_RUN)
    done = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": python_path()})
    output = done.stdout + done.stderr
    assert done.returncode in (2, 3), output
    assert "rank 1 failed" in output and "injected fault" in output, output
