"""Serving a checkpoint directory as users have it, in the simulator, against HF transformers on the same
files: ``memplan run --model DIR --prompt TEXT`` prints HF ``generate`` + ``decode``'s text (a sharded
checkpoint); a generation_config.json EOS that HF reaches mid-way stops both at that token, and
``--ignore-eos`` runs on to max_new_tokens; a ``"messages"`` line feeds ``apply_chat_template``'s ids and a
``"stop"`` string ends the text before it; top-p with a seed gives the same tokens again and, at top-p 1,
the tokens of plain temperature sampling; a checkpoint without a tokenizer serves ids and refuses text in
one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from planner.cli import main
from planner.loader import load_model
from tests.executor.checkpoints import hf_generate, hf_tokenizer, save_checkpoint

SIM = ["--hardware", "cpu-sim", "--device", "sim"]
PROMPT = "the capital of france is"
NEW_TOKENS = 3
EOS_AT = 1  # the index in HF's greedy output of the token that generation_config.json names as EOS


def _outputs(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _hf_greedy(hf: torch.nn.Module, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy ids without any EOS (the reference of --ignore-eos)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """tiny-qwen3 saved in shards of at most 100 KB (model.safetensors.index.json) with the test tokenizer."""
    directory = tmp_path_factory.mktemp("sharded")
    hf = save_checkpoint(directory, load_model("tiny-qwen3"), seed=5, max_shard_size="100KB")
    assert len(list(directory.glob("*.safetensors"))) > 2 and (directory / "model.safetensors.index.json").exists()
    return directory, hf


@pytest.fixture(scope="module")
def with_eos(tmp_path_factory) -> tuple[Path, torch.nn.Module, int]:
    """tiny-qwen3 in one file whose generation_config.json names as EOS the token HF's greedy output for
    PROMPT reaches at EOS_AT (and not before)."""
    model = load_model("tiny-qwen3")
    for seed in range(20):
        directory = tmp_path_factory.mktemp(f"eos-{seed}")
        hf = save_checkpoint(directory, model, seed=seed)
        greedy = _hf_greedy(hf, hf_tokenizer(str(directory))(PROMPT)["input_ids"], NEW_TOKENS)
        if greedy[EOS_AT] not in greedy[:EOS_AT]:
            break
        shutil.rmtree(directory)
    eos = greedy[EOS_AT]
    hf.generation_config.eos_token_id = eos
    hf.generation_config.save_pretrained(directory)
    return directory, hf, eos


def test_model_dir_prompt_prints_hf_generate_and_decode(sharded, capsys):
    directory, hf = sharded
    tokenizer = hf_tokenizer(str(directory))
    expected = tokenizer.decode(hf_generate(hf, tokenizer(PROMPT)["input_ids"], NEW_TOKENS), skip_special_tokens=True)
    code = main(["run", "--model", str(directory), *SIM, "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out == expected + "\n"  # the streamed text, then the line's end
    assert f"weights: {directory}" in err and "sampling defaults: greedy" in err


def test_generation_config_eos_stops_where_hf_stops(with_eos, tmp_path, capsys):
    directory, hf, eos = with_eos
    tokenizer = hf_tokenizer(str(directory))
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    expected = hf_generate(hf, prompt_ids, NEW_TOKENS)
    assert expected[-1] == eos and len(expected) == EOS_AT + 1  # HF stopped mid-way
    out_file = tmp_path / "out.jsonl"
    code = main(["run", "--model", str(directory), *SIM, "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS),
                 "--out", str(out_file)])
    out, err = capsys.readouterr()
    assert code == 0, err
    (line,) = _outputs(out_file.read_text())
    assert line["output_ids"] == expected and line["finish_reason"] == "stop"
    assert line["prompt_len"] == len(prompt_ids)
    assert line["text"] == tokenizer.decode(expected, skip_special_tokens=True) and out == line["text"] + "\n"
    assert f"EOS ids: [{eos}] from {directory / 'generation_config.json'}" in err


def test_ignore_eos_runs_to_max_new_tokens(with_eos, tmp_path, capsys):
    directory, hf, eos = with_eos
    prompt_ids = hf_tokenizer(str(directory))(PROMPT)["input_ids"]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt_ids": prompt_ids}) + "\n")
    code = main(["run", "--checkpoint", str(directory), *SIM, "--prompt-ids", str(prompts), "--ignore-eos",
                 "--max-new-tokens", str(NEW_TOKENS)])
    out, err = capsys.readouterr()
    assert code == 0, err
    (line,) = _outputs(out)
    assert line["output_ids"] == _hf_greedy(hf, prompt_ids, NEW_TOKENS) and line["output_ids"][EOS_AT] == eos
    assert line["finish_reason"] == "length" and "ignored (--ignore-eos)" in err


def test_messages_feed_apply_chat_template_and_stop_strings_end_the_text(with_eos, tmp_path, capsys):
    directory, hf, _ = with_eos
    tokenizer = hf_tokenizer(str(directory))
    messages = [{"role": "system", "content": "tiny"}, {"role": "user", "content": "hello"}]
    chat_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    chat_expected = hf_generate(hf, chat_ids, NEW_TOKENS)
    prompt_ids = tokenizer("a tiny model writes")["input_ids"]
    greedy = _hf_greedy(hf, prompt_ids, NEW_TOKENS)
    first, second = (tokenizer.decode(greedy[:n], skip_special_tokens=True) for n in (1, 2))
    stop = second[len(first) :]  # the text the second token adds: the request stops there
    assert stop.strip() and stop not in first
    requests = tmp_path / "requests.jsonl"
    requests.write_text(json.dumps({"messages": messages}) + "\n"
                        + json.dumps({"prompt": "a tiny model writes", "stop": [stop], "ignore_eos": True}) + "\n")
    code = main(["run", "--model", str(directory), *SIM, "--requests", str(requests),
                 "--max-new-tokens", str(NEW_TOKENS)])
    out, err = capsys.readouterr()
    assert code == 0, err
    chat, stopped = sorted(_outputs(out), key=lambda line: line["request"])
    assert chat["prompt_len"] == len(chat_ids) and chat["output_ids"] == chat_expected
    assert chat["text"] == tokenizer.decode(chat_expected, skip_special_tokens=True)
    assert stopped["finish_reason"] == "stop" and stopped["output_ids"] == greedy[:2]  # it ends with the stop's token
    assert stopped["text"] == second[: second.index(stop)]


def test_top_p_is_reproducible_and_top_p_one_is_plain_temperature_sampling(sharded):
    from executor import LLM, SamplingParams

    directory, hf = sharded
    llm = LLM(directory, hardware="cpu-sim", device="sim")
    nucleus = SamplingParams(max_new_tokens=2, temperature=1.5, top_p=0.6, seed=5)
    only_the_max = SamplingParams(max_new_tokens=2, temperature=5.0, top_p=1e-6, seed=9)  # the nucleus is the argmax
    first = llm.generate(["the sea", "the sky", "the sea"],
                         [nucleus, SamplingParams(max_new_tokens=2, temperature=1.5, top_p=1.0, seed=7), only_the_max])
    assert first[2].output_ids == _hf_greedy(hf, first[2].prompt_ids, 2)
    second = llm.generate(["the sea", "the sky"], [nucleus, SamplingParams(max_new_tokens=2, temperature=1.5, seed=7)])
    assert first[0].output_ids == second[0].output_ids and first[0].text == second[0].text  # the seed, another run
    assert first[1].output_ids == second[1].output_ids  # top-p 1 is plain temperature sampling
    assert all(len(output.output_ids) == 2 and output.text is not None for output in first + second)
    assert first[0].prompt == "the sea" and first[0].prompt_ids == hf_tokenizer(str(directory))("the sea")["input_ids"]
    assert llm.report.requests == 2 and llm.report.generated_tokens == 4
    assert "sampling defaults: greedy" in llm.report.text  # the checkpoint has none; these requests set theirs


def test_checkpoint_without_tokenizer_serves_ids_and_refuses_text(tmp_path, capsys):
    directory = tmp_path / "no-tokenizer"
    save_checkpoint(directory, load_model("tiny-qwen3"), seed=1, tokenizer=False)
    capsys.readouterr()  # save_pretrained's progress bar
    code = main(["run", "--model", str(directory), *SIM, "--prompt", PROMPT])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert "--prompt" in err and "tokenizer" in err
    requests = tmp_path / "requests.jsonl"
    requests.write_text(json.dumps({"prompt_ids": [3, 4]}) + "\n" + json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    code = main(["run", "--model", str(directory), *SIM, "--requests", str(requests)])
    err = capsys.readouterr().err
    assert code == 2 and f"{requests} line 2" in err and "tokenizer" in err
    (tmp_path / "ids.jsonl").write_text(json.dumps({"prompt_ids": [3, 4]}) + "\n")
    code = main(["run", "--model", str(directory), *SIM, "--prompt-ids", str(tmp_path / "ids.jsonl"),
                 "--max-new-tokens", "1"])
    out, err = capsys.readouterr()
    assert code == 0, err
    (line,) = _outputs(out)
    assert "text" not in line and len(line["output_ids"]) == 1


def test_bad_sampling_flags_and_request_fields_are_one_line(sharded, tmp_path, capsys):
    directory, _ = sharded
    code = main(["run", "--model", str(directory), *SIM, "--prompt", PROMPT, "--top-p", "1.5"])
    err = capsys.readouterr().err
    assert code == 2 and "top_p" in err and "(0, 1]" in err and len(err.strip().splitlines()) == 1
    requests = tmp_path / "requests.jsonl"
    for line, field in (({"prompt": 3}, "prompt"), ({"messages": [{"content": "x"}]}, "messages"),
                        ({"prompt": PROMPT, "prompt_ids": [1]}, "exactly one of"),
                        ({"prompt": PROMPT, "ignore_eos": 1}, "ignore_eos"),
                        ({"prompt": PROMPT, "top_p": "1"}, "top_p")):
        requests.write_text(json.dumps(line) + "\n")
        code = main(["run", "--model", str(directory), *SIM, "--requests", str(requests)])
        err = capsys.readouterr().err
        assert code == 2 and f"{requests} line 1" in err and field in err, (line, err)
    # well-typed values the kernels cannot serve: that request's line is rejected, naming the field; the other runs
    lines = [{"prompt": PROMPT, "top_p": 0}, {"prompt": PROMPT, "stop": [""]}, {"prompt": PROMPT, "max_new_tokens": 1}]
    requests.write_text("".join(json.dumps(line) + "\n" for line in lines))
    code = main(["run", "--model", str(directory), *SIM, "--requests", str(requests)])
    records = {record["request"]: record for record in map(json.loads, capsys.readouterr().out.splitlines())}
    assert code == 0 and sorted(records) == [0, 1, 2]
    for index, field in ((0, "top_p"), (1, "stop")):
        assert records[index]["finish_reason"] == "rejected" and records[index]["error"].startswith(field)
    assert records[2]["finish_reason"] != "rejected"
