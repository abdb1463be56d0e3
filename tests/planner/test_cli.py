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
    assert "KV pages:" in out and "max concurrency at max_context 32,768:" in out
    assert "largest transient buffers: prefill/" in out
    assert ("prefill attention of chunks >= 256 tokens: flash (serving auto), no score scratch, gather scratch "
            "32,768 keys") in out
    # 24 linear layers x (32 value heads x 128 x 128 float32 + conv_dim 8,192 x 3 bf16) = 51,511,296 B a state
    assert "recurrent-state slots: 32 for requests + 16 prefix-cache snapshots, 49.125 MiB each" in out
    code, out, _ = _run(capsys, "plan", "--model", "qwen3.5-9b", "--hardware", "h200", "--max-batch", "32",
                        "--max-context", "32768", "--prefix-state-slots", "0", "--format", "json")
    assert code == 0 and json.loads(out)["capacity"]["prefix_state_slots"] == 0


def test_plan_table_names_the_gemm_score_tile(capsys):
    code, out, _ = _run(capsys, "plan", "--model", "qwen3-8b", "--prefill-attention", "gemm", "--format", "table")
    assert code == 0
    assert ("prefill attention of chunks >= 256 tokens: gemm (serving gemm), score tile 67,108,864 elements, "
            "gather scratch 40,960 keys") in out


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
    "zero context (an int or auto)": ("max_context: 0\n", "max_context = 0", "greater than or equal to 1"),
    "vLLM's name of the context": ("max_model_len: 0\n", "max_model_len = 0", "greater than or equal to 1"),
    "a number too long to read": ("max_batch: 8\nmax_prefill_tokens: 1" + "0" * 5000 + "\n",
                                  "line 2, column 21", "Exceeds the limit (4300 digits)"),
    "a count too long to print": ("max_prefill_tokens: '1" + "0" * 5000 + "'\n", "max_prefill_tokens = '1000",
                                  "is not a token count"),
    "negative": ("max_prefill_tokens: -4\n", "max_prefill_tokens", "greater than or equal to 1"),
    "float for int": ("max_batch: 8.5\n", "max_batch", "valid integer"),
    "malformed": ("max_batch: [8\n", "line", "malformed YAML"),
    "not a mapping": ("- 1\n- 2\n", "<root>", "expected a mapping"),
    "beside decode over the chunk": ("max_prefill_tokens: 512\nmax_prefill_tokens_beside_decode: 1k\n",
                                     "max_prefill_tokens_beside_decode (1000)", "exceeds max_prefill_tokens (512)"),
    "step rows under the chunk": ("max_batch: 8\nmax_prefill_tokens: 512\nmax_step_tokens: 500\n",
                                  "max_step_tokens (500)", "below max_batch (8) or max_prefill_tokens (512)"),
    "step rows over what a step fills": ("max_batch: 8\nmax_prefill_tokens: 512\nmax_step_tokens: 520\n",
                                         "max_step_tokens (520)", "exceeds max_prefill_tokens + max_batch - 1 (519)"),
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


# -- output: the table on a terminal, JSON when piped or asked, a closed stdout ------------------------------------


def test_plan_prints_the_table_on_a_terminal_and_json_when_piped(capsys, monkeypatch):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    code, out, _ = _run(capsys, "plan", "--model", "qwen3-8b")
    assert code == 0 and out.startswith("memplan: qwen3-8b on h200")
    code, out, _ = _run(capsys, "plan", "--model", "qwen3-8b", "--format", "json")
    assert code == 0 and json.loads(out)["model"]["name"] == "qwen3-8b"
    monkeypatch.setattr(sys.stdout, "isatty", lambda: False)
    code, out, _ = _run(capsys, "plan", "--model", "qwen3-8b")
    assert code == 0 and json.loads(out)["model"]["name"] == "qwen3-8b"


