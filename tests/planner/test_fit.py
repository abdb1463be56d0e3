"""The fit rule: a plan fits only when its KV pool holds one request of max_context (the padding page 0
not counted); the advice printed with exit 3 fits when applied; max_concurrency against independent counts."""

from __future__ import annotations

import json
import math
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.cli import main
from planner.draft import Drafter
from planner.config import HardwareConfig, ModelConfig, ServingConfig, serving_with
from planner.errors import PlanDoesNotFit
from planner.loader import load_hardware, load_model, load_serving
from planner.plan import build_plan

ALIGNMENT = 256  # every pool's size is a multiple of this
BF16 = 2


def _plan(capsys, *argv):
    code = main(["plan", *argv, "--format", "json"])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if code == 0 else None), err


def _kv_token_bytes(model: ModelConfig, tp: int = 1) -> int:
    """K and V of one token over the full-attention layers of one rank, from the model card's figures."""
    full_layers = sum(kind == "full_attention" for kind in model.kinds)
    kv_heads = max(model.num_key_value_heads // tp, 1)
    return full_layers * 2 * kv_heads * model.head_dim * BF16


def test_the_fit_edge_is_one_request_of_max_context(capsys):
    """Qwen3-32B on an H100 at 40,960 tokens: the smallest utilization (in steps of 1e-6, about 85 KB here,
    less than one 4 MiB page) at which non-KV bytes + an aligned pool of 2,560 pages + the padding page fit
    gives exactly one request's pages; one step less does not fit, and says it has one page too few."""
    args = ["--model", "qwen3-32b", "--hardware", "h100-sxm", "--max-model-len", "40960"]
    code, roomy, _ = _plan(capsys, *args, "--gpu-memory-utilization", "1.0")
    assert code == 0
    model, device = load_model("qwen3-32b"), roomy["budget"]["device_bytes"]
    page_bytes = _kv_token_bytes(model) * 16
    per_request = math.ceil(40960 / 16)
    required = roomy["budget"]["non_kv_bytes"] + -(-(per_request + 1) * page_bytes // ALIGNMENT) * ALIGNMENT
    steps = -(-required * 10**6 // device)  # smallest utilization x 1e6 whose usable bytes hold it
    edge, below = f"0.{steps:06d}", f"0.{steps - 1:06d}"
    assert device * Fraction(below) < required <= device * Fraction(edge)

    code, plan, _ = _plan(capsys, *args, "--gpu-memory-utilization", edge)
    assert code == 0
    assert plan["capacity"]["kv_pages"] == per_request + 1  # one request and the padding page, nothing more
    assert plan["capacity"]["max_concurrency"] == 1.0

    code, _, err = _plan(capsys, *args, "--gpu-memory-utilization", below)
    assert code == 3
    assert f"needs {per_request:,} KV pages" in err and f"leaves {per_request - 1:,} pages" in err
    advised = err.split("--gpu-memory-utilization ")[1].split()[0]
    assert Fraction(advised) >= Fraction(edge) and _plan(capsys, *args, "--gpu-memory-utilization", advised)[0] == 0


def test_the_padding_page_is_not_a_usable_page():
    """min_kv_pages counts usable pages: a pool of exactly min_kv_pages pages (padding included) does not fit."""
    model, hardware = load_model("tiny-qwen3"), load_hardware("cpu-sim")
    plan = build_plan(model, hardware, load_serving("sim"))
    usable = plan.capacity.kv_pages - 1
    assert build_plan(model, hardware, load_serving("sim", {"min_kv_pages": usable})).capacity.kv_pages == usable + 1
    with pytest.raises(PlanDoesNotFit):
        build_plan(model, hardware, load_serving("sim", {"min_kv_pages": usable + 1}))


def test_the_32b_on_an_h100_at_its_full_context_names_the_largest_context_and_the_utilization(capsys):
    args = ["--model", "qwen3-32b", "--hardware", "h100-sxm", "--max-model-len", "40960"]
    code, _, err = _plan(capsys, *args)
    assert code == 3 and "\n" not in err.strip()
    context = err.split("--max-model-len ")[1].split(".")[0]
    utilization = err.split("--gpu-memory-utilization ")[1].split()[0]
    for flag, value in (("--max-model-len", context), ("--gpu-memory-utilization", utilization)):
        code, plan, _ = _plan(capsys, *args, flag, value)
        assert code == 0 and plan["capacity"]["max_concurrency"] >= 1
    assert _plan(capsys, *args, "--max-model-len", str(int(context) + 1))[0] == 3  # the largest
    assert _plan(capsys, *args, "--gpu-memory-utilization", f"{float(utilization) - 0.01:.2f}")[0] == 3  # the smallest


def test_a_hybrid_model_whose_states_fill_the_device_names_the_context_at_smaller_batches(capsys):
    """Qwen3.5-27B on an H100: 272 recurrent states of 147 MiB beside 50 GiB of weights leave no room for any
    context at batch 256, nor does any batch hold its full 262,144 tokens. The advice names the largest
    context at batch 128, 64, ... : the first halvings that fit one, each the largest there."""
    args = ["--model", "qwen3.5-27b", "--hardware", "h100-sxm"]
    for extra in ([], ["--max-model-len", "auto"]):
        code, _, err = _plan(capsys, *args, *extra)
        assert code == 3 and "No max_context fits at these settings. At a smaller batch: --max-batch " in err
    assert main(["plan", *args, "--format", "json"]) == 3
    pairs = json.loads(capsys.readouterr().out)["advice"]["at_smaller_batch"]
    assert len(pairs) == 2 and pairs[0]["max_batch"] == 2 * pairs[1]["max_batch"]
    assert pairs[0]["max_context"] < pairs[1]["max_context"] < 262144  # a smaller batch leaves more for KV
    code, _, _ = _plan(capsys, *args, "--max-batch", str(2 * pairs[0]["max_batch"]), "--max-model-len", "auto")
    assert code == 3  # the halving before the first named holds no context
    for pair in pairs:
        at = ["--max-batch", str(pair["max_batch"]), "--max-model-len"]
        code, plan, _ = _plan(capsys, *args, *at, str(pair["max_context"]))
        assert code == 0 and plan["capacity"]["max_concurrency"] >= 1
        assert _plan(capsys, *args, *at, str(pair["max_context"] + 1))[0] == 3  # the largest at that batch


def test_an_advised_batch_that_holds_fewer_requests_than_it_admits_says_how_many_and_which_holds_all(capsys):
    """Qwen3.5-27B on an H100 at 32K: batch 95 fits one request of 32K; its KV pool holds one at once. The line
    says so, and names the largest batch that holds all of its own."""
    args = ["--model", "qwen3.5-27b", "--hardware", "h100-sxm", "--max-model-len", "32K"]
    code, _, err = _plan(capsys, *args)
    batch = int(err.split("Also fits: --max-batch ")[1].split()[0])
    every = int(err.split(f"--max-batch {batch} (now 256; it holds 1 request of max_context at once, --max-batch ")[1]
                .split()[0])
    assert code == 3 and 1 < every < batch
    code, plan, _ = _plan(capsys, *args, "--max-batch", str(every))
    assert code == 0 and plan["capacity"]["max_concurrency"] >= every
    code, plan, _ = _plan(capsys, *args, "--max-batch", str(every + 1))
    assert code == 0 and plan["capacity"]["max_concurrency"] < every + 1


def test_too_many_recurrent_state_snapshots_name_the_count_that_fits(capsys):
    args = ["--model", "qwen3.5-9b", "--hardware", "h200", "--max-model-len", "32K", "--prefix-state-slots"]
    code, _, err = _plan(capsys, *args, "4096")
    slots = int(err.split("--prefix-state-slots ")[1].split()[0])
    assert code == 3 and 0 < slots < 4096
    code, plan, _ = _plan(capsys, *args, str(slots))
    assert code == 0 and plan["capacity"]["prefix_state_slots"] == slots
    assert _plan(capsys, *args, str(slots + 1))[0] == 3  # the largest


def test_max_model_len_auto_is_the_largest_context_that_fits(capsys):
    args = ["--model", "qwen3-32b", "--hardware", "h100-sxm"]
    code, plan, _ = _plan(capsys, *args, "--max-model-len", "auto")
    context = plan["capacity"]["max_context"]
    assert code == 0 and plan["serving"]["max_context"] == "auto" and context < 40960
    assert _plan(capsys, *args, "--max-model-len", str(context))[0] == 0
    assert _plan(capsys, *args, "--max-model-len", str(context + 1))[0] == 3
    code, plan, _ = _plan(capsys, "--model", "qwen3-8b", "--max-model-len", "auto")
    assert plan["capacity"]["max_context"] == 40960  # the model's limit fits: auto takes it


# -- max_concurrency against independent counts ---------------------------------------------------------------


def _requests_held(plan, model: ModelConfig, tp: int = 1) -> tuple[float, int]:
    """(usable pages / pages per request, usable pages), counted from the budget and the model card."""
    budget, capacity = plan.budget, plan.capacity
    page_bytes = _kv_token_bytes(model, tp) * capacity.page_size
    available = budget.usable_bytes - budget.non_kv_bytes
    pages = available // page_bytes
    while -(-pages * page_bytes // ALIGNMENT) * ALIGNMENT > available:
        pages -= 1
    per_request = -(-capacity.max_context // capacity.page_size)
    return (pages - 1) / per_request, pages - 1


def test_max_concurrency_of_qwen3_8b_is_the_kv_pool(plan_for):
    model = load_model("qwen3-8b")
    plan = plan_for("qwen3-8b")  # default serving: max_context 40,960 (the model's limit), batch 64
    held, _ = _requests_held(plan, model)
    assert plan.capacity.kv_bytes_per_token == 36 * 2 * 8 * 128 * BF16
    assert held < 64 and plan.capacity.max_concurrency == pytest.approx(held)
    assert plan.capacity.concurrency_limit == "kv_cache" and plan.capacity.kv_pages_beyond_batch == 0
    # The largest batch at this context: a plan at that batch holds that many requests; one more does not.
    batch = plan.capacity.max_batch_at_context
    assert batch == int(held)  # smaller batches shrink the step buffers a little, never by a request here
    assert plan_for("qwen3-8b", max_batch=batch).capacity.max_concurrency >= batch
    assert plan_for("qwen3-8b", max_batch=batch + 1).capacity.max_concurrency < batch + 1
    # The largest context at batch 64: 64 requests of it fit; of one page more, not.
    context = plan.capacity.max_context_at_batch
    assert plan_for("qwen3-8b", max_context=context).capacity.max_concurrency >= 64
    assert plan_for("qwen3-8b", max_context=context + 16).capacity.max_concurrency < 64


def test_max_concurrency_of_qwen3_5_0_8b_is_capped_by_the_recurrent_slots(plan_for):
    model = load_model("qwen3.5-0.8b")
    plan = plan_for("qwen3.5-0.8b", max_context=8192)
    held, usable = _requests_held(plan, model)
    assert held > 1000  # the KV pool alone would hold over a thousand requests of 8,192 tokens ...
    # ... the state has 64 requests' slots (and the prefix cache's snapshots after them)
    assert plan.pool("recurrent_state").buffer("ssm_state").shape[1] == 64 + plan.capacity.prefix_state_slots
    assert plan.capacity.max_concurrency == 64 and plan.capacity.concurrency_limit == "recurrent_slots"
    assert plan.capacity.kv_pages_beyond_batch == usable - 64 * 8192 // 16
    batch = plan.capacity.max_batch_at_context  # each slot more costs state bytes (19.5 MiB): fewer KV pages
    assert 64 < batch < int(held)
    assert plan_for("qwen3.5-0.8b", max_context=8192, max_batch=batch).capacity.max_concurrency == batch
    assert plan_for("qwen3.5-0.8b", max_context=8192, max_batch=batch + 1).capacity.concurrency_limit == "kv_cache"


def test_the_table_names_the_batch_that_holds_its_requests_where_it_is_not_the_concurrency(capsys):
    """Qwen3.5-9B on an H100 at 32K and batch 64: the KV pool holds 48.3 requests, but at batch 49 the 15
    recurrent-state slots fewer leave room for 49; the table says which --max-batch that is and why."""
    args = ["--model", "qwen3.5-9b", "--hardware", "h100-sxm", "--max-model-len", "32K"]
    assert main(["plan", *args, "--max-batch", "64", "--format", "table"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("largest batch at"))
    batch = int(line.split("--max-batch ")[1].split()[0])
    assert f": {batch} requests at --max-batch {batch} (now 64; fewer recurrent-state slots leave more KV pages)" \
        in line
    code, plan, _ = _plan(capsys, *args, "--max-batch", str(batch))
    assert code == 0 and plan["capacity"]["max_concurrency"] >= batch


def test_max_concurrency_of_a_tp_4_plan_counts_one_rank(plan_for, capsys):
    model = load_model("qwen3-32b")
    plan = plan_for("qwen3-32b", "h100-sxm", tensor_parallel_size=4)
    held, _ = _requests_held(plan, model, tp=4)
    assert plan.capacity.kv_bytes_per_token == 64 * 2 * (8 // 4) * 128 * BF16
    assert plan.capacity.max_concurrency == pytest.approx(min(held, 64))
    assert main(["plan", "--model", "qwen3-32b", "--hardware", "h100-sxm", "-tp", "4", "--format", "table"]) == 0
    table = capsys.readouterr().out
    assert "per GPU: every figure below is one of the 4 ranks'" in table
    assert "(measured)" in table  # h100-sxm's device memory is cudaMemGetInfo's total on the card


# -- the advice fits when applied -----------------------------------------------------------------------------


@st.composite
def tight_configs(draw):
    """Random models on devices around the edge of fitting one request of max_context."""
    kv_heads = draw(st.sampled_from([1, 2, 4, 8]))
    group = draw(st.sampled_from([1, 2, 4]))
    hybrid = draw(st.booleans())
    layers = draw(st.integers(2, 8))
    hidden = draw(st.sampled_from([256, 1024, 2048]))
    model = dict(
        name="random", architecture="qwen3_5" if hybrid else "qwen3", hidden_size=hidden, num_layers=layers,
        intermediate_size=64 * draw(st.integers(4, 128)), num_attention_heads=kv_heads * group,
        num_key_value_heads=kv_heads, head_dim=draw(st.sampled_from([64, 128, 256])),
        vocab_size=64 * draw(st.integers(16, 3000)), max_position_embeddings=draw(st.integers(1024, 1 << 18)),
        partial_rotary_factor=0.25 if hybrid else 1.0, attn_output_gate=hybrid,
    )
    if hybrid:
        kinds = [draw(st.sampled_from(["linear_attention", "full_attention"])) for _ in range(layers - 2)]
        model["layer_types"] = ("linear_attention", *kinds, "full_attention")
        model["linear_attention"] = dict(num_key_heads=2, num_value_heads=4, key_head_dim=128, value_head_dim=128)
    model = ModelConfig.model_validate(model)
    context = draw(st.integers(1, model.max_position_embeddings))
    serving = ServingConfig.model_validate(dict(
        max_batch=draw(st.integers(1, 128)), max_context=context,
        page_size=draw(st.sampled_from([16, 64])), max_prefill_tokens=draw(st.integers(64, 8192)),
        gpu_memory_utilization=draw(st.sampled_from([0.8, 0.9, 0.95]))))
    hardware = dict(name="random", device_memory_bytes=1 << 40, hbm_bandwidth_bytes_per_s=10**12, num_sms=100,
                    compute_capability="9.0", cuda_graph_bytes=draw(st.sampled_from([0, 1 << 20])),
                    runtime_reserve=(dict(name="cuda_context", bytes=draw(st.sampled_from([0, 1 << 24]))),))
    # Place the device around the edge: the non-KV bytes, then from less than none to a few requests of KV.
    non_kv = Drafter(model, HardwareConfig.model_validate(hardware)).draft(serving).non_kv_bytes
    beside = _kv_token_bytes(model) * context * draw(st.floats(-0.3, 3.0))
    hardware["device_memory_bytes"] = max(1 << 26, int((non_kv + beside) / serving.gpu_memory_utilization))
    hardware = HardwareConfig.model_validate(hardware)
    return model, hardware, serving


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tight_configs())
def test_every_advised_value_fits_when_applied(case):
    model, hardware, serving = case
    try:
        build_plan(model, hardware, serving)
        return
    except (PlanDoesNotFit,) as error:
        advice = error.advice
    except ValueError:  # configs that do not go together (tp against the heads)
        return
    for pair in advice.pop("at_smaller_batch", []):  # the largest context at a smaller batch
        plan = build_plan(model, hardware, serving_with(serving, **pair))
        assert plan.capacity.max_concurrency >= 1
        with pytest.raises(PlanDoesNotFit):
            build_plan(model, hardware, serving_with(serving, **{**pair, "max_context": pair["max_context"] + 1}))
    for knob, value in advice.items():
        plan = build_plan(model, hardware, serving_with(serving, **{knob: value}))  # raises if it does not fit
        assert plan.capacity.max_concurrency >= 1, knob
    if "max_context" in advice:  # the largest: one more token does not fit
        with pytest.raises(PlanDoesNotFit):
            build_plan(model, hardware, serving_with(serving, max_context=advice["max_context"] + 1))
    if advice.get("gpu_memory_utilization", 0) - 0.01 > serving.gpu_memory_utilization:  # the smallest
        with pytest.raises(PlanDoesNotFit):
            lower = round(advice["gpu_memory_utilization"] - 0.01, 2)
            build_plan(model, hardware, serving_with(serving, gpu_memory_utilization=lower))
