"""``memplan run`` end to end in the simulator (through the engine): random weights,
an HF checkpoint (greedy ids equal HF's), per-request rejection (a prompt over
max_context, an id outside the vocabulary) while the rest runs, a synthetic
shared-prefix workload hitting the prefix cache, and the one-line errors (a
malformed request line, a checkpoint missing a tensor, an edited plan file)."""

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
PROMPTS = [[3, 141, 59], [200, 7]]
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
                 "--batch", "2", "--prompt-len", "2", "--max-new-tokens", "2"])
    out, err = capsys.readouterr()
    assert code == 0, err
    lines = _outputs(out)
    assert [line["request"] for line in lines] == [0, 1]
    assert all(set(line) == {"request", "prompt_len", "output_ids", "finish_reason", "ttft_ms", "token_latencies_ms"}
               for line in lines)
    assert all(line["prompt_len"] == 2 and len(line["output_ids"]) == 2 for line in lines)
    assert all(line["finish_reason"] == "length" and len(line["token_latencies_ms"]) == 2 for line in lines)
    assert all(line["ttft_ms"] == line["token_latencies_ms"][0] > 0 for line in lines)
    assert all(0 <= t < 256 for line in lines for t in line["output_ids"])
    for pool in ("weights", "kv_cache", "decode", "prefill", "sampling"):
        planned, allocated = next(row.split()[1:3] for row in err.splitlines() if row.split()[:1] == [pool])
        assert planned == allocated
    assert "allocations after warm-up: n/a (simulator)" in err
    assert "requests: 2 (2 run, 0 rejected); 4 tokens generated" in err
    assert "TTFT: p50" in err and "TPOT: p50" in err and "preemptions: 0" in err
    assert "memplan run: done: 2 step(s), 2/2 requests finished, 4 tokens generated" in err
    startup = next(line for line in err.splitlines() if line.startswith("start-up: "))
    phases = [part.rsplit(" ", 2)[0] for part in startup.removeprefix("start-up: ").split(";")[0].split(", ")]
    assert phases[-5:] == ["plan", "imports", "requests", "materialize", "weights"], startup
    assert "first token" in startup  # the simulator compiles nothing: no kernel phases


