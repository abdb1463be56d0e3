"""Committed JSON Schemas match the models, and every shipped config and plan validates."""

from __future__ import annotations

from pathlib import Path

import jsonschema
import pytest
import yaml

from planner.loader import load_hardware, load_model, load_serving
from planner.errors import ConfigError, PlanDoesNotFit
from planner.plan import build_plan
from planner.schema import MODELS, load_committed, schema_for

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("kind", list(MODELS))
def test_committed_schema_matches_the_models(kind):
    assert load_committed(kind) == schema_for(kind), f"schemas/{kind}.schema.json drifted: run python -m planner.schema"


@pytest.mark.parametrize("kind, folder", [("model", "models"), ("hardware", "hardware"), ("serving", "serving")])
def test_every_shipped_config_validates(kind, folder):
    schema = load_committed(kind)
    files = sorted((ROOT / "configs" / folder).glob("*.yaml"))
    assert files
    for path in files:
        jsonschema.validate(yaml.safe_load(path.read_text()), schema)


def test_plan_of_every_shipped_model_and_hardware_pair_validates():
    schema = jsonschema.Draft202012Validator(load_committed("plan"))
    fitted = 0
    for model_path in sorted((ROOT / "configs/models").glob("*.yaml")):
        model = load_model(str(model_path))
        for hardware_path in sorted((ROOT / "configs/hardware").glob("*.yaml")):
            serving = load_serving("sim" if hardware_path.stem == "cpu-sim" else "default",
                                   {"max_context": min(8192, model.max_position_embeddings)})
            try:
                plan = build_plan(model, load_hardware(str(hardware_path)), serving)
            except PlanDoesNotFit:
                continue
            schema.validate(plan.model_dump(mode="json"))
            fitted += 1
    assert fitted >= 40


def test_the_serving_schema_takes_token_counts_where_the_loader_does():
    """``8k`` in every token-count field loads and validates against the committed schema alike."""
    text = "max_prefill_tokens: 8k\nmax_prefill_tokens_beside_decode: 1k\nmax_step_tokens: 8.2k\nmax_batch: 256\n"
    jsonschema.validate(yaml.safe_load(text), load_committed("serving"))
    serving = load_serving("default", yaml.safe_load(text))
    assert (serving.max_prefill_tokens, serving.max_prefill_tokens_beside_decode, serving.max_step_tokens) == (
        8000, 1000, 8200)


def test_vllm_batched_tokens_are_the_chunk_and_the_step_by_key_schema_and_keyword():
    """vLLM's max_num_batched_tokens, as a YAML key (schema and loader) and as a keyword override (what
    ``LLM(..., max_num_batched_tokens=...)`` passes), sets both fields; with either field beside it the
    schema and the loader refuse it."""
    schema = load_committed("serving")
    jsonschema.validate({"max_num_batched_tokens": "4k", "max_batch": 8}, schema)
    for field in ("max_prefill_tokens", "max_step_tokens"):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({"max_num_batched_tokens": 4000, field: 4000}, schema)
    serving = load_serving(None, {"max_num_batched_tokens": 4000, "max_batch": 8})
    assert (serving.max_prefill_tokens, serving.max_step_tokens) == (4000, 4000)
    with pytest.raises(ConfigError, match="sets max_step_tokens"):
        load_serving(None, {"max_num_batched_tokens": 4000, "max_step_tokens": 4000})
