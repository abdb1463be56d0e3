"""`memplan plan` and `memplan validate`: exit codes and one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from planner.cli import main

ROOT = Path(__file__).resolve().parents[2]


def _run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_prints_json_that_validates(capsys, tmp_path):
    code, out, _ = _run(capsys, "plan", "--model", "configs/models/qwen3-8b.yaml",
                        "--hardware", "configs/hardware/h200.yaml", "--serving", "configs/serving/default.yaml")
    assert code == 0
    plan = json.loads(out)
    assert {"schema_version", "model", "hardware", "serving", "capacity", "pools", "budget"} <= plan.keys()
    assert [p["name"] for p in plan["pools"]] == [
        "weights", "kv_cache", "attention_plan", "decode", "prefill", "sampling", "runtime"]
    path = tmp_path / "plan.json"
    path.write_text(out)
    assert _run(capsys, "validate", str(path))[0] == 0


def test_plan_table_names_kv_capacity_and_largest_buffers(capsys):
    code, out, _ = _run(capsys, "plan", "--model", "qwen3.5-9b", "--hardware", "h200", "--max-batch", "32",
                        "--max-context", "32768", "--format", "table")
    assert code == 0
    assert "KV pages:" in out and "max concurrency at full context" in out
    assert "largest transient buffers: prefill/" in out
    assert "prefill attention of chunks >= 256 tokens: flash (serving auto), no score scratch" in out


def test_plan_table_names_the_gemm_score_tile(capsys):
    code, out, _ = _run(capsys, "plan", "--model", "qwen3-8b", "--prefill-attention", "gemm", "--format", "table")
    assert code == 0
    assert "prefill attention of chunks >= 256 tokens: gemm (serving gemm), score tile 67,108,864 elements" in out


def test_plan_from_hf_config_json(capsys, tmp_path):
    from planner.loader import load_model
    from tests.hf_reference import hf_config_dict

    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(load_model("qwen3.5-4b"))))
    code, out, _ = _run(capsys, "plan", "--model", str(tmp_path / "config.json"), "--hardware", "h200",
                        "--max-batch", "64", "--max-context", "32768")
    assert code == 0
    assert json.loads(out)["capacity"]["logical_pages"] == 64 * 2048


def test_does_not_fit_exits_3_with_consumers_and_advice(capsys):
    code, _, err = _run(capsys, "plan", "--model", "qwen3-32b", "--hardware", "rtx-5090")
    assert code == 3
    assert "Biggest: weights" in err and "--tensor-parallel-size" in err


def test_does_not_fit_suggests_a_batch_that_does_fit(capsys):
    code, _, err = _run(capsys, "plan", "--model", "qwen3.5-27b", "--hardware", "h100-sxm", "--max-batch", "4096",
                        "--max-prefill-tokens", "65536", "--max-context", "4096")
    assert code == 3
    suggested = int(err.split("--max-batch ")[1].split()[0])
    assert _run(capsys, "plan", "--model", "qwen3.5-27b", "--hardware", "h100-sxm", "--max-batch", str(suggested),
                "--max-prefill-tokens", "65536", "--max-context", "4096")[0] == 0
    assert _run(capsys, "plan", "--model", "qwen3.5-27b", "--hardware", "h100-sxm", "--max-batch",
                str(suggested + 1), "--max-prefill-tokens", "65536", "--max-context", "4096")[0] == 3


BAD_SERVING = {
    "unknown field": ("max_batch: 8\nmax_batchh: 9\n", "max_batchh", "Extra inputs are not permitted"),
    "wrong type": ("max_batch: eight\n", "max_batch", "valid integer"),
    "zero": ("page_size: 0\n", "page_size", "greater than or equal to 1"),
    "negative": ("max_prefill_tokens: -4\n", "max_prefill_tokens", "greater than or equal to 1"),
    "float for int": ("max_batch: 8.5\n", "max_batch", "valid integer"),
    "malformed": ("max_batch: [8\n", "line", "malformed YAML"),
    "not a mapping": ("- 1\n- 2\n", "<root>", "expected a mapping"),
}


@pytest.mark.parametrize("case", BAD_SERVING, ids=list(BAD_SERVING))
def test_bad_serving_config_is_one_line_and_exit_2(capsys, tmp_path, case):
    text, field, rule = BAD_SERVING[case]
    path = tmp_path / "serving.yaml"
    path.write_text(text)
    code, _, err = _run(capsys, "plan", "--model", "qwen3-8b", "--serving", str(path))
    assert code == 2
    line = err.strip()
    assert "\n" not in line and str(path) in line and field in line and rule in line


def test_inconsistent_heads_name_the_file_and_the_rule(capsys, tmp_path):
    text = (ROOT / "configs/models/qwen3-8b.yaml").read_text().replace("num_key_value_heads: 8", "num_key_value_heads: 6")
    path = tmp_path / "model.yaml"
    path.write_text(text)
    code, _, err = _run(capsys, "plan", "--model", str(path))
    assert code == 2
    assert str(path) in err and "must be a multiple of num_key_value_heads (6)" in err


def test_context_over_the_model_limit_is_a_config_error(capsys):
    code, _, err = _run(capsys, "plan", "--model", "qwen3-8b", "--max-context", "50000")
    assert code == 2 and "max_context = 50000" in err and "40960" in err


def test_validate_reports_a_tampered_plan(capsys, tmp_path):
    _, out, _ = _run(capsys, "plan", "--model", "tiny-qwen3", "--hardware", "cpu-sim", "--serving", "sim")
    plan = json.loads(out)
    plan["pools"][3]["buffers"][0]["offset"] += 256
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    code, out, err = _run(capsys, "validate", str(path))
    assert code == 2 and ": pools[3].buffers[0].offset = " in err


def test_validate_shipped_configs(capsys):
    code, out, err = _run(capsys, "validate", str(ROOT / "configs"))
    assert code == 0, err


def test_console_script_runs_without_torch():
    """The planner must not import torch or numba: `memplan plan` works with pydantic, pyyaml, jsonschema."""
    probe = ("import sys; sys.modules['torch'] = None; sys.modules['numba'] = None\n"
             "from planner.cli import main; sys.exit(main(['plan', '--model', 'qwen3-8b', '--format', 'table']))")
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