def test_plan_out_writes_the_json_and_leaves_stdout_empty(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    code, out, err = _run(capsys, "plan", "--model", "qwen3-8b", "--out", str(tmp_path / "plan.json"))
    assert code == 0 and out == "" and "plan.json" in err
    assert json.loads((tmp_path / "plan.json").read_text())["capacity"]["max_context"] == 40960


def test_version(capsys):
    from planner import __version__

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"memplan {__version__}"


def test_a_closed_stdout_ends_quietly():
    """`memplan plan ... | head -1`: the reader goes away after one line; no BrokenPipeError traceback."""
    process = subprocess.Popen([sys.executable, "-m", "planner.cli", "plan", "--model", "qwen3-8b"], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert process.stdout.readline().strip() == b"{"
    process.stdout.close()
    assert process.wait(timeout=60) == 0
    assert process.stderr.read() == b""


def test_run_without_the_executors_packages_is_one_line_saying_what_to_install():
    probe = ("import sys; sys.modules['torch'] = None; sys.modules['numpy'] = None\n"
             "from planner.cli import main\n"
             "sys.exit(main(['run', '--model', 'tiny-qwen3', '--hardware', 'cpu-sim', '--random-weights']))")
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 2
    line = result.stderr.strip()
    assert "\n" not in line and "is missing" in line and "pip install torch" in line and "'.[executor]'" in line


# -- vLLM's names and defaults -------------------------------------------------------------------------------------


def _plan_json(capsys, *argv):
    code, out, err = _run(capsys, "plan", *argv, "--format", "json")
    return code, (json.loads(out) if code == 0 else None), err


def test_vllm_names_work_as_serving_yaml_keys(capsys, tmp_path):
    path = tmp_path / "serving.yaml"
    path.write_text("max_num_seqs: 8\nmax_model_len: 16K\nblock_size: 32\nmax_num_batched_tokens: 1k\n")
    code, plan, _ = _plan_json(capsys, "--model", "qwen3-8b", "--serving", str(path))
    capacity = plan["capacity"]
    # vLLM's batched tokens bound a step's rows, decode rows included: the chunk and the step both.
    assert code == 0 and (capacity["max_batch"], capacity["max_context"], capacity["page_size"],
                          capacity["max_prefill_tokens"], capacity["max_tokens_per_step"]) == (8, 16384, 32, 1000, 1000)
    assert plan["serving"]["decode_graph_batch_sizes"] == [1, 2, 4, 8]
    assert _run(capsys, "validate", str(path))[0] == 0
    path.write_text("max_num_seqs: 8\nmax_batch: 16\n")
    code, _, err = _run(capsys, "plan", "--model", "qwen3-8b", "--serving", str(path))
    assert code == 2 and "max_num_seqs = 8" in err and "max_batch" in err
    assert _run(capsys, "validate", str(path))[0] == 2
    for field in ("max_prefill_tokens", "max_step_tokens"):  # either field clashes with the vLLM name
        path.write_text(f"max_num_batched_tokens: 1k\n{field}: 1000\n")
        code, _, err = _run(capsys, "plan", "--model", "qwen3-8b", "--serving", str(path))
        assert code == 2 and "max_num_batched_tokens = '1k'" in err and f"sets {field}" in err
        assert _run(capsys, "validate", str(path))[0] == 2


def test_vllm_batched_tokens_flag_sets_the_chunk_and_the_step(capsys):
    """--max-num-batched-tokens over the H200's file (whose chunk is 8,192): both fields take it; with
    --max-prefill-tokens too it is refused; under --max-num-seqs it is refused with the bound."""
    code, plan, _ = _plan_json(capsys, "--model", "qwen3-8b", "--max-num-batched-tokens", "4k")
    assert code == 0 and (plan["capacity"]["max_prefill_tokens"], plan["capacity"]["max_tokens_per_step"],
                          plan["serving"]["max_step_tokens"]) == (4000, 4000, 4000)
    code, _, err = _run(capsys, "plan", "--model", "qwen3-8b", "--max-num-batched-tokens", "4k",
                        "--max-prefill-tokens", "2k")
    assert code == 2 and "max_num_batched_tokens = 4000" in err and "sets max_prefill_tokens" in err
    code, _, err = _run(capsys, "plan", "--model", "qwen3-8b", "--max-num-batched-tokens", "128",
                        "--max-num-seqs", "256")
    assert code == 2 and "max_step_tokens = 128" in err and "below max_batch (256)" in err


def test_graph_buckets_follow_max_batch(capsys, tmp_path):
    path = tmp_path / "serving.yaml"
    path.write_text("max_batch: 32\n")
    code, plan, _ = _plan_json(capsys, "--model", "qwen3-8b", "--serving", str(path))
    assert code == 0 and plan["serving"]["decode_graph_batch_sizes"] == [1, 2, 4, 8, 16, 32]
    code, plan, _ = _plan_json(capsys, "--model", "qwen3-8b", "--max-batch", "48")
    assert plan["serving"]["decode_graph_batch_sizes"] == [1, 2, 4, 8, 16, 32, 48]
    path.write_text("max_batch: 32\ndecode_graph_batch_sizes: [4, 32]\n")  # given buckets: those above go
    code, plan, _ = _plan_json(capsys, "--model", "qwen3-8b", "--serving", str(path), "--max-batch", "16")
    assert plan["serving"]["decode_graph_batch_sizes"] == [4]


@pytest.mark.parametrize("value, context", [("32k", 32000), ("32K", 32768), ("40960", 40960), ("1.5k", 1500)])
def test_max_model_len_takes_human_readable_counts(capsys, value, context):
    code, plan, _ = _plan_json(capsys, "--model", "qwen3-8b", "--max-model-len", value)
    assert code == 0 and plan["capacity"]["max_context"] == context


def test_max_context_defaults_to_the_models_limit(capsys, tmp_path):
    from planner.loader import load_model
    from tests.hf_reference import hf_config_dict

    data = {**hf_config_dict(load_model("qwen3-0.6b")), "max_position_embeddings": 4096}
    (tmp_path / "config.json").write_text(json.dumps(data))
    code, plan, err = _plan_json(capsys, "--model", str(tmp_path))
    assert code == 0, err
    assert plan["serving"]["max_context"] is None and plan["capacity"]["max_context"] == 4096


def test_hardware_aliases_and_a_did_you_mean(capsys):
    code, plan, _ = _plan_json(capsys, "--model", "qwen3-8b", "--hardware", "h100")
    assert code == 0 and plan["hardware"]["name"] == "h100-sxm"
    code, _, err = _run(capsys, "plan", "--model", "qwen3-8b", "--hardware", "rtx-5080")
    assert code == 2 and "did you mean rtx-5090?" in err


def test_plan_and_run_take_the_same_default_serving(capsys):
    """cpu-sim names the tiny sim serving config; memplan plan and memplan run both take it."""
    import argparse

    from executor.runner import load_plan

    code, plan, _ = _plan_json(capsys, "--model", "tiny-qwen3", "--hardware", "cpu-sim")
    assert code == 0 and plan["capacity"]["max_context"] == 64
    args = argparse.Namespace(plan=None, model="tiny-qwen3", checkpoint=None, hardware="cpu-sim", serving=None)
    assert load_plan(args, {}).model_dump(mode="json") == plan


#: The shipped full-size models (the tiny ones are for the simulator).
FULL_SIZE_MODELS = sorted(p.stem for p in (ROOT / "configs/models").glob("qwen*.yaml"))


@pytest.mark.parametrize("model", FULL_SIZE_MODELS)
def test_the_h200_serves_vllm_s_sizes_by_default_and_every_shipped_model_fits(capsys, model):
    """Without --serving, the H200 plans 256 sequences and 8,192 batched tokens (vLLM's sizes there) at the
    model's own max_context, and every shipped model fits; the H100 SXM takes the same sizes where the model
    fits, and another card keeps default.yaml's 64 / 2,048."""
    code, plan, err = _plan_json(capsys, "--model", model)
    assert code == 0, err
    assert (plan["capacity"]["max_batch"], plan["serving"]["max_prefill_tokens"]) == (256, 8192)
    assert plan["capacity"]["max_context"] == plan["model"]["max_position_embeddings"]
    for hardware, sizes in (("h100-sxm", (256, 8192)), ("a100-80gb", (64, 2048))):
        code, plan, err = _plan_json(capsys, "--model", model, "--hardware", hardware)
        assert code in (0, 3), err
        if code == 0:
            assert (plan["capacity"]["max_batch"], plan["serving"]["max_prefill_tokens"]) == sizes


def test_does_not_fit_with_json_output_prints_the_verdict_and_its_advice(capsys):
    code, out, err = _run(capsys, "plan", "--model", "qwen3-32b", "--hardware", "h100-sxm", "--max-model-len",
                          "40960", "--format", "json")
    verdict = json.loads(out)
    assert code == 3 and verdict["fits"] is False and verdict["reason"] in err
    assert verdict["advice"]["max_context"] < 40960 and verdict["advice"]["gpu_memory_utilization"] > 0.9


def test_an_error_line_names_an_int_too_long_to_print_by_its_digits():
    from planner.errors import ConfigError

    line = str(ConfigError("serving.yaml", "max_batch", 10**5000, "must be at most 4,096"))
    assert line == "serving.yaml: max_batch = <an int of about 5,001 digits>: must be at most 4,096"


def test_validate_names_a_bad_enum_value_once(capsys, tmp_path):
    """A dtype of 1.5 breaks the schema's enum and its type: one line for the field, not two."""
    path = tmp_path / "serving.yaml"
    path.write_text("dtype: 1.5\n")
    code, out, err = _run(capsys, "validate", str(path))
    lines = [line for line in (out + err).splitlines() if str(path) in line]
    assert code != 0 and len(lines) == 1 and ": dtype: " in lines[0], out + err


def test_a_null_config_file_says_so(capsys, tmp_path):
    path = tmp_path / "serving.yaml"
    path.write_text("null\n")
    code, _, err = _run(capsys, "plan", "--model", "qwen3-8b", "--serving", str(path))
    assert code == 2 and "the file is empty or null" in err


def test_a_hardware_file_s_default_serving_must_exist(capsys, tmp_path):
    path = tmp_path / "card.yaml"
    text = (ROOT / "configs" / "hardware" / "h100-sxm.yaml").read_text()
    path.write_text("\n".join(line if not line.startswith("default_serving:") else "default_serving: nowhere"
                              for line in text.splitlines()) + "\n")
    code, out, err = _run(capsys, "validate", str(path))
    assert code != 0 and f"{path}: default_serving = 'nowhere': names no serving file" in out + err
    code, out, err = _run(capsys, "plan", "--model", "qwen3-8b", "--hardware", str(path))  # plan names it alike
    assert code == 2 and f"{path}: default_serving = 'nowhere': names no serving file" in err


def test_validate_names_two_names_of_one_field_given_together(capsys, tmp_path):
    path = tmp_path / "serving.yaml"
    path.write_text("max_model_len: 100\nmax_context: 100\n")
    code, out, err = _run(capsys, "validate", str(path))
    assert code != 0 and f"{path}: <root>: max_model_len and max_context are given together; give one of them" \
        in out + err


def test_validate_reports_a_malformed_list_once_not_once_a_level(capsys, tmp_path):
    assert main(["plan", "--model", "tiny-qwen3.5", "--hardware", "cpu-sim", "--format", "json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    plan["geometry"]["vocab_slices"] = [[[]]]
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    code, out, err = _run(capsys, "validate", str(path))
    lines = [line for line in (out + err).splitlines() if line.startswith(str(path))]
    assert code != 0 and len(lines) == 1 and ": geometry.vocab_slices.0: " in lines[0], out + err
