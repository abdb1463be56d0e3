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


REFUSED = {
    "fp8 quantization": ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
                         "quantization_config"),
    "yarn rope_scaling": ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                            "original_max_position_embeddings": 32768}}, "rope_scaling.rope_type"),
    "legacy rope_scaling type": ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling.type"),
    "yarn rope_parameters": ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}},
                             "rope_parameters.rope_type"),
    "sliding window": ({"use_sliding_window": True, "sliding_window": 4096}, "use_sliding_window"),
    "sliding layer types": ({"layer_types": ["sliding_attention"] * 36}, "layer_types"),
    "string boolean": ({"tie_word_embeddings": "false"}, "tie_word_embeddings"),
    "string bias": ({"attention_bias": "false"}, "attention_bias"),
    "bfloat16 recurrent state": ({"mamba_ssm_dtype": "bfloat16"}, "mamba_ssm_dtype"),
    "layer kinds that are not strings": ({"layer_types": [None, 1]}, "layer_types"),
    "layer kinds that are lists": ({"layer_types": [[1]]}, "layer_types"),
    "layer kinds that are not a list": ({"layer_types": "full_attention"}, "layer_types"),
    "a falsy dtype": ({"dtype": 0}, "dtype"),
    "an empty torch_dtype": ({"torch_dtype": ""}, "torch_dtype"),
}


@pytest.mark.parametrize("case", REFUSED, ids=list(REFUSED))
def test_a_field_that_changes_memory_or_maths_is_refused_naming_it(tmp_path, capsys, case):
    from planner.cli import main

    change, field = REFUSED[case]
    data = {**hf_config_dict(load_model("qwen3-8b")), **change}
    (tmp_path / "config.json").write_text(json.dumps(data))
    code = main(["plan", "--model", str(tmp_path), "--format", "json"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err
    assert f"{tmp_path / 'config.json'}: {field} = " in err


def test_a_multimodal_wrappers_refusals_name_the_nested_field(tmp_path):
    text = {**hf_config_dict(load_model("qwen3.5-9b")), "rope_parameters": {"rope_type": "yarn", "factor": 2.0}}
    for wrapper, field in (({"text_config": text}, "text_config.rope_parameters.rope_type"),
                           ({"text_config": hf_config_dict(load_model("qwen3.5-9b")), "audio_config": {}},
                            "audio_config"),
                           ({"text_config": hf_config_dict(load_model("qwen3.5-9b")),
                             "quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
                           ({"text_config": {**hf_config_dict(load_model("qwen3.5-9b")), "mamba_ssm_dtype": "float16"}},
                            "text_config.mamba_ssm_dtype"),
                           ({"text_config": hf_config_dict(load_model("qwen3.5-9b")), "mamba_ssm_dtype": "bfloat16"},
                            "mamba_ssm_dtype"),
                           ({"text_config": {**hf_config_dict(load_model("qwen3.5-9b")), "dtype": "bfloat16"},
                             "dtype": "int8"}, "dtype"),
                           ({"text_config": hf_config_dict(load_model("qwen3.5-9b")), "vision_config": {"depth": 2**70}},
                            "vision_config.depth"),
                           ({"text_config": hf_config_dict(load_model("qwen3.5-9b")),
                             "vision_config": {"depth": 1 << 20, "hidden_size": 1 << 20, "intermediate_size": 1 << 20}},
                            "vision_config")):
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5", **wrapper}))
        with pytest.raises(ConfigError) as error:
            load_model(str(tmp_path))
        assert error.value.field == field


def test_a_layer_count_past_the_bound_is_named_without_listing_its_layers(tmp_path):
    """A qwen3_5_text config without layer_types lists its kinds from num_hidden_layers: 2**70 layers are
    refused by the bound, not listed."""
    data = {key: value for key, value in hf_config_dict(load_model("qwen3.5-9b")).items() if key != "layer_types"}
    (tmp_path / "config.json").write_text(json.dumps({**data, "num_hidden_layers": 2**70}))
    with pytest.raises(ConfigError) as error:
        load_model(str(tmp_path))
    assert error.value.field == "num_hidden_layers" and "1024" in error.value.rule


@pytest.mark.parametrize("change, field", [({"num_hidden_layers": 5000}, "num_hidden_layers"),
                                           ({"linear_num_key_heads": 0}, "linear_num_key_heads"),
                                           ({"num_hidden_layers": 3}, "layer_types"),
                                           ({"torch_dtype": 5}, "torch_dtype"), ({"dtype": "float64"}, "dtype")])
def test_an_hf_config_error_names_the_field_as_the_file_does(tmp_path, change, field):
    data = {**hf_config_dict(load_model("qwen3.5-9b")), **change}
    for config, prefix in ((data, ""), ({"model_type": "qwen3_5", "text_config": data}, "text_config.")):
        (tmp_path / "config.json").write_text(json.dumps(config))
        with pytest.raises(ConfigError) as error:
            load_model(str(tmp_path))
        assert error.value.field == prefix + field


def test_plain_rope_and_mrope_parameters_are_accepted(tmp_path):
    data = hf_config_dict(load_model("qwen3-8b"))
    data.update(rope_scaling=None, use_sliding_window=False, sliding_window=None,
                layer_types=["full_attention"] * 36, tie_word_embeddings=False)
    (tmp_path / "config.json").write_text(json.dumps(data))
    assert load_model(str(tmp_path)).model_dump(exclude={"name"}) == load_model("qwen3-8b").model_dump(exclude={"name"})


VISION = {"depth": 3, "hidden_size": 64, "intermediate_size": 96, "num_heads": 4, "out_hidden_size": 4096,
          "num_position_embeddings": 16, "patch_size": 4, "spatial_merge_size": 2, "temporal_patch_size": 2}


@pytest.mark.parametrize("vision", [VISION, {}], ids=["small", "transformers-defaults"])
def test_a_vision_tower_is_left_out_and_counted_like_transformers(tmp_path, vision):
    torch = pytest.importorskip("torch")
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5VisionConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

    with torch.device("meta"):
        reference = sum(p.numel() for p in Qwen3_5VisionModel(Qwen3_5VisionConfig(**vision)).parameters())
    wrapper = {"model_type": "qwen3_5", "text_config": hf_config_dict(load_model("qwen3.5-9b")),
               "vision_config": vision, "dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(wrapper))
    (tower,) = load_model(str(tmp_path)).omitted_towers
    assert (tower.config_field, tower.parameters, tower.bytes) == ("vision_config", reference, 2 * reference)


def test_the_table_says_what_a_text_only_plan_left_out(tmp_path, capsys):
    from planner.cli import main

    wrapper = {"model_type": "qwen3_5", "text_config": hf_config_dict(load_model("qwen3.5-9b")), "vision_config": {}}
    (tmp_path / "config.json").write_text(json.dumps(wrapper))
    assert main(["plan", "--model", str(tmp_path), "--format", "table"]) == 0
    assert "text-only: vision_config left out (453,650,672 parameters, 865.270 MiB); neither planned nor loaded" \
        in capsys.readouterr().out
