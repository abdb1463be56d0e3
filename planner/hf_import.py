"""Translate a Hugging Face ``config.json`` into a ``ModelConfig``.

Accepted: model_type ``qwen3``; ``qwen3_5_text``; ``qwen3_5`` (the multimodal
wrapper, whose text stack sits under ``text_config``). Fields we do not model
are ignored; fields we model but do not support (attention bias, another
activation) are errors, so a checkpoint never loads into the wrong math.
"""

from __future__ import annotations

from typing import Any

from planner.config import ModelConfig
from planner.errors import ConfigError

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_5", "qwen3_5_text")


def model_from_hf_config(config: dict[str, Any], name: str) -> ModelConfig:
    """A ``ModelConfig`` from an HF config dict; raises ConfigError naming the field."""
    from planner.loader import validate  # local: loader imports this module

    source = "config.json"
    if not isinstance(config, dict):
        raise ConfigError(source, "", config, "expected a JSON object of fields at the top level")
    model_type = config.get("model_type")
    if model_type == "qwen3_5":
        if not isinstance(config.get("text_config"), dict):
            raise ConfigError(source, "text_config", config.get("text_config"), "qwen3_5 needs a text_config mapping")
        text = {**config["text_config"]}
        text.setdefault("tie_word_embeddings", config.get("tie_word_embeddings", False))
        text.setdefault("dtype", config.get("dtype", config.get("torch_dtype")))
        return model_from_hf_config({**text, "model_type": "qwen3_5_text"}, name)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(source, "model_type", model_type, f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    _require_unsupported_off(config, source)
    fields = _common_fields(config, source, name)
    if model_type == "qwen3_5_text":
        fields.update(_qwen3_5_fields(config, source))
    else:
        fields["architecture"] = "qwen3"
    return validate(ModelConfig, fields, source)


def _common_fields(config: dict[str, Any], source: str, name: str) -> dict[str, Any]:
    if "head_dim" not in config:
        raise ConfigError(source, "head_dim", None, "must be given explicitly (never derived from hidden/heads)")
    rope = config.get("rope_parameters")
    if rope is None:
        rope = {}
    elif not isinstance(rope, dict):
        raise ConfigError(source, "rope_parameters", rope, "expected a mapping (rope_theta, partial_rotary_factor)")
    fields = {
        "name": name,
        "hidden_size": config.get("hidden_size"),
        "num_layers": config.get("num_hidden_layers"),
        "intermediate_size": config.get("intermediate_size"),
        "num_attention_heads": config.get("num_attention_heads"),
        "num_key_value_heads": config.get("num_key_value_heads", config.get("num_attention_heads")),
        "head_dim": config["head_dim"],
        "vocab_size": config.get("vocab_size"),
        "max_position_embeddings": config.get("max_position_embeddings"),
        "rms_norm_eps": config.get("rms_norm_eps", 1e-6),
        "rope_theta": rope.get("rope_theta", config.get("rope_theta", 1_000_000.0)),
        "partial_rotary_factor": rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)),
        "tie_word_embeddings": bool(config.get("tie_word_embeddings", False)),
        "dtype": config.get("dtype") or config.get("torch_dtype") or "bfloat16",
    }
    return fields


def _qwen3_5_fields(config: dict[str, Any], source: str) -> dict[str, Any]:
    num_layers = config.get("num_hidden_layers")
    layer_types = config.get("layer_types")
    if layer_types is None and isinstance(num_layers, int):
        interval = config.get("full_attention_interval", 4)
        if not (isinstance(interval, int) and not isinstance(interval, bool) and interval >= 1):
            raise ConfigError(source, "full_attention_interval", interval,
                              "expected an int >= 1 (every n-th layer is full attention)")
        layer_types = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)
        ]
    return {
        "architecture": "qwen3_5",
        "attn_output_gate": bool(config.get("attn_output_gate", True)),
        "layer_types": layer_types,
        "linear_attention": {
            "num_key_heads": config.get("linear_num_key_heads"),
            "num_value_heads": config.get("linear_num_value_heads"),
            "key_head_dim": config.get("linear_key_head_dim"),
            "value_head_dim": config.get("linear_value_head_dim"),
            "conv_kernel_size": config.get("linear_conv_kernel_dim", 4),
        },
    }


def _require_unsupported_off(config: dict[str, Any], source: str) -> None:
    if config.get("attention_bias", False):
        raise ConfigError(source, "attention_bias", True, "attention bias is not supported")
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(source, "hidden_act", act, "only silu (SwiGLU) is supported")
