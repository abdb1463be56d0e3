"""A fixed corpus of bad and edge inputs for ``memplan plan``, ``validate`` and ``run``.

Each ``Case`` writes its files into a fresh folder and gives the command line; ``run_case`` runs it through
``planner.cli.main`` in-process and sorts the result into one ``Outcome`` kind:

- ``ok``: the promise holds: exit 0/2/3 as expected; a refusal is one stderr line naming what the case names
  (file, field, rule words); a rejected request's output line names them; no file in the folder changed
  (inputs and an existing ``--out`` untouched) unless the command succeeded.
- ``traceback``: an exception escaped ``main`` (or an exit code other than 0/2/3).
- ``accepted``: exit 0 (or a request that ran) where the input is bad.
- ``unclear``: refused, but the message is not one line or does not name the case's words.
- ``lost``: a file in the folder changed or appeared although the command failed.
- ``hang``: the case ran past its time limit (a reader blocked on a FIFO, an unbounded read).

The seven classes are issue 35's: 1 KV-cache dtype pairs, 2 request lines and flags, 3 ``--out``, 4 readers,
5 checkpoints, 6 values accepted that should not be, 7 messages that name nothing. Cases marked ``sim`` may
run the Numba CUDA simulator (seconds each); the rest stop before the device is touched.

``python3 -m tests.fuzz.corpus [--classes 1,2] [--no-sim] [--verbose]`` prints the counts by class and kind.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import resource
import signal
import struct
import sys
import subprocess
import tempfile
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
SIM = ["--hardware", "cpu-sim", "--device", "sim"]
#: tiny-qwen3: what the run cases plan (vocab 256, the sim serving config's max_context 64).
VOCAB, MAX_CONTEXT = 256, 64
#: Seconds one case may take (a simulator run of one short request fits easily).
CASE_TIMEOUT_S = 180
#: ... and one that never reaches the simulator; a reader blocked on a FIFO gets less.
NO_SIM_TIMEOUT_S, BLOCKING_TIMEOUT_S = 30, 10

OUTCOMES = ("ok", "traceback", "accepted", "unclear", "lost", "hang")


@dataclass(frozen=True)
class Case:
    """One input. ``build(folder)`` writes the case's files and returns the argv of ``memplan``.

    expect: "refused" (exit 2), "rejected" (exit 0, every output line rejected), "refused_or_rejected",
    "ok" (exit 0), "runs" (exit 0, no output line rejected), "ok_or_refused", "fits_or_not" (exit 0 or 3).
    names: words (case-insensitive) the refusal or the rejected line's error must hold; "a|b" is either.
    """

    klass: int
    name: str
    build: Callable[[Path], list[str]]
    expect: str = "refused"
    names: tuple[str, ...] = ()
    sim: bool = False
    cwd: str | None = None
    bad: bool = True  # False: a control (a good input that must keep working)
    timeout_s: int | None = None  # None: CASE_TIMEOUT_S with the simulator, NO_SIM_TIMEOUT_S without


@dataclass
class Outcome:
    kind: str
    detail: str = ""
    code: int | None = None


class _Timeout(Exception):
    pass


# -- files ----------------------------------------------------------------------------------------------------------


def _yaml_of(name: str, kind: str) -> dict[str, Any]:
    return yaml.safe_load((CONFIGS / kind / f"{name}.yaml").read_text())


def _write(path: Path, content: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, str):
        content = content.encode()
    path.write_bytes(content)
    return path


def _hf_qwen3() -> dict[str, Any]:
    model = _yaml_of("tiny-qwen3", "models")
    return {"model_type": "qwen3", "hidden_size": model["hidden_size"], "num_hidden_layers": model["num_layers"],
            "intermediate_size": model["intermediate_size"], "num_attention_heads": model["num_attention_heads"],
            "num_key_value_heads": model["num_key_value_heads"], "head_dim": model["head_dim"],
            "vocab_size": model["vocab_size"], "max_position_embeddings": model["max_position_embeddings"],
            "rms_norm_eps": model["rms_norm_eps"], "tie_word_embeddings": False, "hidden_act": "silu",
            "attention_bias": False, "torch_dtype": "float32",
            "rope_parameters": {"rope_type": "default", "rope_theta": model["rope_theta"]}}


def _hf_qwen3_5() -> dict[str, Any]:
    model = _yaml_of("tiny-qwen3.5", "models")
    lin = model["linear_attention"]
    return {**_hf_qwen3(), "model_type": "qwen3_5_text", "layer_types": model["layer_types"],
            "linear_num_key_heads": lin["num_key_heads"], "linear_num_value_heads": lin["num_value_heads"],
            "linear_key_head_dim": lin["key_head_dim"], "linear_value_head_dim": lin["value_head_dim"],
            "linear_conv_kernel_dim": lin["conv_kernel_size"],
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}}


def _good_plan_json() -> dict[str, Any]:
    from planner.loader import plan_from_configs

    return json.loads(plan_from_configs("tiny-qwen3", "cpu-sim", "sim").model_dump_json())


def _checkpoint(folder: Path, tensors: dict[str, Any] | None = None, *, shards: int = 1) -> Path:
    """A tiny-qwen3 checkpoint folder (config.json + safetensors of the planned names and shapes)."""
    import numpy as np
    from safetensors.numpy import save_file

    from planner.loader import plan_from_configs

    folder.mkdir(parents=True, exist_ok=True)
    _write(folder / "config.json", json.dumps(_hf_qwen3()))
    if tensors is None:
        plan = plan_from_configs("tiny-qwen3", "cpu-sim", "sim")
        rng = np.random.default_rng(0)
        tensors = {b.name: (rng.standard_normal(b.shape) * 0.02).astype(np.float32)
                   for b in plan.pool("weights").buffers}
    names = sorted(tensors)
    for shard in range(shards):
        part = {name: tensors[name] for name in names[shard::shards]}
        save_file(part, str(folder / f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"))
    return folder


def _planned_tensors() -> dict[str, Any]:
    import numpy as np

    from planner.loader import plan_from_configs

    plan = plan_from_configs("tiny-qwen3", "cpu-sim", "sim")
    return {b.name: np.full(b.shape, 0.01, np.float32) for b in plan.pool("weights").buffers}


def _safetensors_bytes(header: dict[str, Any] | bytes, data: bytes = b"") -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


# -- class 1: KV-cache dtype pairs ----------------------------------------------------------------------------------

_DTYPES = ("auto", "bfloat16", "float16", "float32")
_MODEL_DTYPE = {"tiny-qwen3": "float32", "tiny-qwen3.5": "float32", "qwen3-8b": "bfloat16"}


def _class1() -> list[Case]:
    cases = []
    for model, hardware, serving in (("tiny-qwen3", "cpu-sim", "sim"), ("tiny-qwen3.5", "cpu-sim", "sim"),
                                     ("qwen3-8b", "h200", "default")):
        for dtype in _DTYPES:
            for kv in _DTYPES:
                activations = _MODEL_DTYPE[model] if dtype == "auto" else dtype
                kv_resolved = activations if kv == "auto" else kv
                argv = ["plan", "--model", model, "--hardware", hardware, "--serving", serving,
                        "--dtype", dtype, "--kv-cache-dtype", kv]
                if kv_resolved == activations:
                    cases.append(Case(1, f"plan {model} dtype={dtype} kv={kv}", lambda d, a=argv: a,
                                      expect="fits_or_not", bad=False))
                else:
                    cases.append(Case(1, f"plan {model} dtype={dtype} kv={kv}", lambda d, a=argv: a,
                                      names=("kv_cache_dtype", kv)))

    def serving_file(d: Path) -> list[str]:
        path = _write(d / "kv.yaml", yaml.safe_dump({**_yaml_of("sim", "serving"), "kv_cache_dtype": "float16"}))
        return ["plan", "--model", "tiny-qwen3", "--hardware", "cpu-sim", "--serving", str(path)]

    cases.append(Case(1, "serving file kv_cache_dtype float16 over float32", serving_file,
                      names=("kv.yaml", "kv_cache_dtype")))

    def edited_plan(d: Path) -> list[str]:
        data = _good_plan_json()
        data["serving"]["kv_cache_dtype"] = "bfloat16"
        return ["validate", str(_write(d / "plan.json", json.dumps(data)))]

    cases.append(Case(1, "validate a plan whose serving kv_cache_dtype differs", edited_plan,
                      names=("plan.json", "kv_cache")))

    def run_edited_plan(d: Path) -> list[str]:
        data = _good_plan_json()
        data["serving"]["kv_cache_dtype"] = "bfloat16"
        return ["run", "--plan", str(_write(d / "plan.json", json.dumps(data))), "--device", "sim",
                "--random-weights", "--batch", "1", "--prompt-len", "1", "--max-new-tokens", "1"]

    cases.append(Case(1, "run --plan with kv_cache_dtype differing", run_edited_plan,
                      names=("plan.json", "kv_cache"), sim=True))
    for kv, prompt in (("float32", 3), ("float32", 5), ("float16", 3)):
        argv = ["run", "--model", "tiny-qwen3", *SIM, "--random-weights", "--dtype", "bfloat16",
                "--kv-cache-dtype", kv, "--batch", "2", "--prompt-len", str(prompt), "--max-new-tokens", "2"]
        cases.append(Case(1, f"run bfloat16 activations, {kv} KV, prompt {prompt}", lambda d, a=argv: a,
                          names=("kv_cache_dtype", kv), sim=True))
    return cases


# -- class 2: request lines and flags -------------------------------------------------------------------------------

_RUN = ["run", "--model", "tiny-qwen3", *SIM, "--random-weights"]

#: (field, JSON text of the bad value): each becomes one --requests line of its own.
_BAD_REQUEST_VALUES = [
    ("seed", str(2**64)), ("seed", str(2**70)), ("seed", "-1"), ("seed", str(-(2**63) - 1)),
    ("seed", "1.5"), ("seed", '"7"'), ("seed", "true"), ("seed", "null"),
    ("top_k", str(2**63)), ("top_k", str(2**32 + 1)), ("top_k", str(2**31)), ("top_k", str(VOCAB + 1)),
    ("top_k", "-1"), ("top_k", "1.5"), ("top_k", '"3"'), ("top_k", "true"), ("top_k", str(10**30)),
    ("temperature", "-1"), ("temperature", "NaN"), ("temperature", "Infinity"), ("temperature", "-Infinity"),
    ("temperature", "1e999"), ("temperature", "1e39"), ("temperature", '"0.5"'), ("temperature", "true"),
    ("temperature", "null"),
    ("max_new_tokens", str(2**63)), ("max_new_tokens", "0"), ("max_new_tokens", "-5"), ("max_new_tokens", "1.5"),
    ("max_new_tokens", '"2"'), ("max_new_tokens", str(10**13)), ("max_new_tokens", "null"),
    ("stop_ids", f"[{2**70}]"), ("stop_ids", "[-1]"), ("stop_ids", f"[{VOCAB}]"), ("stop_ids", '"1"'),
    ("stop_ids", "[1.5]"), ("stop_ids", "[[1]]"),
]
_BAD_PROMPT_LENS = [str(10**13), str(2**63), "-1", "1.5", '"4"', str(MAX_CONTEXT + 1), "true"]
_BAD_PROMPT_IDS = [f"[{2**64}]", "[-1]", "[[1]]", '"1,2"', "[true]", "[1.0]", '{"a": 1}', "null"]


def _request_line_case(klass: int, name: str, line: str, names: tuple[str, ...], flag: str = "--requests",
                       extra: tuple[str, ...] = ()) -> Case:
    def build(d: Path) -> list[str]:
        return [*_RUN, flag, str(_write(d / "requests.jsonl", line + "\n")), "--max-new-tokens", "1", *extra]

    return Case(klass, name, build, expect="refused_or_rejected", names=names, sim=True)


def _class2() -> list[Case]:
    cases = []
    for key, value in _BAD_REQUEST_VALUES:
        cases.append(_request_line_case(2, f"request {key}={value[:24]}", f'{{"prompt_ids": [1, 2], "{key}": {value}}}',
                                        (key,)))
    for value in (2**63, 2**64 - 1):  # u64 seeds: the sampler's key is their 64 bits
        case = _request_line_case(2, f"request seed={value}", f'{{"prompt_ids": [1, 2], "seed": {value}}}', ())
        cases.append(Case(2, case.name, case.build, expect="runs", sim=True, bad=False))
    for value in _BAD_PROMPT_LENS:
        cases.append(_request_line_case(2, f"request prompt_len={value[:24]}", f'{{"prompt_len": {value}}}',
                                        ("prompt_len",)))
    for value in _BAD_PROMPT_IDS:
        cases.append(_request_line_case(2, f"request prompt_ids={value[:24]}", f'{{"prompt_ids": {value}}}',
                                        ("prompt_ids",)))
    structural = [
        ("unknown key", '{"prompt_ids": [1], "bogus": 1}', ("bogus",)),
        ("both prompt fields", '{"prompt_ids": [1], "prompt_len": 2}', ("prompt_ids", "prompt_len")),
        ("neither prompt field", '{"max_new_tokens": 2}', ("prompt_ids|prompt_len",)),
        ("a list line", "[1, 2]", ("line 1", "object")),
        ("a string line", '"hello"', ("line 1", "object")),
        ("a null line", "null", ("line 1", "object")),
        ("duplicate key", '{"prompt_len": 2, "prompt_len": 3}', ("line 1", "prompt_len", "duplicate")),
        ("deep nesting", '{"prompt_ids": ' + "[" * 100_000 + "]" * 100_000 + "}", ("line 1", "nest")),
        ("NaN literal top level", "NaN", ("line 1",)),
        ("a 5000-digit number", '{"prompt_len": ' + "9" * 5000 + "}", ("line 1", "prompt_len|digits")),
    ]
    for name, line, names in structural:
        cases.append(_request_line_case(2, f"request {name}", line, names))
    prompt_id_lines = [
        ("max_new_tokens over max_context", '{"prompt_ids": [1, 2], "max_new_tokens": 1000000}',
         ("max_new_tokens|max_context",)),
        ("seed 2**64", f'{{"prompt_ids": [1], "seed": {2**64}}}', ("seed",)),
        ("top_k -1", '{"prompt_ids": [1], "top_k": -1}', ("top_k",)),
        ("unknown key", '{"prompt_ids": [1], "bogus": 1}', ("bogus",)),
        ("prompt_len only", '{"prompt_len": 3}', ("prompt_ids",)),
    ]
    for name, line, names in prompt_id_lines:
        cases.append(_request_line_case(2, f"--prompt-ids {name}", line, names, flag="--prompt-ids"))

    flags = [
        ("--seed -1", ["--seed", "-1"], ("--seed",)),
        ("--seed 2**70", ["--seed", str(2**70)], ("--seed",)),
        ("--seed 2**64", ["--seed", str(2**64)], ("--seed",)),
        ("--prompt-len 10**13", ["--prompt-len", str(10**13)], ("--prompt-len",)),
        ("--prompt-len 0", ["--prompt-len", "0"], ("--prompt-len",)),
        ("--prompt-len -3", ["--prompt-len", "-3"], ("--prompt-len",)),
        ("--prompt-len over max_context", ["--prompt-len", str(MAX_CONTEXT + 1)], ("--prompt-len|max_context",)),
        ("--batch 0", ["--batch", "0"], ("--batch",)),
        ("--batch -1", ["--batch", "-1"], ("--batch",)),
        ("--batch 10**9", ["--batch", str(10**9)], ("--batch",)),
        ("--max-new-tokens 0", ["--max-new-tokens", "0"], ("--max-new-tokens|max_new_tokens",)),
        ("--max-new-tokens -1", ["--max-new-tokens", "-1"], ("--max-new-tokens|max_new_tokens",)),
        ("--max-new-tokens 10**13", ["--max-new-tokens", str(10**13)], ("--max-new-tokens|max_context",)),
        ("--num-requests 0", ["--num-requests", "0"], ("--num-requests",)),
        ("--num-requests 10**9", ["--num-requests", str(10**9), "--input-len", "2"], ("--num-requests",)),
        ("--input-len 10**13", ["--num-requests", "1", "--input-len", str(10**13)], ("--input-len",)),
        ("--output-len 10**13", ["--num-requests", "1", "--input-len", "2", "--output-len", str(10**13)],
         ("--output-len|max_context",)),
        ("--shared-prefix -1", ["--num-requests", "2", "--input-len", "2", "--shared-prefix", "-1"],
         ("--shared-prefix",)),
        ("--batch not an int", ["--batch", "two"], ("--batch",)),
        ("--seed not an int", ["--seed", "1e3"], ("--seed",)),
    ]
    for name, extra, names in flags:
        argv = [*_RUN, *extra]
        if "--max-new-tokens" not in extra and "--output-len" not in extra:
            argv += ["--max-new-tokens", "1"]
        if "--prompt-len" not in extra and "--num-requests" not in extra:
            argv += ["--prompt-len", "1"]
        cases.append(Case(2, f"flag {name}", lambda d, a=argv: a, expect="refused_or_rejected", names=names,
                          sim=True))
    return cases


# -- class 3: --out -------------------------------------------------------------------------------------------------

_KEEP = "KEEP: an existing file that a failed command must not touch\n"


def _class3() -> list[Case]:
    cases = []
    plan = ["plan", "--model", "tiny-qwen3", "--hardware", "cpu-sim", "--serving", "sim"]

    def plan_out(target: Callable[[Path], str], names: tuple[str, ...], label: str) -> Case:
        return Case(3, f"plan --out {label}", lambda d: [*plan, "--out", target(d)], names=names)

    cases.append(plan_out(lambda d: str(d / "missing" / "plan.json"), ("--out", "missing"), "into a missing folder"))
    cases.append(plan_out(lambda d: str((d / "adir").mkdir() or d / "adir"), ("--out", "adir", "directory"),
                          "a directory"))
    cases.append(plan_out(lambda d: "x" * 300 + ".json", ("--out",), "a too-long file name"))
    cases.append(plan_out(lambda d: str(d / ("y" * 300) / "plan.json"), ("--out",), "in a too-long folder name"))

    shipped = {"model": ("models", "tiny-qwen3"), "hardware": ("hardware", "cpu-sim"), "serving": ("serving", "sim")}

    def plan_out_is_input(kind: str) -> Callable[[Path], list[str]]:
        def build(d: Path) -> list[str]:
            folder, name = shipped[kind]
            path = _write(d / f"{kind}.yaml", (CONFIGS / folder / f"{name}.yaml").read_text())
            flags = {f"--{k}": n for k, (_, n) in shipped.items()}
            flags[f"--{kind}"] = str(path)
            return ["plan", *[x for pair in flags.items() for x in pair], "--out", str(path)]

        return build

    for kind in shipped:
        cases.append(Case(3, f"plan --out equal to --{kind}", plan_out_is_input(kind), names=("--out", f"--{kind}")))

    def plan_out_same_file_other_spelling(d: Path) -> list[str]:
        path = _write(d / "m.yaml", (CONFIGS / "models" / "tiny-qwen3.yaml").read_text())
        (d / "sub").mkdir()
        return ["plan", "--model", str(path), "--hardware", "cpu-sim", "--serving", "sim",
                "--out", str(d / "sub" / ".." / "m.yaml")]

    cases.append(Case(3, "plan --out the model file by another spelling", plan_out_same_file_other_spelling,
                      names=("--out", "--model")))

    def plan_fails_keeps_out(d: Path) -> list[str]:
        out = _write(d / "plan.json", _KEEP)
        return ["plan", "--model", "tiny-qwen3", "--hardware", "cpu-sim", "--serving", "sim", "--max-batch", "0",
                "--out", str(out)]

    cases.append(Case(3, "plan failing keeps the existing --out", plan_fails_keeps_out, names=("max_batch",)))

    def plan_does_not_fit_keeps_out(d: Path) -> list[str]:
        out = _write(d / "plan.json", _KEEP)
        return ["plan", "--model", "qwen3-32b", "--hardware", "l40s", "--out", str(out)]

    cases.append(Case(3, "plan not fitting keeps the existing --out", plan_does_not_fit_keeps_out,
                      expect="fits_or_not", bad=False))

    run = [*_RUN, "--batch", "1", "--prompt-len", "1", "--max-new-tokens", "1"]

    def run_out(target: Callable[[Path], str], names: tuple[str, ...], label: str, more: Callable[[Path], list[str]]
                = lambda d: []) -> Case:
        return Case(3, f"run --out {label}", lambda d: [*run, *more(d), "--out", target(d)], names=names, sim=True)

    cases.append(run_out(lambda d: str(d / "missing" / "out.jsonl"), ("--out", "missing"), "into a missing folder"))
    cases.append(run_out(lambda d: str((d / "adir").mkdir() or d / "adir"), ("--out", "directory"), "a directory"))
    cases.append(run_out(lambda d: "z" * 300 + ".jsonl", ("--out",), "a too-long file name"))

    def requests_file(d: Path) -> Path:
        return _write(d / "requests.jsonl", '{"prompt_ids": [1]}\n')

    cases.append(Case(3, "run --out equal to --requests",
                      lambda d: [*_RUN, "--requests", str(requests_file(d)), "--max-new-tokens", "1",
                                 "--out", str(d / "requests.jsonl")], names=("--out", "--requests"), sim=True))
    cases.append(Case(3, "run --out equal to --prompt-ids",
                      lambda d: [*_RUN, "--prompt-ids", str(requests_file(d)), "--max-new-tokens", "1",
                                 "--out", str(d / "requests.jsonl")], names=("--out", "--prompt-ids"), sim=True))

    def run_out_is_plan(d: Path) -> list[str]:
        path = _write(d / "plan.json", json.dumps(_good_plan_json()))
        return ["run", "--plan", str(path), "--device", "sim", "--random-weights", "--batch", "1", "--prompt-len", "1",
                "--max-new-tokens", "1", "--out", str(path)]

    cases.append(Case(3, "run --out equal to --plan", run_out_is_plan, names=("--out", "--plan"), sim=True))

    def run_out_is_model(d: Path) -> list[str]:
        path = _write(d / "m.yaml", (CONFIGS / "models" / "tiny-qwen3.yaml").read_text())
        return ["run", "--model", str(path), *SIM, "--random-weights", "--batch", "1", "--prompt-len", "1",
                "--max-new-tokens", "1", "--out", str(path)]

    cases.append(Case(3, "run --out equal to --model", run_out_is_model, names=("--out", "--model"), sim=True))

    def run_fails_keeps_out(d: Path) -> list[str]:
        out = _write(d / "out.jsonl", _KEEP)
        return [*_RUN, "--requests", str(_write(d / "r.jsonl", "not json\n")), "--out", str(out)]

    cases.append(Case(3, "run with a bad request file keeps the existing --out", run_fails_keeps_out,
                      names=("r.jsonl", "line 1")))

    def run_bad_plan_keeps_out(d: Path) -> list[str]:
        out = _write(d / "out.jsonl", _KEEP)
        return ["run", "--plan", str(_write(d / "plan.json", "{}")), "--device", "sim", "--random-weights",
                "--out", str(out)]

    cases.append(Case(3, "run with a bad plan keeps the existing --out", run_bad_plan_keeps_out,
                      names=("plan.json",)))
    return cases


# -- class 4: readers -----------------------------------------------------------------------------------------------

#: (label, file name, bytes or a builder) of nasty files every reader gets.
def _nasty_files() -> list[tuple[str, Callable[[Path, str], Path], tuple[str, ...]]]:
    def content(data: bytes) -> Callable[[Path, str], Path]:
        return lambda d, name: _write(d / name, data)

    def directory(d: Path, name: str) -> Path:
        (d / name).mkdir()
        return d / name

    def sparse(d: Path, name: str) -> Path:
        path = d / name
        with open(path, "wb") as stream:
            stream.truncate(4 << 30)
        return path

    def fifo(d: Path, name: str) -> Path:
        os.mkfifo(d / name)
        return d / name

    def too_long(d: Path, name: str) -> Path:
        return d / ("n" * 300 + name)

    return [
        ("non-UTF-8 bytes", content(b"name: \xff\xfe tiny\n"), ("utf-8",)),
        ("binary", content(bytes(range(256)) * 4), ("utf-8|binary|control|NUL",)),
        ("empty", content(b""), ("empty|mapping",)),
        ("whitespace only", content(b"  \n\n"), ("empty|mapping",)),
        ("a directory", directory, ("directory",)),
        ("4 GiB sparse file", sparse, ("size|bytes|large",)),
        ("a FIFO", fifo, ("regular file|fifo",)),
        ("/dev/zero", lambda d, name: Path("/dev/zero"), ("regular file",)),
        ("a too-long name", too_long, ("name too long|too long",)),
    ]


def _nasty_yaml() -> list[tuple[str, bytes, tuple[str, ...]]]:
    return [
        ("root list", b"- 1\n- 2\n", ("mapping",)),
        ("root string", b"just a string\n", ("mapping",)),
        ("root null", b"null\n", ("mapping",)),
        ("root int", b"42\n", ("mapping",)),
        ("3000-deep flow list", b"a: " + b"[" * 3000 + b"]" * 3000 + b"\n", ("nest",)),
        ("3000-deep flow mapping", b"a: " + b"{b: " * 3000 + b"1" + b"}" * 3000 + b"\n", ("nest",)),
        ("recursive alias", b"a: &x [*x]\n", ("nest|alias|recursive",)),
        ("alias bomb", b"a: &a [1,1,1,1,1,1,1,1,1]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\n"
                       b"c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\nd: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]\n"
                       b"e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]\nf: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]\n"
                       b"g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]\nh: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]\n"
                       b"i: [*h,*h,*h,*h,*h,*h,*h,*h,*h]\n", ("alias|nodes|large",)),
        ("malformed", b"a: [1, 2\n", ("malformed|yaml",)),
        ("a tab indent", b"a:\n\tb: 1\n", ("malformed|yaml",)),
        ("a 5000-digit int", b"a: " + b"9" * 5000 + b"\n", ("digits|a",)),
        ("a NUL byte", b"a: 1\x00\n", ("NUL|control|yaml|character",)),
    ]


def _nasty_json() -> list[tuple[str, bytes, tuple[str, ...]]]:
    return [
        ("root list", b"[1, 2]", ("mapping|object",)),
        ("root string", b'"x"', ("mapping|object",)),
        ("root null", b"null", ("mapping|object",)),
        ("root number", b"3.5", ("mapping|object",)),
        ("100000-deep list", b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", ("nest",)),
        ("100000-deep object", b'{"a": ' + b'{"b": ' * 100_000 + b"1" + b"}" * 100_000 + b"}", ("nest",)),
        ("malformed", b'{"a": [1, 2}', ("malformed|json",)),
        ("a 5000-digit int", b'{"a": ' + b"9" * 5000 + b"}", ("digits|a",)),
        ("a NaN literal", b'{"a": NaN}', ("a", "finite|nan")),
        ("trailing garbage", b'{"a": 1} x', ("malformed|json",)),
    ]


def _reader_targets() -> list[tuple[str, str, Callable[[Path, Path], list[str]], bool]]:
    """(label, file suffix, argv given the nasty file, uses the simulator)."""
    plan = ["plan", "--hardware", "cpu-sim", "--serving", "sim"]
    return [
        ("--model yaml", ".yaml", lambda d, p: [*plan, "--model", str(p)], False),
        ("--hardware yaml", ".yaml",
         lambda d, p: ["plan", "--model", "tiny-qwen3", "--serving", "sim", "--hardware", str(p)], False),
        ("--serving yaml", ".yaml",
         lambda d, p: ["plan", "--model", "tiny-qwen3", "--hardware", "cpu-sim", "--serving", str(p)], False),
        ("--model config.json", ".json", lambda d, p: [*plan, "--model", str(p)], False),
        ("validate json", ".json", lambda d, p: ["validate", str(p)], False),
        ("validate yaml", ".yaml", lambda d, p: ["validate", str(p)], False),
        ("run --plan", ".json", lambda d, p: ["run", "--plan", str(p), "--device", "sim", "--random-weights"], True),
        ("run --requests", ".jsonl", lambda d, p: [*_RUN, "--requests", str(p)], True),
        ("run --prompt-ids", ".jsonl", lambda d, p: [*_RUN, "--prompt-ids", str(p)], True),
    ]


def _class4() -> list[Case]:
    cases = []
    for target, suffix, argv, sim in _reader_targets():
        for label, make, names in _nasty_files():
            if target.startswith("validate") and label == "a too-long name":
                names = ("name too long|too long",)
            name = f"file{suffix}"

            def build(d: Path, make=make, name=name, argv=argv) -> list[str]:
                return argv(d, make(d, name))

            if suffix == ".jsonl" and label in ("empty", "whitespace only"):
                names = ("no requests|no prompts|empty",)
            cases.append(Case(4, f"{target}: {label}", build, names=names, sim=sim,
                              timeout_s=BLOCKING_TIMEOUT_S if label == "a FIFO" else None))
        nasty = _nasty_json() if suffix in (".json", ".jsonl") else _nasty_yaml()
        for label, data, names in nasty:
            if suffix == ".jsonl":
                names = ("line 1",) + tuple(n for n in names if n not in ("mapping|object", "a", "digits|a"))
            cases.append(Case(4, f"{target}: {label}",
                              lambda d, data=data, argv=argv, suffix=suffix: argv(d, _write(d / f"file{suffix}", data)),
                              names=names, sim=sim))
        bom = b"\xef\xbb\xbf"
        good = {"--model yaml": (CONFIGS / "models/tiny-qwen3.yaml").read_bytes(),
                "--hardware yaml": (CONFIGS / "hardware/cpu-sim.yaml").read_bytes(),
                "--serving yaml": (CONFIGS / "serving/sim.yaml").read_bytes(),
                "--model config.json": json.dumps(_hf_qwen3()).encode()}.get(target)
        if good is not None:
            cases.append(Case(4, f"{target}: a UTF-8 BOM", lambda d, g=good, argv=argv, suffix=suffix:
                              argv(d, _write(d / f"config{suffix}", bom + g)), expect="ok_or_refused",
                              names=("bom|utf-8",), bad=False))

    def validate_dir(d: Path) -> list[str]:
        folder = d / "configs"
        _write(folder / "ok.yaml", (CONFIGS / "serving/sim.yaml").read_text())
        _write(folder / "binary.yaml", bytes(range(256)))
        _write(folder / "nonutf8.json", b'{"a": "\xff"}')
        return ["validate", str(folder)]

    cases.append(Case(4, "validate DIR with a binary file", validate_dir, names=("binary.yaml",)))

    def validate_dir_fifo(d: Path) -> list[str]:
        folder = d / "configs"
        _write(folder / "ok.yaml", (CONFIGS / "serving/sim.yaml").read_text())
        os.mkfifo(folder / "pipe.yaml")
        return ["validate", str(folder)]

    cases.append(Case(4, "validate DIR with a FIFO", validate_dir_fifo, names=("pipe.yaml",),
                      timeout_s=BLOCKING_TIMEOUT_S))

    hf_edits: list[tuple[str, Callable[[], Any], tuple[str, ...]]] = [
        ("rope_parameters a list", lambda: {**_hf_qwen3(), "rope_parameters": [1, 2]}, ("rope_parameters",)),
        ("rope_parameters a string", lambda: {**_hf_qwen3(), "rope_parameters": "default"}, ("rope_parameters",)),
        ("rope_parameters a number", lambda: {**_hf_qwen3(), "rope_parameters": 5}, ("rope_parameters",)),
        ("rope_theta a string", lambda: {**_hf_qwen3(), "rope_parameters": {"rope_theta": "big"}}, ("rope_theta",)),
        ("rope_theta negative", lambda: {**_hf_qwen3(), "rope_parameters": {"rope_theta": -1}}, ("rope_theta",)),
        ("qwen3.5 full_attention_interval 0", lambda: _no_layer_types(0), ("full_attention_interval",)),
        ("qwen3.5 full_attention_interval '4'", lambda: _no_layer_types("4"), ("full_attention_interval",)),
        ("qwen3.5 full_attention_interval -1", lambda: _no_layer_types(-1), ("full_attention_interval",)),
        ("qwen3.5 full_attention_interval 2.5", lambda: _no_layer_types(2.5), ("full_attention_interval",)),
        ("qwen3.5 full_attention_interval true", lambda: _no_layer_types(True), ("full_attention_interval",)),
        ("qwen3.5 num_hidden_layers '2' without layer_types",
         lambda: {**_no_layer_types(2), "num_hidden_layers": "2"}, ("num_hidden_layers|num_layers",)),
        ("qwen3.5 layer_types a string", lambda: {**_hf_qwen3_5(), "layer_types": "full_attention"},
         ("layer_types",)),
        ("qwen3.5 layer_types [1, 2]", lambda: {**_hf_qwen3_5(), "layer_types": [1, 2]}, ("layer_types",)),
        ("qwen3_5 text_config a string", lambda: {"model_type": "qwen3_5", "text_config": "x"}, ("text_config",)),
        ("qwen3_5 text_config a list", lambda: {"model_type": "qwen3_5", "text_config": [1]}, ("text_config",)),
        ("qwen3_5 text_config deep", lambda: {"model_type": "qwen3_5", "text_config": {"model_type": "qwen3_5"}},
         ("head_dim",)),
        ("model_type a list", lambda: {**_hf_qwen3(), "model_type": ["qwen3"]}, ("model_type",)),
        ("model_type missing", lambda: {k: v for k, v in _hf_qwen3().items() if k != "model_type"},
         ("model_type|architecture",)),
        ("head_dim a string", lambda: {**_hf_qwen3(), "head_dim": "16"}, ("head_dim",)),
        ("torch_dtype int8", lambda: {**_hf_qwen3(), "torch_dtype": "int8"}, ("dtype",)),
        ("hidden_act a list", lambda: {**_hf_qwen3(), "hidden_act": ["silu"]}, ("hidden_act",)),
        ("num_key_value_heads null", lambda: {**_hf_qwen3(), "num_key_value_heads": None}, ("num_key_value_heads",)),
    ]
    for label, data, names in hf_edits:
        cases.append(Case(4, f"config.json {label}",
                          lambda d, data=data: ["plan", "--model", str(_write(d / "ckpt" / "config.json",
                                                                               json.dumps(data()))),
                                                "--hardware", "cpu-sim", "--serving", "sim"],
                          names=names))
        cases.append(Case(4, f"validate config.json {label}",
                          lambda d, data=data: ["validate", str(_write(d / "ckpt" / "config.json",
                                                                       json.dumps(data())))], names=names))

    serving_plus_flag = [
        ("a list", "- 1\n", ("mapping",)),
        ("decode_graph_batch_sizes a string", "decode_graph_batch_sizes: x\n", ("decode_graph_batch_sizes",)),
        ("decode_graph_batch_sizes [1, a]", "decode_graph_batch_sizes: [1, a]\n", ("decode_graph_batch_sizes",)),
        ("decode_graph_batch_sizes null", "decode_graph_batch_sizes: null\n", ("decode_graph_batch_sizes",)),
        ("decode_graph_batch_sizes a mapping", "decode_graph_batch_sizes: {a: 1}\n", ("decode_graph_batch_sizes",)),
        ("max_batch a string", "max_batch: lots\n", ("max_batch",)),
    ]
    for label, text, names in serving_plus_flag:
        cases.append(Case(4, f"serving file {label} + --max-batch 2",
                          lambda d, text=text: ["plan", "--model", "tiny-qwen3", "--hardware", "cpu-sim",
                                                "--serving", str(_write(d / "serving.yaml", text)), "--max-batch", "2"],
                          names=("serving.yaml",) + names))
    return cases


def _no_layer_types(interval: Any) -> dict[str, Any]:
    data = {k: v for k, v in _hf_qwen3_5().items() if k != "layer_types"}
    return {**data, "full_attention_interval": interval}


# -- class 5: checkpoints -------------------------------------------------------------------------------------------


def _class5() -> list[Case]:
    run = ["run", *SIM, "--batch", "1", "--prompt-len", "1", "--max-new-tokens", "1"]

    def corrupt(edit: Callable[[Path], None], names: tuple[str, ...], label: str, timeout_s: int | None = None) -> Case:
        def build(d: Path) -> list[str]:
            folder = _checkpoint(d / "ckpt")
            edit(folder)
            return [*run, "--checkpoint", str(folder)]

        return Case(5, f"checkpoint {label}", build, names=names, sim=True, timeout_s=timeout_s)

    def shard(folder: Path) -> Path:
        return next(folder.glob("*.safetensors"))

    def truncate_to(size: Callable[[int], int]) -> Callable[[Path], None]:
        def edit(folder: Path) -> None:
            path = shard(folder)
            data = path.read_bytes()
            path.write_bytes(data[: size(len(data))])

        return edit

    def header_of(folder: Path) -> tuple[Path, dict[str, Any], bytes]:
        path = shard(folder)
        raw = path.read_bytes()
        (length,) = struct.unpack("<Q", raw[:8])
        return path, json.loads(raw[8 : 8 + length]), raw[8 + length :]

    def rewrite_header(change: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
        def edit(folder: Path) -> None:
            path, header, data = header_of(folder)
            change(header)
            path.write_bytes(_safetensors_bytes(header, data))

        return edit

    def first_tensor(header: dict[str, Any]) -> dict[str, Any]:
        return header[sorted(k for k in header if k != "__metadata__")[0]]

    def set_offsets(header: dict[str, Any]) -> None:
        first_tensor(header)["data_offsets"] = [0, 10**12]

    def negative_shape(header: dict[str, Any]) -> None:
        first_tensor(header)["shape"] = [-1, 4]

    def unknown_dtype(header: dict[str, Any]) -> None:
        first_tensor(header)["dtype"] = "X99"

    def wrong_size(header: dict[str, Any]) -> None:
        entry = first_tensor(header)
        entry["shape"] = [entry["shape"][0] * 2] + entry["shape"][1:]

    def overlap(header: dict[str, Any]) -> None:
        keys = sorted(k for k in header if k != "__metadata__")
        header[keys[1]]["data_offsets"] = list(header[keys[0]]["data_offsets"])
        header[keys[1]]["shape"] = list(header[keys[0]]["shape"])

    cases = [
        corrupt(truncate_to(lambda n: n - 100), ("safetensors", "truncat|bytes|size"), "truncated in the data"),
        corrupt(truncate_to(lambda n: 40), ("safetensors", "header"), "truncated in the header"),
        corrupt(truncate_to(lambda n: 7), ("safetensors", "8 bytes|header"), "of 7 bytes"),
        corrupt(truncate_to(lambda n: 0), ("safetensors", "empty|8 bytes"), "empty"),
        corrupt(lambda f: shard(f).write_bytes(struct.pack("<Q", 10**9) + b"{}"), ("safetensors", "header"),
                "header length past the end"),
        corrupt(lambda f: shard(f).write_bytes(_safetensors_bytes(b"{not json")), ("safetensors", "header", "json"),
                "header not JSON"),
        corrupt(lambda f: shard(f).write_bytes(_safetensors_bytes(b"[1, 2]")), ("safetensors", "header"),
                "header a list"),
        corrupt(lambda f: shard(f).write_bytes(_safetensors_bytes(b'{"a": "\xff"}')), ("safetensors", "utf-8"),
                "header not UTF-8"),
        corrupt(lambda f: shard(f).write_bytes(_safetensors_bytes(b'{"a": ' + b"[" * 100_000 + b"]" * 100_000
                                                                  + b"}")),
                ("safetensors", "header"), "header nested 100000 deep"),
        corrupt(rewrite_header(set_offsets), ("safetensors", "data_offsets|offset"), "data_offsets past the end"),
        corrupt(rewrite_header(negative_shape), ("safetensors", "shape"), "a negative shape"),
        corrupt(rewrite_header(unknown_dtype), ("safetensors", "dtype"), "an unknown dtype"),
        corrupt(rewrite_header(wrong_size), ("safetensors", "shape|bytes"), "shape not matching its bytes"),
        corrupt(rewrite_header(overlap), ("safetensors", "overlap|offset|data_offsets"), "two tensors on one range"),
    ]

    def directory_shard(folder: Path) -> None:
        path = shard(folder)
        path.unlink()
        path.mkdir()

    cases.append(corrupt(directory_shard, ("safetensors", "directory|regular file"), "a directory named *.safetensors"))

    def fifo_shard(folder: Path) -> None:
        path = shard(folder)
        path.unlink()
        os.mkfifo(path)

    cases.append(corrupt(fifo_shard, ("safetensors", "regular file"), "a FIFO named *.safetensors",
                         timeout_s=BLOCKING_TIMEOUT_S))

    def typed(dtype: str, names: tuple[str, ...]) -> Case:
        def build(d: Path) -> list[str]:
            import numpy as np

            tensors = _planned_tensors()
            name = "model.layers.0.mlp.down_proj.weight"
            tensors[name] = np.ones(tensors[name].shape, dtype=dtype)
            return [*run, "--checkpoint", str(_checkpoint(d / "ckpt", tensors))]

        return Case(5, f"checkpoint with a {dtype} tensor", build, names=names, sim=True)

    for dtype in ("int64", "bool", "int32", "uint8", "int8"):
        cases.append(typed(dtype, ("down_proj", "dtype")))

    def two_shards(d: Path) -> list[str]:
        tensors = _planned_tensors()
        folder = _checkpoint(d / "ckpt", tensors, shards=2)
        from safetensors.numpy import save_file

        extra = "model.embed_tokens.weight"
        save_file({extra: tensors[extra] * 2}, str(folder / "model-extra.safetensors"))
        return [*run, "--checkpoint", str(folder)]

    cases.append(Case(5, "checkpoint with a tensor in two shards", two_shards,
                      names=("model.embed_tokens.weight", "safetensors"), sim=True))
    cases.append(Case(5, "checkpoint folder without safetensors",
                      lambda d: [*run, "--checkpoint", str(_write(d / "ckpt" / "config.json",
                                                                  json.dumps(_hf_qwen3())).parent)],
                      names=("ckpt", "safetensors"), sim=True))
    cases.append(Case(5, "--checkpoint a file",
                      lambda d: [*run, "--checkpoint", str(next(_checkpoint(d / "ckpt").glob("*.safetensors")))],
                      names=("--checkpoint|safetensors", "directory|config.json|utf-8"), sim=True))
    cases.append(Case(5, "--checkpoint missing", lambda d: [*run, "--checkpoint", str(d / "nope")],
                      names=("nope",), sim=True))

    def nonutf8_config(d: Path) -> list[str]:
        folder = _checkpoint(d / "ckpt")
        _write(folder / "config.json", b'{"model_type": "\xff"}')
        return [*run, "--checkpoint", str(folder)]

    cases.append(Case(5, "checkpoint config.json not UTF-8", nonutf8_config, names=("config.json", "utf-8"),
                      sim=True))
    return cases


# -- class 6: values accepted that should not be --------------------------------------------------------------------


def _class6() -> list[Case]:
    plan = ["plan", "--hardware", "cpu-sim", "--serving", "sim"]

    def model_yaml(text: str) -> Callable[[Path], list[str]]:
        return lambda d: [*plan, "--model", str(_write(d / "model.yaml", text))]

    base_model = (CONFIGS / "models/tiny-qwen3.yaml").read_text()
    base_hw = (CONFIGS / "hardware/cpu-sim.yaml").read_text()
    base_serving = (CONFIGS / "serving/sim.yaml").read_text()
    cases = [
        Case(6, "config.json rope_theta 1e999",
             lambda d: [*plan, "--model", str(_write(d / "ckpt" / "config.json", json.dumps(_hf_qwen3()).replace(
                 '"rope_theta": 1000000.0', '"rope_theta": 1e999')))], names=("rope_theta",)),
        Case(6, "config.json rope_theta Infinity",
             lambda d: [*plan, "--model", str(_write(d / "ckpt" / "config.json", json.dumps(_hf_qwen3()).replace(
                 '"rope_theta": 1000000.0', '"rope_theta": Infinity')))], names=("rope_theta",)),
        Case(6, "config.json top-level rope_theta NaN",
             lambda d: [*plan, "--model", str(_write(d / "ckpt" / "config.json", json.dumps(
                 {**{k: v for k, v in _hf_qwen3().items() if k != "rope_parameters"}, "rope_theta": float("nan")})))],
             names=("rope_theta",)),
        Case(6, "model yaml rope_theta .inf",
             model_yaml(base_model.replace("rope_theta: 1000000.0", "rope_theta: .inf")),
             names=("rope_theta",)),
        Case(6, "model yaml rms_norm_eps .nan",
             model_yaml(base_model.replace("rms_norm_eps: 1.0e-06", "rms_norm_eps: .nan")), names=("rms_norm_eps",)),
        Case(6, "model yaml partial_rotary_factor .nan",
             model_yaml(base_model.replace("partial_rotary_factor: 1.0", "partial_rotary_factor: .nan")),
             names=("partial_rotary_factor",)),
        Case(6, "--gpu-memory-utilization nan", lambda d: ["plan", "--model", "tiny-qwen3", "--hardware", "cpu-sim",
                                                           "--serving", "sim", "--gpu-memory-utilization", "nan"],
             names=("gpu_memory_utilization",)),
        Case(6, "--gpu-memory-utilization inf", lambda d: ["plan", "--model", "tiny-qwen3", "--hardware", "cpu-sim",
                                                           "--serving", "sim", "--gpu-memory-utilization", "inf"],
             names=("gpu_memory_utilization",)),
        Case(6, "serving yaml gpu_memory_utilization .nan",
             lambda d: ["plan", "--model", "tiny-qwen3", "--hardware", "cpu-sim", "--serving",
                        str(_write(d / "s.yaml", base_serving.replace("gpu_memory_utilization: 0.9",
                                                                      "gpu_memory_utilization: .nan")))],
             names=("gpu_memory_utilization",)),
        Case(6, "model yaml duplicate key", model_yaml(base_model + "num_layers: 3\n"),
             names=("model.yaml", "num_layers", "duplicate")),
        Case(6, "model yaml duplicate nested key",
             model_yaml((CONFIGS / "models/tiny-qwen3.5.yaml").read_text() + "  num_key_heads: 4\n"),
             names=("model.yaml", "num_key_heads", "duplicate")),
        Case(6, "hardware yaml duplicate key",
             lambda d: ["plan", "--model", "tiny-qwen3", "--serving", "sim", "--hardware",
                        str(_write(d / "hw.yaml", base_hw + "num_sms: 2\n"))],
             names=("hw.yaml", "num_sms", "duplicate")),
        Case(6, "serving yaml duplicate key",
             lambda d: ["plan", "--model", "tiny-qwen3", "--hardware", "cpu-sim", "--serving",
                        str(_write(d / "s.yaml", base_serving + "max_batch: 2\n"))],
             names=("s.yaml", "max_batch", "duplicate")),
        Case(6, "config.json duplicate key",
             lambda d: [*plan, "--model", str(_write(d / "ckpt" / "config.json",
                                                     json.dumps(_hf_qwen3())[:-1] + ', "num_hidden_layers": 3}'))],
             names=("config.json", "num_hidden_layers", "duplicate")),
        Case(6, "plan json duplicate key",
             lambda d: ["validate", str(_write(d / "plan.json", json.dumps(_good_plan_json())[:-1]
                                               + ', "schema_version": 1}'))],
             names=("plan.json", "schema_version", "duplicate")),
        Case(6, "run --plan json duplicate key",
             lambda d: ["run", "--plan", str(_write(d / "plan.json", json.dumps(_good_plan_json())[:-1]
                                                    + ', "schema_version": 1}')), "--device", "sim",
                        "--random-weights"],
             names=("plan.json", "schema_version", "duplicate"), sim=True),
        Case(6, "--model with a newline", lambda d: [*plan, "--model", "tiny\nqwen3"], names=("tiny",)),
        Case(6, "--hardware with a newline",
             lambda d: ["plan", "--model", "tiny-qwen3", "--serving", "sim", "--hardware", "cpu\nsim"], names=("cpu",)),
        Case(6, "--dtype with a newline",
             lambda d: [*plan, "--model", "tiny-qwen3", "--dtype", "bfloat16\nx"], names=("dtype",)),
        Case(6, "model name with a newline in an error",
             model_yaml(base_model.replace("name: tiny-qwen3", 'name: "tiny\\nqwen3"').replace(
                 "head_dim: 16", "head_dim: 15")), names=("model.yaml",)),
        Case(6, "model name with a newline planned",
             lambda d: ["plan", "--model", str(_write(d / "model.yaml", base_model.replace(
                 "name: tiny-qwen3", 'name: "tiny\\nqwen3"'))), "--hardware", "cpu-sim", "--serving", "sim",
                        "--format", "table"], expect="ok_or_refused", names=("name",), bad=False),
        Case(6, "hardware name with a newline",
             lambda d: ["plan", "--model", "tiny-qwen3", "--serving", "sim", "--hardware",
                        str(_write(d / "hw.yaml", base_hw.replace("name: cpu-sim", 'name: "cpu\\nsim"')))],
             expect="ok_or_refused", names=("name",), bad=False),
    ]
    return cases


# -- class 7: messages that name nothing ----------------------------------------------------------------------------


def _class7() -> list[Case]:
    base_model = (CONFIGS / "models/tiny-qwen3.yaml").read_text()
    base_hw = (CONFIGS / "hardware/cpu-sim.yaml").read_text()
    base_serving = (CONFIGS / "serving/sim.yaml").read_text()

    def plan_with(kind: str, text: str) -> Callable[[Path], list[str]]:
        def build(d: Path) -> list[str]:
            path = _write(d / f"{kind}.yaml", text)
            argv = {"--model": "tiny-qwen3", "--hardware": "cpu-sim", "--serving": "sim"}
            argv[f"--{kind}"] = str(path)
            return ["plan", *[x for pair in argv.items() for x in pair]]

        return build

    cases = [
        Case(7, "model name a YAML date",
             plan_with("model", base_model.replace("name: tiny-qwen3", "name: 2024-01-01")),
             names=("model.yaml", "name", "date")),
        Case(7, "model hidden_size a YAML date",
             plan_with("model", base_model.replace("hidden_size: 64", "hidden_size: 2024-01-01")),
             names=("model.yaml", "hidden_size")),
        Case(7, "model name a YAML timestamp",
             plan_with("model", base_model.replace("name: tiny-qwen3", "name: 2001-12-14t21:59:43.10-05:00")),
             names=("model.yaml", "name")),
        Case(7, "hardware name a YAML date",
             plan_with("hardware", base_hw.replace("name: cpu-sim", "name: 2020-02-02")),
             names=("hardware.yaml", "name")),
        Case(7, "hardware cuda_graph_bytes a date",
             plan_with("hardware", base_hw.replace("cuda_graph_bytes: 0", "cuda_graph_bytes: 2020-02-02")),
             names=("hardware.yaml", "cuda_graph_bytes", "date")),
        Case(7, "hardware runtime line bytes a date",
             plan_with("hardware", base_hw.replace("  bytes: 0", "  bytes: 2020-02-02", 1)),
             names=("hardware.yaml", "runtime_reserve[0].bytes", "date")),
        Case(7, "serving buckets a !!set",
             plan_with("serving", base_serving.replace("decode_graph_batch_sizes: [1, 2, 4]",
                                                       "decode_graph_batch_sizes: !!set {1, 2, 4}")),
             names=("serving.yaml", "decode_graph_batch_sizes")),
        Case(7, "serving dtype a !!binary",
             plan_with("serving", base_serving.replace("dtype: auto\n", "dtype: !!binary aGVsbG8=\n", 1)),
             names=("serving.yaml", "dtype")),
        Case(7, "model yaml integer key", plan_with("model", base_model + "1: one\n"), names=("model.yaml", "1")),
        Case(7, "model yaml null key", plan_with("model", base_model + "~: nothing\n"), names=("model.yaml",)),
        Case(7, "model yaml complex key", plan_with("model", base_model + "? [a, b]\n: c\n"), names=("model.yaml",)),
        Case(7, "serving yaml bool key", plan_with("serving", base_serving + "yes: 1\n"), names=("serving.yaml",)),
        Case(7, "model yaml a python tag", plan_with("model", base_model + "x: !!python/object:os.system ls\n"),
             names=("model.yaml",)),
    ]

    def hardware_of(size: int) -> Callable[[Path], list[str]]:
        return plan_with("hardware", base_hw.replace("device_memory_bytes: 67108864", f"device_memory_bytes: {size}"))

    cases.append(Case(7, "16 TiB hardware, tiny model", hardware_of(1 << 44), expect="refused",
                      names=("hardware.yaml", "kv pages|kv_pages")))
    cases.append(Case(7, "8 TiB hardware, tiny model", hardware_of(1 << 43), expect="refused",
                      names=("hardware.yaml", "kv pages|kv_pages")))
    cases.append(Case(7, "16 TiB hardware, qwen3-8b",
                      lambda d: ["plan", "--model", "qwen3-8b", "--hardware",
                                 str(_write(d / "hardware.yaml", base_hw.replace("device_memory_bytes: 67108864",
                                                                                 f"device_memory_bytes: {1 << 44}")))],
                      expect="fits_or_not", bad=False))

    def plan_edit(change: Callable[[dict[str, Any]], None]) -> Callable[[Path], list[str]]:
        def build(d: Path) -> list[str]:
            data = _good_plan_json()
            change(data)
            return ["validate", str(_write(d / "plan.json", json.dumps(data)))]

        return build

    def heads(data: dict[str, Any]) -> None:
        data["model"]["num_key_value_heads"] = 3

    def geometry_heads(data: dict[str, Any]) -> None:
        data["model"]["num_attention_heads"] = 6

    def schema_version(data: dict[str, Any]) -> None:
        data["schema_version"] = 2

    def no_pools(data: dict[str, Any]) -> None:
        del data["pools"]

    def page_size_zero(data: dict[str, Any]) -> None:
        data["serving"]["page_size"] = 0

    def context_over(data: dict[str, Any]) -> None:
        data["serving"]["max_context"] = 10**6

    def buffer_bytes(data: dict[str, Any]) -> None:
        data["pools"][0]["buffers"][0]["bytes"] = -1

    cases += [
        Case(7, "validate plan with an inconsistent head count", plan_edit(heads),
             names=("plan.json", "num_key_value_heads|num_attention_heads")),
        Case(7, "validate plan with 6 heads over 2 kv heads", plan_edit(geometry_heads),
             names=("plan.json", "num_attention_heads|geometry|differs")),
        Case(7, "validate plan schema_version 2", plan_edit(schema_version), names=("plan.json", "schema_version")),
        Case(7, "validate plan without pools", plan_edit(no_pools), names=("plan.json", "pools")),
        Case(7, "validate plan page_size 0", plan_edit(page_size_zero), names=("plan.json", "page_size")),
        Case(7, "validate plan max_context over the model", plan_edit(context_over),
             names=("plan.json", "max_context")),
        Case(7, "validate plan buffer bytes -1", plan_edit(buffer_bytes), names=("plan.json", "bytes")),
    ]

    def run_plan_edit(change: Callable[[dict[str, Any]], None]) -> Callable[[Path], list[str]]:
        def build(d: Path) -> list[str]:
            data = _good_plan_json()
            change(data)
            return ["run", "--plan", str(_write(d / "plan.json", json.dumps(data))), "--device", "sim",
                    "--random-weights"]

        return build

    cases += [
        Case(7, "run --plan with an inconsistent head count", run_plan_edit(heads),
             names=("plan.json", "num_key_value_heads|num_attention_heads"), sim=True),
        Case(7, "run --plan max_context over the model", run_plan_edit(context_over),
             names=("plan.json", "max_context"), sim=True),
    ]

    def cd_validate(d: Path) -> list[str]:
        _write(d / "ckpt" / "config.json", json.dumps(_hf_qwen3()))
        return ["validate", "config.json"]

    cases.append(Case(7, "cd DIR && validate config.json", cd_validate, expect="ok", cwd="ckpt"))

    def cd_plan(d: Path) -> list[str]:
        _write(d / "ckpt" / "config.json", json.dumps(_hf_qwen3()))
        return ["plan", "--model", "config.json", "--hardware", "cpu-sim", "--serving", "sim"]

    cases.append(Case(7, "cd DIR && plan --model config.json", cd_plan, expect="ok", cwd="ckpt", bad=False))
    cases.append(Case(7, "validate a missing path", lambda d: ["validate", str(d / "nope.yaml")],
                      names=("nope.yaml",)))
    return cases


def cases() -> list[Case]:
    return [*_class1(), *_class2(), *_class3(), *_class4(), *_class5(), *_class6(), *_class7()]


# -- running --------------------------------------------------------------------------------------------------------


def _snapshot(folder: Path) -> dict[str, str]:
    state = {}
    for path in sorted(folder.rglob("*")):
        if path.is_fifo():
            state[str(path)] = "fifo"
        elif path.is_file():
            size = path.stat().st_size
            state[str(path)] = f"big:{size}" if size > 1 << 26 else hashlib.sha256(path.read_bytes()).hexdigest()
        elif path.is_dir():
            state[str(path)] = "dir"
    return state


def _matches(text: str, names: tuple[str, ...]) -> bool:
    lowered = text.lower()
    return all(any(option.lower() in lowered for option in name.split("|")) for name in names)


def _output_lines(stdout: str, folder: Path, argv: list[str]) -> list[dict[str, Any]] | None:
    text = stdout
    if "--out" in argv:
        out = Path(argv[argv.index("--out") + 1])
        text = out.read_text() if out.is_file() else ""
    try:
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    except ValueError:
        return None


def _on_alarm(signum: int, frame: Any) -> None:
    raise _Timeout()


def _fifo_watchdog(folder: Path, after_s: int) -> subprocess.Popen | None:
    """For a case with FIFOs: a process that, after ``after_s``, opens each for writing and closes it, so a
    reader blocked in open() (in native code that holds the GIL, where no signal or thread gets through)
    reads EOF. It exits then; it is still running when nothing blocked."""
    fifos = [str(path) for path in folder.rglob("*") if path.is_fifo()]
    if not fifos:
        return None
    script = 'sleep "$0"; for f in "$@"; do timeout 1 sh -c \': > "$0"\' "$f"; done'
    return subprocess.Popen(["sh", "-c", script, str(after_s), *fifos])


def run_case(case: Case, folder: Path, timeout_s: int = CASE_TIMEOUT_S) -> Outcome:
    """Build ``case`` in ``folder`` (empty), run it through ``planner.cli.main`` and judge the result."""
    from planner.cli import main

    argv = case.build(folder)
    before = _snapshot(folder)
    stdout, stderr = io.StringIO(), io.StringIO()
    cwd = os.getcwd()
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    signal.alarm(timeout_s)
    watchdog = _fifo_watchdog(folder, timeout_s + 1)
    try:
        if case.cwd:
            os.chdir(folder / case.cwd)
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                code = main(argv)
            except SystemExit as exit_:
                code = exit_.code if isinstance(exit_.code, int) else 2
    except _Timeout:
        return Outcome("hang", f"ran past {timeout_s} s")
    except BaseException as error:  # noqa: BLE001 - the corpus records every escape
        return Outcome("traceback", f"{type(error).__name__}: {str(error)[:160]}")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        os.chdir(cwd)
        if watchdog is not None:
            fired = watchdog.poll() is not None
            watchdog.kill()
            watchdog.wait()
    if watchdog is not None and fired:
        return Outcome("hang", f"blocked past {timeout_s} s in a read of a FIFO")
    return judge(case, code, stdout.getvalue(), stderr.getvalue(), before, _snapshot(folder), folder, argv)


def judge(case: Case, code: int, out: str, err: str, before: dict[str, str], after: dict[str, str], folder: Path,
          argv: list[str]) -> Outcome:
    message = err.strip()
    changed = sorted(set(before.items()) ^ set(after.items()))
    if code not in (0, 2, 3):
        return Outcome("traceback", f"exit {code}: {message[-160:]}", code)
    if code in (2, 3) and changed:
        return Outcome("lost", f"files changed on failure: {sorted({path for path, _ in changed})[:3]}", code)
    if case.expect == "fits_or_not":
        return Outcome("ok", code=code) if code in (0, 3) else Outcome("accepted" if code == 0 else "unclear",
                                                                        message[:160], code)
    if case.expect in ("ok", "runs"):
        if code != 0:
            return Outcome("unclear", f"refused a good input: {message[:160]}", code)
        lines = _output_lines(out, folder, argv) if case.expect == "runs" else []
        rejected = [line for line in lines or [] if line.get("finish_reason") == "rejected"]
        if lines is None or rejected:
            return Outcome("unclear", f"rejected a good request: {rejected[:1]}", code)
        return Outcome("ok", code=code)
    if code == 3:
        return Outcome("unclear", f"does not fit instead of bad input: {message[:160]}", code)
    if code == 2:
        if case.expect == "rejected":
            return Outcome("unclear", f"exit 2 instead of a rejected line: {message[:160]}", code)
        lines = message.splitlines()
        if argv[0] == "validate":  # one line per problem, each naming its file
            lines = lines[:1]
        if len(lines) != 1:
            return Outcome("unclear", f"{len(message.splitlines())} lines: {message[:160]!r}", code)
        if not _matches(message, case.names):
            return Outcome("unclear", f"names none of {case.names}: {message[:200]}", code)
        return Outcome("ok", code=code)
    # exit 0
    if case.expect == "ok_or_refused":
        return Outcome("ok", code=code)
    if case.expect in ("rejected", "refused_or_rejected"):
        lines = _output_lines(out, folder, argv)
        if not lines:
            return Outcome("accepted", "exit 0 and no output lines", code)
        bad = [line for line in lines if line.get("finish_reason") != "rejected"]
        if bad:
            return Outcome("accepted", f"a bad request ran: {json.dumps(bad[0])[:160]}", code)
        unnamed = [line for line in lines if not _matches(str(line.get("error", "")), case.names)]
        if unnamed:
            return Outcome("unclear", f"rejected line names none of {case.names}: {unnamed[0].get('error')!r}", code)
        return Outcome("ok", code=code)
    return Outcome("accepted", f"exit 0: {out.strip()[:80]!r} {message[-80:]!r}", code)


def limit_memory(extra_bytes: int = 4 << 30) -> None:
    """Cap this process's address space at its current size plus ``extra_bytes`` (unbounded reads fail fast)."""
    with open("/proc/self/statm") as stream:
        pages = int(stream.read().split()[0])
    limit = pages * os.sysconf("SC_PAGE_SIZE") + extra_bytes
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))


