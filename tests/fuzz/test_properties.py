"""Hypothesis over untrusted input: whatever a config, plan file, request line, raw file or safetensors
file holds, the command ends with exit 0/2/3 and one line naming the file (never a traceback), a reader
returns plain JSON values or a ConfigError, and a request that reaches the engine is inside every bound the
kernels rely on. Cheap: in-process, planner and readers only (no simulator); FUZZ_EXAMPLES=N runs N
examples per test instead of CI's few."""

from __future__ import annotations

import io
import json
import math
import os
import struct
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from executor.checkpoint_checks import CheckpointError, read_header
from executor.workload import (
    FLOAT32_MAX, SEED_LIMIT, RequestFileError, RequestLimits, read_request_file)
from planner.cli import main
from planner.errors import ConfigError
from planner.inputs import MAX_DEPTH, parse_json, parse_yaml
from tests.fuzz.strategies import mutated, raw_documents, request_lines, safetensors_corruptions

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "40"))
CASES = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                         HealthCheck.too_slow])
LIMITS = RequestLimits(vocab_size=256, max_context=64)


def _cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exit_:
            code = exit_.code
    return code, out.getvalue(), err.getvalue()


def _base(kind: str, name: str) -> dict:
    return yaml.safe_load((ROOT / "configs" / kind / f"{name}.yaml").read_text())


def _assert_outcome(code: int, err: str, path: Path) -> None:
    assert code in (0, 2, 3), err
    if code == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1, err
        assert str(path) in lines[0], err


@pytest.mark.parametrize("kind, name, flag", [("models", "tiny-qwen3.5", "--model"),
                                              ("hardware", "cpu-sim", "--hardware"),
                                              ("serving", "sim", "--serving")])
@CASES
@given(data=st.data())
def test_a_config_with_one_nasty_field_is_planned_or_refused_in_one_line(tmp_path, kind, name, flag, data):
    config = data.draw(mutated(_base(kind, name)))
    path = tmp_path / f"{kind}.yaml"
    path.write_text(yaml.safe_dump(config, allow_unicode=True))
    argv = {"--model": "tiny-qwen3", "--hardware": "cpu-sim", "--serving": "sim"}
    argv[flag] = str(path)
    out_file = tmp_path / "plan.json"
    out_file.write_text("KEEP")
    code, _, err = _cli(["plan", *[x for item in argv.items() for x in item], "--out", str(out_file)])
    _assert_outcome(code, err, path)
    if code != 0:
        assert out_file.read_text() == "KEEP"


@CASES
@given(data=st.data())
def test_an_edited_plan_file_validates_only_when_it_is_the_planners(tmp_path_factory, data):
    base = _plan_json()
    plan = data.draw(mutated(base))
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    path.write_text(json.dumps(plan))
    code, out, err = _cli(["validate", str(path)])
    assert code in (0, 2), err
    if json.dumps(plan) == json.dumps(base):
        assert code == 0, err
    if code == 2:  # code 0: the edit left the plan the planner's (a field deleted to its default)
        assert err.strip() and all(line.startswith(str(path)) for line in err.strip().splitlines()), err


_PLAN: dict = {}


def _plan_json() -> dict:
    if not _PLAN:
        from planner.loader import plan_from_configs

        _PLAN.update(json.loads(plan_from_configs("tiny-qwen3", "cpu-sim", "sim").model_dump_json()))
    return _PLAN


@CASES
@given(line=request_lines())
@example(line='{"\\n": Infinity}')  # a key's line break is written as an escape in the one-line error
def test_a_request_line_is_refused_rejected_or_inside_every_bound(tmp_path_factory, line):
    path = tmp_path_factory.mktemp("requests") / "requests.jsonl"
    path.write_text(line + "\n")
    try:
        (spec,) = read_request_file(path, 4, LIMITS, seed=0)
    except RequestFileError as error:
        assert f"{path} line 1" in str(error) and "\n" not in str(error)
        return
    if spec.error is not None:
        assert "\n" not in spec.error
        return
    assert 1 <= len(spec.prompt_ids) <= LIMITS.max_context
    assert all(0 <= t < LIMITS.vocab_size for t in spec.prompt_ids + spec.stop_ids)
    assert 1 <= spec.max_new_tokens <= LIMITS.max_context
    assert 0 <= spec.seed < SEED_LIMIT
    assert 0 <= spec.top_k <= LIMITS.vocab_size
    assert math.isfinite(spec.temperature) and 0 <= spec.temperature <= FLOAT32_MAX
    assert 0 < spec.top_p <= 1 and all(spec.stop)


