"""``memplan run`` end to end in the simulator: random weights, an HF checkpoint
(greedy ids equal HF's), and the one-line errors (a prompt over max_context, a
checkpoint missing a tensor)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from planner.cli import main
from planner.loader import load_model
from tests.hf_reference import hf_model

SIM = ["--hardware", "cpu-sim", "--device", "sim"]
PROMPTS = [[3, 141, 59, 26, 5], [200, 7, 18]]
MISSING = "model.layers.1.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """A random tiny-qwen3 saved by transformers (config.json + model.safetensors)."""
    directory = tmp_path_factory.mktemp("tiny-qwen3-ckpt")
    hf = hf_model(load_model("tiny-qwen3"), seed=3)
    hf.save_pretrained(directory)
    return directory, hf


def _prompt_file(path: Path, prompts: list[list[int]]) -> Path:
    path.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in prompts))
    return path


def _outputs(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.strip()]


def _hf_greedy(hf: torch.nn.Module, prompt: list[int], new_tokens: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_random_weights_prints_one_line_per_request_and_the_report(capsys):
    code = main(["run", "--model", "tiny-qwen3", *SIM, "--serving", "sim", "--random-weights",
                 "--batch", "2", "--prompt-len", "5", "--max-new-tokens", "3"])
    out, err = capsys.readouterr()
    assert code == 0, err
    lines = _outputs(out)
    assert [line["request"] for line in lines] == [0, 1]
    assert all(line["prompt_len"] == 5 and len(line["output_ids"]) == 3 for line in lines)
    assert all(0 <= t < 256 for line in lines for t in line["output_ids"])
    for pool in ("weights", "kv_cache", "decode", "prefill", "sampling"):
        planned, allocated = next(row.split()[1:3] for row in err.splitlines() if row.split()[:1] == [pool])
        assert planned == allocated
    assert "allocations after warm-up: n/a (simulator)" in err
    assert "prefill: 10 tokens" in err and "decode TPOT:" in err


def test_checkpoint_generates_hf_greedy_ids(checkpoint, tmp_path, capsys):
    directory, hf = checkpoint
    prompts = _prompt_file(tmp_path / "prompts.jsonl", PROMPTS)
    out_file = tmp_path / "out.jsonl"
    code = main(["run", "--checkpoint", str(directory), *SIM, "--prompt-ids", str(prompts),
                 "--max-new-tokens", "3", "--out", str(out_file)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out == ""  # ids went to --out
    lines = _outputs(out_file.read_text())
    assert [line["prompt_len"] for line in lines] == [len(p) for p in PROMPTS]
    assert [line["output_ids"] for line in lines] == [_hf_greedy(hf, p, 3) for p in PROMPTS]


def test_prompt_over_max_context_names_the_request_and_the_limit(tmp_path, capsys):
    prompts = _prompt_file(tmp_path / "prompts.jsonl", [[1, 2], list(range(62))])
    code = main(["run", "--model", "tiny-qwen3", *SIM, "--random-weights", "--prompt-ids", str(prompts),
                 "--max-new-tokens", "3"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert "request 1" in err and "max_context" in err and "65" in err and "64" in err


def test_checkpoint_missing_a_tensor_is_one_line_naming_it(checkpoint, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    directory, _ = checkpoint
    broken = tmp_path / "broken"
    shutil.copytree(directory, broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors[MISSING]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    code = main(["run", "--checkpoint", str(broken), *SIM, "--batch", "1", "--prompt-len", "2",
                 "--max-new-tokens", "2"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert "missing" in err and MISSING in err


def test_plan_file_that_differs_from_the_planner_is_refused(tmp_path, capsys):
    assert main(["plan", "--model", "tiny-qwen3", "--hardware", "cpu-sim", "--serving", "sim",
                 "--out", str(tmp_path / "plan.json")]) == 0
    capsys.readouterr()
    data = json.loads((tmp_path / "plan.json").read_text())
    data["capacity"]["kv_pages"] -= 1
    (tmp_path / "edited.json").write_text(json.dumps(data))
    code = main(["run", "--plan", str(tmp_path / "edited.json"), "--device", "sim", "--random-weights"])
    err = capsys.readouterr().err
    assert code == 2 and "capacity.kv_pages" in err and "re-plan" in err


def test_waves_respect_max_batch_and_the_kv_pool_and_prefill_respects_the_chunk():
    from executor.generate import Request, _prefill_chunks, plan_waves
    from planner.loader import load_hardware, load_serving
    from planner.plan import build_plan

    plan = build_plan(load_model("tiny-qwen3"), load_hardware("cpu-sim"), load_serving("sim"))
    cap = plan.capacity
    waves = plan_waves(plan, [[1] * 5] * (cap.max_batch + 1), max_new_tokens=3)  # 8 tokens: 2 pages each
    assert [len(w) for w in waves] == [cap.max_batch, 1]
    assert [list(r.page_ids) for r in waves[0][:2]] == [[1, 2], [3, 4]] and list(waves[1][0].page_ids) == [1, 2]
    assert [r.slot for r in waves[0]] == list(range(cap.max_batch))
    small = plan.model_copy(update={"capacity": cap.model_copy(update={"kv_pages": 5})})  # 4 usable pages
    assert [len(w) for w in plan_waves(small, [[1] * 5] * 3, max_new_tokens=3)] == [2, 1]
    wave = [Request(0, [7] * 20, range(1, 7), 0), Request(1, [8] * 3, range(7, 8), 1)]
    cached = {0: 0, 1: 0}
    steps = []
    while any(cached[r.index] < len(r.prompt) for r in wave):
        chunks, finishing = _prefill_chunks(wave, cached, cap.max_prefill_tokens)
        steps.append(([(c.num_cached, len(c.token_ids)) for c in chunks], [r.index for _, r in finishing]))
    assert steps == [([(0, 16)], []), ([(16, 4), (0, 3)], [0, 1])]