def run_corpus(selected: list[Case], verbose: bool = False) -> dict[int, Counter]:
    counts: dict[int, Counter] = {}
    with tempfile.TemporaryDirectory(prefix="memplan-corpus-") as root:
        for index, case in enumerate(selected):
            folder = Path(root) / f"case{index:04d}"
            folder.mkdir()
            timeout = case.timeout_s or (CASE_TIMEOUT_S if case.sim else NO_SIM_TIMEOUT_S)
            outcome = run_case(case, folder, timeout)
            counts.setdefault(case.klass, Counter())[("bad" if case.bad else "control", outcome.kind)] += 1
            if verbose or outcome.kind != "ok":
                print(f"[{case.klass}] {outcome.kind:9s} {case.name}: {outcome.detail}", file=sys.__stderr__,
                      flush=True)
    return counts


def _print_counts(counts: dict[int, Counter]) -> None:
    print(f"{'class':>5} {'group':8} " + " ".join(f"{kind:>9}" for kind in OUTCOMES) + f" {'total':>6}")
    totals: Counter = Counter()
    for klass in sorted(counts):
        for group in ("bad", "control"):
            row = [counts[klass][(group, kind)] for kind in OUTCOMES]
            if sum(row):
                print(f"{klass:>5} {group:8} " + " ".join(f"{n:>9}" for n in row) + f" {sum(row):>6}")
                for kind, n in zip(OUTCOMES, row):
                    totals[(group, kind)] += n
    for group in ("bad", "control"):
        row = [totals[(group, kind)] for kind in OUTCOMES]
        print(f"{'all':>5} {group:8} " + " ".join(f"{n:>9}" for n in row) + f" {sum(row):>6}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--classes", default="1,2,3,4,5,6,7")
    parser.add_argument("--no-sim", action="store_true", help="leave out the cases that may run the simulator")
    parser.add_argument("--match", default="", help="only cases whose name holds this")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
    classes = {int(c) for c in args.classes.split(",")}
    selected = [c for c in cases() if c.klass in classes and not (args.no_sim and c.sim) and args.match in c.name]
    if any(c.sim for c in selected):
        from executor.device import speed_up_simulator

        import torch  # noqa: F401 - loaded before the memory cap

        speed_up_simulator()
    limit_memory()
    counts = run_corpus(selected, args.verbose)
    _print_counts(counts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