def test_the_run_sampling_defaults_are_checked_like_the_request_s_own(tmp_path):
    """A default the kernels cannot serve (top_k over the vocabulary) rejects the lines that take it, naming
    the field; a line that sets its own top_k keeps it."""
    from executor.generation import Sampling

    path = tmp_path / "requests.jsonl"
    path.write_text('{"prompt_ids": [1, 2]}\n{"prompt_ids": [1, 2], "top_k": 5}\n')
    defaulted, own = read_request_file(path, 4, LIMITS, seed=0, sampling=Sampling(top_k=LIMITS.vocab_size + 1))
    assert defaulted.error is not None and defaulted.error.startswith("top_k")
    assert own.error is None and own.top_k == 5


def _plain(value, depth: int = 0) -> bool:
    if depth > MAX_DEPTH:
        return False
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v, depth + 1) for k, v in value.items())
    if isinstance(value, list):
        return all(_plain(v, depth + 1) for v in value)
    if isinstance(value, float):
        return math.isfinite(value)
    return value is None or isinstance(value, (str, int, bool))


@settings(max_examples=4 * EXAMPLES, deadline=None)
@given(raw=raw_documents())
def test_the_readers_return_plain_json_values_or_a_config_error(raw):
    for parse in (parse_yaml, parse_json):
        try:
            text = raw.decode("utf-8")
            value = parse(text, "doc")
        except UnicodeDecodeError:
            continue
        except ConfigError as error:
            assert str(error).startswith("doc")
            continue
        assert _plain(value), value


@pytest.mark.parametrize("text, value", [
    ("010", 10), ("0o17", 15), ("0x10", 16), ("-7", -7), ("1e-6", 1e-6), ("1.0e-06", 1e-6), (".5", 0.5),
    ("1:30", "1:30"), ("0b11", "0b11"), ("1_000", "1_000"), ("yes", "yes"), ("on", "on"), ("True", True),
])
def test_yaml_reads_booleans_and_numbers_by_yaml_1_2(text, value):
    """YAML 1.1's forms would read 010 as eight, 1:30 as ninety and yes as true, and 1e-6 as a string."""
    read = parse_yaml(f"a: {text}\n", "doc")["a"]
    assert read == value and type(read) is type(value)


def test_yaml_refuses_infinity_as_a_number():
    with pytest.raises(ConfigError, match="doc"):
        parse_yaml("a: .inf\n", "doc")


_SAFETENSORS: list[bytes] = []


def _small_safetensors() -> bytes:
    if not _SAFETENSORS:
        import numpy as np
        from safetensors.numpy import save

        _SAFETENSORS.append(save({"a": np.arange(6, dtype=np.float32).reshape(2, 3),
                                  "b": np.ones(4, dtype=np.float16)}))
    return _SAFETENSORS[0]


@CASES
@given(data=st.data())
def test_a_corrupt_safetensors_file_is_refused_or_readable(tmp_path_factory, data):
    raw = data.draw(safetensors_corruptions(_small_safetensors()))
    path = tmp_path_factory.mktemp("ckpt") / "model.safetensors"
    path.write_bytes(raw)
    try:
        entries = read_header(path)
    except CheckpointError as error:
        assert str(path) in str(error) and "\n" not in str(error)
        return
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as handle:  # what the checks pass, the library reads
        for name, entry in entries.items():
            assert tuple(handle.get_slice(name).get_shape()) == entry.shape
            handle.get_tensor(name)


def test_the_header_length_is_little_endian_u64(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", 2) + b"{}")
    assert read_header(path) == {}
