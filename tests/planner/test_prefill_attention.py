"""serving prefill_attention: gemm plans the gather scratch and the score tile; flash plans the gather
scratch only, and is refused, naming the serving file, for models the kernel cannot run; auto (the
default) is flash where it runs, else gemm."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from planner.cli import main
from planner.kernel_limits import FLASH_HEAD_DIM_MULTIPLE
from planner.config import ServingConfig
from planner.errors import ConfigError
from planner.loader import load_hardware, load_model, load_serving
from planner.plan import build_plan

ROOT = Path(__file__).resolve().parents[2]
GATHER = {"attn_keys", "attn_values"}  # both backends
GEMM_ONLY = {"attn_packed", "attn_scores", "attn_probs"}


def _attention_scratch(plan) -> set[str]:
    return {b.name for b in plan.pool("prefill").buffers} & (GATHER | GEMM_ONLY)


def test_auto_is_the_default_and_what_the_shipped_serving_configs_say():
    assert ServingConfig().prefill_attention == "auto"
    for name in ("default", "sim"):
        assert load_serving(name).prefill_attention == "auto"


@pytest.mark.parametrize("model,hardware,backend", [
    ("qwen3-8b", "h200", "flash"),          # bf16, head_dim 128
    ("qwen3.5-9b", "h200", "flash"),        # bf16, head_dim 256
    ("tiny-qwen3-g5", "cpu-sim", "gemm"),   # head_dim 8
])
def test_auto_takes_flash_where_the_kernel_runs(model, hardware, backend):
    serving = "sim" if hardware == "cpu-sim" else "default"
    plan = build_plan(load_model(model), load_hardware(hardware), load_serving(serving))
    assert plan.capacity.prefill_attention == backend
    assert ("attn_scores" in {b.name for b in plan.pool("prefill").buffers}) == (backend == "gemm")


def test_auto_falls_back_to_gemm_for_float32():
    serving = load_serving("default", {"dtype": "float32"})
    plan = build_plan(load_model("qwen3-8b"), load_hardware("h200"), serving)
    assert plan.capacity.prefill_attention == "gemm"


def test_flash_plans_the_gather_scratch_and_no_score_tile(plan_for):
    """Qwen3-8B, default serving at C = 8192: both backends gather keys and values into [Hkv, C, D];
    only gemm has the packed queries and the score tile. At C = 1,152 and 8,192-token steps, gemm still
    gathers one request's C keys, flash a step's 8,192 (its fresh prompts' keys packed together)."""
    gemm, flash = (plan_for("qwen3-8b", prefill_attention=backend, max_context=8192) for backend in ("gemm", "flash"))
    assert _attention_scratch(gemm) == GATHER | GEMM_ONLY
    assert _attention_scratch(flash) == GATHER
    for plan in (gemm, flash):
        assert plan.capacity.prefill_gather_tokens == 8192
        assert plan.pool("prefill").buffer("attn_keys").shape == (8, 8192, 128)
        assert plan.pool("prefill").buffer("attn_values").shape == (8, 8192, 128)
    short = {"max_context": 1152, "max_prefill_tokens": 8192}
    gemm, flash = (plan_for("qwen3-8b", prefill_attention=backend, **short) for backend in ("gemm", "flash"))
    assert (gemm.capacity.prefill_gather_tokens, flash.capacity.prefill_gather_tokens) == (1152, 8192)
    assert flash.pool("prefill").buffer("attn_keys").shape == (8, 8192, 128)
    assert gemm.capacity.prefill_score_elements == 1 << 26
    assert flash.capacity.prefill_score_elements == 0


@pytest.mark.parametrize("backend", ["gemm", "flash"])
def test_no_long_chunks_no_attention_scratch(plan_for, backend):
    plan = plan_for("qwen3-8b", prefill_attention=backend, gemm_attention_min_tokens=4096)  # > any chunk
    assert plan.capacity.prefill_gather_tokens == plan.capacity.prefill_score_elements == 0
    assert _attention_scratch(plan) == set()


def test_flash_drops_exactly_the_score_buffers_bytes(plan_for):
    """Qwen3-8B at C = 40960, 256-token chunks (T = 256 + 63 = 319): the attention stage is the prefill
    pool's peak in both plans (the gathered keys and values, 2 x 8 x 40960 x 128 bf16, dwarf the MLP's
    rows), so flash's pool and non-KV total are smaller by exactly the three dropped buffers: float32
    scores and bf16 probabilities of 2^26 elements (32 heads x 319 x 40960 is above 2^26, 32 x 40960
    below) and the packed queries [319, 32, 128] bf16. Every other pool is the same."""
    serving = {"max_context": 40960, "max_prefill_tokens": 256}
    gemm, flash = plan_for("qwen3-8b", prefill_attention="gemm", **serving), plan_for("qwen3-8b", prefill_attention="flash", **serving)
    score_elements = 1 << 26
    dropped_bytes = 4 * score_elements + 2 * score_elements + 319 * 32 * 128 * 2
    assert gemm.pool("prefill").bytes - flash.pool("prefill").bytes == dropped_bytes
    assert gemm.budget.non_kv_bytes - flash.budget.non_kv_bytes == dropped_bytes
    for name in ("weights", "attention_plan", "decode", "sampling", "runtime"):
        assert gemm.pool(name) == flash.pool(name), name
    kept = {b.name: (b.dtype, b.shape, b.bytes) for b in flash.pool("prefill").buffers}
    assert kept == {b.name: (b.dtype, b.shape, b.bytes) for b in gemm.pool("prefill").buffers
                    if b.name not in GEMM_ONLY}
    assert flash.capacity.kv_pages > gemm.capacity.kv_pages  # the freed bytes went to the KV pool


def _flash_error(model: str, **serving) -> ConfigError:
    flash = load_serving("sim", {"prefill_attention": "flash", **serving})
    with pytest.raises(ConfigError) as error:
        build_plan(load_model(model), load_hardware("cpu-sim"), flash, serving_source="serving.yaml")
    return error.value


def test_flash_is_refused_for_a_head_dim_the_kernel_cannot_take():
    error = _flash_error("tiny-qwen3-g5", dtype="bfloat16")  # head_dim 8
    assert (error.source, error.field, error.value) == ("serving.yaml", "prefill_attention", "flash")
    assert f"head_dim a multiple of {FLASH_HEAD_DIM_MULTIPLE}" in error.rule
    assert "tiny-qwen3-g5 has head_dim 8" in error.rule


@pytest.mark.parametrize("model, serving, resolved", [
    ("qwen3-8b", {"dtype": "float32"}, "give float32 and float32"),
    ("qwen3-8b", {"dtype": "float16"}, "give float16 and float16"),
    ("qwen3-8b", {"kv_cache_dtype": "float32"}, "give bfloat16 and float32"),
])
def test_flash_is_refused_unless_activations_and_kv_cache_are_bf16(model, serving, resolved):
    error = _flash_error(model, **serving)
    assert (error.source, error.field, error.value) == ("serving.yaml", "prefill_attention", "flash")
    assert "needs bfloat16 activations and KV cache" in error.rule and resolved in error.rule


def test_memplan_plan_names_the_serving_file_in_the_refusal(capsys, tmp_path):
    serving = yaml.safe_load((ROOT / "configs/serving/sim.yaml").read_text())
    path = tmp_path / "flash.yaml"
    path.write_text(yaml.safe_dump({**serving, "prefill_attention": "flash", "dtype": "bfloat16"}))
    code = main(["plan", "--model", "tiny-qwen3-g5", "--hardware", "cpu-sim", "--serving", str(path)])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(f"memplan: config error: {path}: prefill_attention = 'flash': needs head_dim")
    assert len(err.strip().splitlines()) == 1
    assert main(["plan", "--model", "qwen3-8b", "--hardware", "h200", "--serving", str(path)]) == 0  # head_dim 128