def test_checkpoint_generates_hf_greedy_ids(checkpoint, tmp_path, capsys):
    directory, hf = checkpoint
    prompts = _prompt_file(tmp_path / "prompts.jsonl", PROMPTS)
    out_file = tmp_path / "out.jsonl"
    code = main(["run", "--checkpoint", str(directory), *SIM, "--prompt-ids", str(prompts),
                 "--max-new-tokens", "2", "--out", str(out_file)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out == ""  # ids went to --out
    lines = _outputs(out_file.read_text())
    assert [line["prompt_len"] for line in lines] == [len(p) for p in PROMPTS]
    assert [line["output_ids"] for line in lines] == [_hf_greedy(hf, p, 2) for p in PROMPTS]
    assert not (tmp_path / "out.jsonl.partial").exists()  # renamed to --out at the end


def test_a_run_that_fails_midway_leaves_out_untouched_and_the_finished_lines_in_out_partial(
        tmp_path, capsys, monkeypatch):
    from executor.serving import ServedModel
    from executor.workload import RunError

    def fail_after_one(self, specs, *, on_output=None, **kwargs):
        on_output(0, specs[0], None, None)
        raise RunError("stopped midway")

    monkeypatch.setattr(ServedModel, "run", fail_after_one)
    prompts = _prompt_file(tmp_path / "prompts.jsonl", [[1, 300]])  # 300: outside the vocabulary, rejected here
    out_file = tmp_path / "out.jsonl"
    out_file.write_text("old\n")
    code = main(["run", "--model", "tiny-qwen3", *SIM, "--random-weights", "--prompt-ids", str(prompts),
                 "--out", str(out_file)])
    err = capsys.readouterr().err
    assert code == 2 and "stopped midway" in err
    assert out_file.read_text() == "old\n"
    (line,) = _outputs((tmp_path / "out.jsonl.partial").read_text())
    assert line["request"] == 0 and line["finish_reason"] == "rejected"


def test_requests_the_plan_cannot_hold_are_rejected_in_their_line_and_the_rest_runs(tmp_path, capsys):
    prompts = _prompt_file(tmp_path / "prompts.jsonl", [[1, 2], list(range(63)), [5, 300]])
    code = main(["run", "--model", "tiny-qwen3", *SIM, "--random-weights", "--prompt-ids", str(prompts),
                 "--max-new-tokens", "2"])
    out, err = capsys.readouterr()
    assert code == 0, err
    lines = _outputs(out)
    assert [line["request"] for line in lines] == [2, 1, 0]  # as they finish: rejected here, at arrival, then run
    ok, over, outside = sorted(lines, key=lambda line: line["request"])
    assert ok["finish_reason"] == "length" and len(ok["output_ids"]) == 2 and "error" not in ok
    assert over["finish_reason"] == "rejected" and over["output_ids"] == [] and over["prompt_len"] == 63
    assert "max_context" in over["error"] and "65" in over["error"] and "64" in over["error"]
    assert outside["finish_reason"] == "rejected" and "300" in outside["error"] and "vocabulary" in outside["error"]
    assert "requests: 3 (1 run, 2 rejected); 2 tokens generated" in err


@pytest.mark.parametrize("line, says", [
    ('{"prompt_ids": [1, "x"]}', "line 3: prompt_ids: expected"),
    ('{"prompt_ids": [1, 2]', "line 3: column 22: malformed JSON"),  # the file's line, the column within it
    ('{"prompt_ids": [1], "prompt_ids": [2]}', "line 3: prompt_ids: duplicate key"),
    ('{"prompt": 5}', "line 3: prompt: expected a string, got 5"),  # the type, before the missing tokenizer
])
def test_malformed_request_line_is_one_line_naming_the_file_and_line(tmp_path, capsys, line, says):
    requests = tmp_path / "requests.jsonl"
    requests.write_text('{"prompt_len": 4}\n\n' + line + "\n")
    code = main(["run", "--model", "tiny-qwen3", *SIM, "--random-weights", "--requests", str(requests)])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert f"{requests} {says}" in err, err


def test_synthetic_shared_prefix_workload_hits_the_prefix_cache(capsys):
    # The first request arrives at step 0 and fills the prefix page; the other two arrive before step 2
    # (after step 0's update, also when overlapped) and compute only their last id.
    code = main(["run", "--model", "tiny-qwen3", *SIM, "--random-weights", "--num-requests", "3",
                 "--input-len", "5", "--output-len", "1", "--shared-prefix", "4"])
    out, err = capsys.readouterr()
    assert code == 0, err
    lines = _outputs(out)
    assert len(lines) == 3 and all(line["prompt_len"] == 5 and len(line["output_ids"]) == 1 for line in lines)
    rate = float(err.split("prefix cache: hit rate ")[1].split("%")[0])
    assert rate > 0


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


@pytest.mark.parametrize("flags", [["--num-requests", "2", "--input-len", "60", "--output-len", "5"],
                                   ["--batch", "2", "--prompt-len", "64", "--max-new-tokens", "1"]])
def test_synthetic_requests_over_max_context_are_a_flag_error_before_any_work(capsys, flags):
    """Synthetic requests are all alike: one that cannot fit rejects them all, so the flags are refused."""
    code = main(["run", "--model", "tiny-qwen3", *SIM, "--random-weights", *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "the plan's max_context 64" in err[0], err


def test_a_rejected_prompt_len_line_names_the_length_it_asked_for(tmp_path, capsys):
    requests = tmp_path / "requests.jsonl"
    requests.write_text('{"prompt_len": 100}\n')
    code = main(["run", "--model", "tiny-qwen3", *SIM, "--random-weights", "--requests", str(requests)])
    out, err = capsys.readouterr()
    (line,) = _outputs(out)
    assert code == 0 and line["finish_reason"] == "rejected" and line["prompt_len"] == 100, err
    assert line["error"].startswith("prompt_len = 100: must be in [1, 64]")
