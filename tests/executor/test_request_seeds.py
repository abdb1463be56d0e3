"""Requests that set no seed sample apart: each gets a seed of its own from the run's seed and its place in
the run (the CLI) or in the LLM's requests (the API), so equal prompts differ and a run repeats (the sampler's stream per seed: tests/kernels)."""

from __future__ import annotations

import json

from executor import LLM, SamplingParams
from executor.workload import SEED_LIMIT, RequestLimits, read_requests
from planner.cli import build_parser

LIMITS = RequestLimits(vocab_size=256, max_context=64)


def _seeds(tmp_path, lines: list[dict], *flags: str) -> list[int]:
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    args = build_parser().parse_args(["run", "--model", "tiny-qwen3", "--requests", str(path), *flags])
    return [spec.seed for spec in read_requests(args, LIMITS)]


def test_unseeded_request_lines_get_seeds_of_their_own_and_a_seeded_one_keeps_its_own(tmp_path):
    lines = [{"prompt_ids": [1, 2, 3]}] * 3 + [{"prompt_ids": [1, 2, 3], "seed": 5}]
    seeds = _seeds(tmp_path, lines, "--seed", "7")
    assert seeds[3] == 5
    assert len(set(seeds[:3])) == 3 and all(0 <= seed < SEED_LIMIT for seed in seeds)
    assert _seeds(tmp_path, lines, "--seed", "7") == seeds  # the same command, the same seeds
    assert _seeds(tmp_path, lines, "--seed", "8")[:3] != seeds[:3]


def test_equal_unseeded_prompts_sample_apart_and_one_seed_gives_one_stream():
    params = SamplingParams(max_new_tokens=4, temperature=1.0)
    prompts = [[5, 6, 7]] * 3
    llm = LLM("tiny-qwen3", hardware="cpu-sim", device="sim", random_weights=True, seed=4)
    first = [output.output_ids for output in llm.generate(prompts, params)]
    second = [output.output_ids for output in llm.generate(prompts, params)]
    assert len({tuple(ids) for ids in first + second}) > 1  # equal prompts, independent samples
    seeded = [output.output_ids for output in llm.generate(prompts, params.model_copy(update={"seed": 9}))]
    assert seeded[0] == seeded[1] == seeded[2]  # one seed, one stream
