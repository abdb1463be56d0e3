"""Tensor parallelism in the simulator on gloo: two rank processes serve tiny Qwen3 and Qwen3.5
checkpoints whose vocabulary (251, prime) divides by no tp, so the vocab shards are padded and uneven.
TP 2 gives HF transformers' greedy tokens and TP 1's; each rank's weights are the HF tensors cut by heads
(tests/shard_reference.py, written from HF's layout); a rank that raises, or stops answering, ends the
run with a RankError naming it, well before any default timeout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from executor.api import LLM, SamplingParams
from executor.arena import materialize
from executor.device import open_device
from executor.parallel import RankError
from executor.serving import ServedModel
from executor.weights import load_checkpoint
from executor.workers import Ranks
from executor.workload import RequestSpec
from planner.cli import main
from planner.loader import load_model
from tests.executor import rank_faults
from tests.hf_reference import hf_model
from tests.shard_reference import reference_shard
from tests.subprocess_env import python_path

pytest.importorskip("transformers")

ODD_VOCAB = 251
#: Two prompts decoded together: one past gemm_attention_min_tokens (4 in sim.yaml), one below it, with ids
#: in the first and the last (padded) vocab shard.
PROMPTS = [[(7 * i + 3) % ODD_VOCAB for i in range(6)], [5, 250, 17]]
NEW_TOKENS = 3
SIM = {"hardware": "cpu-sim", "device": "sim"}
#: The collectives' timeout of the failure tests: a hung rank must end the run after it.
SHORT_TIMEOUT_S = 3.0
ROOT = Path(__file__).resolve().parents[2]


def _save(directory: Path, name: str) -> torch.nn.Module:
    """A random HF model of ``name``'s shape with the odd vocabulary, its norm weights moved off their
    init (so Qwen3.5's 1 + w offset matters), saved without tokenizer or EOS; returned (float32, eval)."""
    model = load_model(name).model_copy(update={"vocab_size": ODD_VOCAB})
    hf = hf_model(model, seed=11)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for tensor_name, tensor in hf.state_dict().items():
            if tensor_name.endswith("norm.weight"):
                tensor.add_(0.1 * torch.randn(tensor.shape, generator=generator))
    hf.save_pretrained(directory)
    return hf


def _hf_greedy(hf: torch.nn.Module, prompt: list[int]) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.fixture(scope="module", params=["tiny-qwen3", "tiny-qwen3.5"])
def checkpoint(request, tmp_path_factory) -> tuple[Path, list[list[int]]]:
    """A saved checkpoint and HF's greedy tokens for PROMPTS."""
    directory = tmp_path_factory.mktemp(request.param)
    hf = _save(directory, request.param)
    return directory, [_hf_greedy(hf, prompt) for prompt in PROMPTS]


def test_memplan_run_tp2_gives_hf_greedy_tokens_and_tp1s(checkpoint, tmp_path, capsys):
    """``memplan run --tensor-parallel-size 2`` (rank 0 and one spawned rank) prints HF's greedy tokens,
    and the Python API at TP 1 gives the same."""
    directory, expected = checkpoint
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps({"prompt_ids": p, "max_new_tokens": NEW_TOKENS}) + "\n" for p in PROMPTS))
    code = main(["run", "--model", str(directory), "--hardware", "cpu-sim", "--device", "sim", "--ignore-eos",
                 "--prompt-ids", str(requests), "--tensor-parallel-size", "2"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    lines = [json.loads(line) for line in captured.out.splitlines() if line.strip()]
    assert [line["output_ids"] for line in sorted(lines, key=lambda line: line["request"])] == expected
    materialized = sum(pool.bytes for pool in _tp2_plan(directory).pools if pool.materialized)
    for rank in range(2):  # each rank's own measure of its arena, against the per-rank plan
        assert f"rank {rank}: planned {materialized:,} bytes, allocated {materialized:,}" in captured.err
    with LLM(directory, **SIM) as llm:
        outputs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    assert [output.output_ids for output in outputs] == expected


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen3.5"])
def test_each_rank_loads_the_hf_tensor_cut_by_heads(name, tmp_path):
    """load_checkpoint on rank r's arena puts, in every planned weight, HF's tensor cut by heads for rank r
    (padded vocab rows zero)."""
    hf = _save(tmp_path, name)
    model = load_model(name).model_copy(update={"vocab_size": ODD_VOCAB})
    from planner.loader import load_hardware, load_serving
    from planner.plan import build_plan

    plan = build_plan(model, load_hardware("cpu-sim"), load_serving("sim", {"tensor_parallel_size": 2}))
    state = hf.state_dict()
    for rank in range(2):
        arena = materialize(plan, open_device("sim"), rank)
        load_checkpoint(arena, tmp_path)
        for buffer in plan.pool("weights").buffers:
            expected = reference_shard(model, buffer.name, state[buffer.name], 2, rank)
            assert torch.equal(arena.tensor("weights", buffer.name), expected), f"rank {rank} {buffer.name}"


@pytest.fixture(scope="module")
def qwen3_saved(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    directory = tmp_path_factory.mktemp("qwen3")
    return directory, _save(directory, "tiny-qwen3")


@pytest.fixture(scope="module")
def qwen3_checkpoint(qwen3_saved) -> Path:
    return qwen3_saved[0]


def test_torchrun_tp2_gives_hf_greedy_tokens(qwen3_saved, tmp_path):
    """Under ``torchrun --nproc-per-node 2`` each process runs ``memplan run``: rank 0 serves and writes the
    output, rank 1 serves its part of every step and writes nothing."""
    directory, hf = qwen3_saved
    requests, out = tmp_path / "requests.jsonl", tmp_path / "out.jsonl"
    requests.write_text("".join(json.dumps({"prompt_ids": p, "max_new_tokens": NEW_TOKENS}) + "\n" for p in PROMPTS))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
               "planner.cli", "run", "--model", str(directory), "--hardware", "cpu-sim", "--device", "sim",
               "--ignore-eos", "--prompt-ids", str(requests), "--out", str(out), "--tensor-parallel-size", "2"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": python_path()})
    assert done.returncode == 0, done.stderr[-4000:]
    lines = sorted((json.loads(line) for line in out.read_text().splitlines()), key=lambda line: line["request"])
    assert [line["output_ids"] for line in lines] == [_hf_greedy(hf, prompt) for prompt in PROMPTS]


def _tp2_plan(directory: Path):
    from planner.loader import plan_from_configs

    return plan_from_configs(str(directory), "cpu-sim", None, {"tensor_parallel_size": 2})


@pytest.mark.parametrize("worker,where", [(rank_faults.fail_at_start, "open"),
                                          (rank_faults.fail_at_first_step, "run")])
def test_a_rank_that_raises_ends_the_run_with_its_error(qwen3_checkpoint, worker, where):
    """Rank 1 raises before joining the group, or inside the first step: rank 0's open or run raises a
    RankError naming rank 1 and carrying its error, and rank 1's process is gone."""
    plan = _tp2_plan(qwen3_checkpoint)
    start = time.monotonic()
    ranks = None
    with pytest.raises(RankError) as raised:
        ranks = Ranks.start(plan, "sim", str(qwen3_checkpoint), 0, timeout_s=SHORT_TIMEOUT_S, worker=worker)
        served = ServedModel.open(plan, "sim", weights=qwen3_checkpoint, ranks=ranks)
        assert where == "run", "a rank that fails at start fails Ranks.start"
        served.run([RequestSpec(prompt_ids=PROMPTS[1], max_new_tokens=2)])
    assert raised.value.rank == 1 and rank_faults.FAULT in str(raised.value), str(raised.value)
    assert time.monotonic() - start < 60.0
    if ranks is not None:
        assert not any(process.is_alive() for process in ranks.processes)


def test_a_rank_that_stops_answering_ends_the_run_after_the_timeout(qwen3_checkpoint):
    """Rank 1 sleeps inside the first step: rank 0's collective times out and the RankError names rank 1."""
    plan = _tp2_plan(qwen3_checkpoint)
    ranks = Ranks.start(plan, "sim", str(qwen3_checkpoint), 0, timeout_s=SHORT_TIMEOUT_S,
                        worker=rank_faults.hang_at_first_step)
    served = ServedModel.open(plan, "sim", weights=qwen3_checkpoint, ranks=ranks)
    start = time.monotonic()
    with pytest.raises(RankError) as raised:
        served.run([RequestSpec(prompt_ids=PROMPTS[1], max_new_tokens=2)])
    assert raised.value.rank == 1 and "did not answer" in str(raised.value), str(raised.value)
    assert time.monotonic() - start < 60.0
    assert not any(process.is_alive() for process in ranks.processes)


def test_memplan_run_exits_2_naming_the_failed_rank(qwen3_checkpoint, monkeypatch, capsys):
    """``memplan run -tp 2`` whose rank 1 raises in its first step: exit 2, one line naming rank 1 and its error."""
    start = Ranks.start

    def start_failing(plan, device, weights, seed, **kwargs):
        return start(plan, device, weights, seed, timeout_s=SHORT_TIMEOUT_S, worker=rank_faults.fail_at_first_step)

    monkeypatch.setattr(Ranks, "start", start_failing)
    code = main(["run", "--model", str(qwen3_checkpoint), "--hardware", "cpu-sim", "--device", "sim",
                 "--batch", "1", "--prompt-len", "3", "--max-new-tokens", "2", "--tensor-parallel-size", "2"])
    err = capsys.readouterr().err
    assert code == 2
    assert "memplan: tensor-parallel error: rank 1 failed: ValueError: injected fault in a step on rank 1" in err, err


def test_a_worker_runs_the_slot_messages_rank_0_announces_in_order():
    """What rank 0's model announces for a fresh slot, a snapshot restored and one taken is what a worker's
    loop runs, in order, on its own model (the prefix cache's copies reach every rank)."""
    from executor.workers import follow
    from tests.executor.harness import shared_tiny

    model = shared_tiny("tiny-qwen3.5").model
    announced: list[tuple] = []
    model.announce = announced.append
    try:
        model.reset_slot(1)
        model.copy_slot(4, 1)
        model.copy_slot(1, 5)
    finally:
        model.announce = None
    ran: list[tuple] = []

    class Worker:  # records what follow() calls on a worker's model
        def reset_slot(self, slot):
            ran.append(("reset_slot", slot))

        def copy_slot(self, source, target):
            ran.append(("copy_slot", source, target))

    messages = iter([*announced, ("stop",)])
    follow(Worker(), type("Parallel", (), {"rank": 1, "receive": staticmethod(lambda: next(messages))})())
    assert ran == [("reset_slot", 1), ("copy_slot", 4, 1), ("copy_slot", 1, 5)]
