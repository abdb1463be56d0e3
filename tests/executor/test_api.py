"""The Python API in the simulator: an LLM built from a plan serves what one built from the plan's model
name serves; an edited plan, prompts of the wrong type, a SamplingParams list of the wrong length and text
without a tokenizer are refused before anything runs; ids outside the vocabulary come back rejected."""

from __future__ import annotations

import pytest

from executor import LLM, SamplingParams
from executor.workload import RunError
from planner.errors import ConfigError

PARAMS = SamplingParams(max_new_tokens=2, temperature=0.9, top_k=20, seed=3)


@pytest.fixture(scope="module")
def by_name() -> LLM:
    return LLM("tiny-qwen3", hardware="cpu-sim", device="sim", random_weights=True, seed=4)


def test_an_llm_built_from_a_plan_serves_what_its_model_name_serves(by_name):
    from_plan = LLM(by_name.plan, device="sim", random_weights=True, seed=4)
    assert from_plan.plan == by_name.plan
    prompts = [[5, 6, 7], [8, 9, 300]]  # 300 is outside the 256-id vocabulary
    expected, outside = by_name.generate(prompts, PARAMS)
    got, _ = from_plan.generate(prompts, PARAMS)
    assert got.output_ids == expected.output_ids and len(got.output_ids) == 2
    assert got.text is None and got.finish_reason == "length" and got.prompt is None
    assert outside.finish_reason == "rejected" and "vocabulary" in outside.error and outside.output_ids == []
    assert by_name.report.rejected == 1 and by_name.report.requests == 2


def test_bad_inputs_are_refused_before_anything_runs(by_name):
    plan = by_name.plan
    edited = plan.model_copy(update={"capacity": plan.capacity.model_copy(update={"kv_pages": plan.capacity.kv_pages - 1})})
    with pytest.raises(ConfigError, match="capacity.kv_pages"):
        LLM(edited, device="sim", random_weights=True)
    with pytest.raises(TypeError, match="string or a list of ints"):
        by_name.generate([[1, 2], 3.5])
    with pytest.raises(RunError, match="2 SamplingParams for 1 prompts"):
        by_name.generate([[1, 2]], [PARAMS, PARAMS])
    with pytest.raises(RunError, match="needs a tokenizer"):
        by_name.generate("hello")
    with pytest.raises(RunError, match="needs a tokenizer"):
        by_name.chat([{"role": "user", "content": "hello"}])
    with pytest.raises(RunError, match="not both"):
        LLM("tiny-qwen3", hardware="cpu-sim", device="sim", random_weights=True, checkpoint="somewhere")
