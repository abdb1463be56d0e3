"""HF config.json import: qwen3, qwen3_5_text, and qwen3_5 with a nested text_config."""

from __future__ import annotations

import json

import pytest

from planner.errors import ConfigError
from planner.loader import load_model
from tests.hf_reference import hf_config_dict


@pytest.mark.parametrize("name", ["qwen3-8b", "qwen3-0.6b", "qwen3.5-27b", "tiny-qwen3.5-g6"])
def test_import_round_trips_a_shipped_model(tmp_path, name):
    model = load_model(name)
    data = hf_config_dict(model)
    data["dtype"] = model.dtype
    (tmp_path / "config.json").write_text(json.dumps(data))
    imported = load_model(str(tmp_path))
    assert imported.model_dump(exclude={"name"}) == model.model_dump(exclude={"name"})


def test_transformers_save_pretrained_config_imports(tmp_path):
    pytest.importorskip("transformers")
    from tests.hf_reference import hf_config

    model = load_model("tiny-qwen3.5")
    hf_config(model).save_pretrained(tmp_path)
    imported = load_model(str(tmp_path / "config.json"))
    assert imported.layer_types == model.layer_types
    assert imported.linear_attention == model.linear_attention
    assert imported.rotary_dim == model.rotary_dim


def test_multimodal_wrapper_reads_text_config(tmp_path):
    text = hf_config_dict(load_model("qwen3.5-9b"))
    wrapper = {"model_type": "qwen3_5", "text_config": text, "vision_config": {"depth": 27},
               "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(wrapper))
    model = load_model(str(tmp_path / "config.json"))
    assert model.architecture == "qwen3_5" and model.num_layers == 32


@pytest.mark.parametrize(
    ("change", "field"),
    [({"model_type": "llama"}, "model_type"), ({"attention_bias": True}, "attention_bias"),
     ({"head_dim": None}, "head_dim"), ({"num_attention_heads": 30}, "")],
)
def test_unsupported_or_inconsistent_config_is_a_config_error(tmp_path, change, field):
    data = hf_config_dict(load_model("qwen3-8b"))
    data.update(change)
    if change.get("head_dim", 1) is None:
        del data["head_dim"]
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError) as error:
        load_model(str(tmp_path / "config.json"))
    assert str(tmp_path / "config.json") in str(error.value)
    assert field in error.value.field
