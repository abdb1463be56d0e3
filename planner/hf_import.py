"""Translate a Hugging Face ``config.json`` into a ``ModelConfig``.

Accepted: model_type ``qwen3``; ``qwen3_5_text``; ``qwen3_5`` (the multimodal
wrapper, whose text stack sits under ``text_config``: the plan is text-only and
names the vision tower it leaves out, with its bytes). A field that changes the
memory or the maths is modelled or refused with an error naming it, so a
checkpoint never plans or loads into the wrong math: quantized weights, RoPE
scaling (YaRN, linear, dynamic, ...), sliding-window attention, attention bias,
another activation, an audio tower, a boolean written as a string, a recurrent
state (``mamba_ssm_dtype``) in another dtype than float32. Fields that change
neither (token ids, initializer ranges) are ignored.
"""

from __future__ import annotations

from typing import Any

from planner import checked
from planner.config import MAX_LAYERS, ModelConfig
from planner.dtypes import dtype_bytes
from planner.errors import ConfigError

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_5", "qwen3_5_text")
#: RoPE types that are plain RoPE for text (mrope: Qwen3.5's multimodal RoPE, whose three position
#: components are equal for text tokens).
PLAIN_ROPE_TYPES = ("default", "mrope")
#: HF boolean fields memplan reads; each must be a JSON boolean ("false" is a non-empty, truthy string).
BOOLEAN_FIELDS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window", "attn_output_gate")
#: ModelConfig's names of the fields an HF config names otherwise: errors name the file's field.
HF_NAMES = {"num_layers": "num_hidden_layers", "rope_theta": "rope_parameters.rope_theta",
            "partial_rotary_factor": "rope_parameters.partial_rotary_factor",
            "linear_attention.num_key_heads": "linear_num_key_heads",
            "linear_attention.num_value_heads": "linear_num_value_heads",
            "linear_attention.key_head_dim": "linear_key_head_dim",
            "linear_attention.value_head_dim": "linear_value_head_dim",
            "linear_attention.conv_kernel_size": "linear_conv_kernel_dim"}
#: The dtype memplan keeps the linear-attention state in (Qwen3.5's ``mamba_ssm_dtype``, float32 in its
#: checkpoints): the delta rule accumulates into it, and the planner sizes it at 4 bytes an element.
RECURRENT_STATE_DTYPE = "float32"
#: Bounds of a vision tower left out of the plan: each size field, and the parameters the plan names
#: (OmittedTower.parameters).
MAX_VISION_FIELD = 1 << 20
MAX_TOWER_PARAMETERS = 1 << 40
#: transformers' Qwen3_5VisionConfig defaults, for fields a vision_config leaves out.
VISION_DEFAULTS = {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "in_channels": 3, "patch_size": 16,
                   "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 3584,
                   "num_position_embeddings": 2304}


def model_from_hf_config(config: dict[str, Any], name: str) -> ModelConfig:
    """A ``ModelConfig`` from an HF config dict; raises ConfigError naming the field."""
    from planner.loader import validate  # local: loader imports this module

    source = "config.json"
    if not isinstance(config, dict):
        raise ConfigError(source, "", config, "expected a JSON object of fields at the top level")
    fields = _model_fields(config, source, name)
    try:
        return validate(ModelConfig, fields, source)
    except ConfigError as error:  # name the field as the file names it
        wrapped = config.get("model_type") == "qwen3_5"
        prefix, text = ("text_config.", config["text_config"]) if wrapped else ("", config)
        field = HF_NAMES.get(error.field, error.field)
        if field == "dtype":  # the key the file wrote it under: the text stack's, else the wrapper's
            prefix, field = (prefix, _dtype_key(text)) if _dtype_key(text) else ("", _dtype_key(config) or field)
        raise ConfigError(error.source, prefix + field, error.value, error.rule) from None


def _model_fields(config: dict[str, Any], source: str, name: str) -> dict[str, Any]:
    model_type = config.get("model_type")
    if model_type == "qwen3_5":
        return _wrapper_fields(config, source, name)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(source, "model_type", model_type, f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    _refuse_unmodelled(config, source)
    fields = _common_fields(config, source, name)
    if model_type == "qwen3_5_text":
        fields.update(_qwen3_5_fields(config, source))
    else:
        layer_types = config.get("layer_types")
        if layer_types is not None and not (isinstance(layer_types, list)
                                            and all(isinstance(kind, str) for kind in layer_types)):
            raise ConfigError(source, "layer_types", layer_types, "expected a list of layer kinds (strings)")
        if layer_types is not None and any(kind != "full_attention" for kind in layer_types):
            raise ConfigError(source, "layer_types", sorted(set(layer_types)),
                              "qwen3 layers other than full_attention (sliding windows) are not modelled")
        fields["architecture"] = "qwen3"
    return fields


def _dtype_key(config: dict[str, Any]) -> str | None:
    """The key ``config`` gives its dtype under (dtype before torch_dtype), None for neither."""
    return next((key for key in ("dtype", "torch_dtype") if config.get(key) is not None), None)


def _wrapper_fields(config: dict[str, Any], source: str, name: str) -> dict[str, Any]:
    """qwen3_5: the text stack of ``text_config``, and the towers beside it left out."""
    if not isinstance(config.get("text_config"), dict):
        raise ConfigError(source, "text_config", config.get("text_config"), "qwen3_5 needs a text_config mapping")
    for field in BOOLEAN_FIELDS:
        _boolean(config, field, False, source)
    if config.get("quantization_config") is not None:
        _refuse_quantization(config["quantization_config"], "quantization_config", source)
    _recurrent_state_dtype(config, source)
    if config.get("audio_config") is not None:
        raise ConfigError(source, "audio_config", "{...}", "an audio tower memplan cannot size; the text stack of a "
                          "config without it can be planned")
    text = {**config["text_config"]}
    text.setdefault("tie_word_embeddings", config.get("tie_word_embeddings", False))
    outer = config[_dtype_key(config)] if _dtype_key(config) else None
    inner = text[_dtype_key(text)] if _dtype_key(text) else None
    if outer is not None and inner is not None and outer != inner:
        raise ConfigError(source, "dtype", outer, f"differs from text_config's dtype {inner!r}: which one the "
                          "text stack loads in is ambiguous")
    text.setdefault("dtype", outer)
    try:
        fields = _model_fields({**text, "model_type": "qwen3_5_text"}, source, name)
    except ConfigError as error:
        raise ConfigError(source, f"text_config.{error.field}" if error.field else "text_config", error.value,
                          error.rule) from None
    vision = config.get("vision_config")
    if vision is not None:
        if not isinstance(vision, dict):
            raise ConfigError(source, "vision_config", vision, "must be a mapping")
        parameters = vision_tower_parameters(vision, source)
        if parameters > MAX_TOWER_PARAMETERS:
            raise ConfigError(source, "vision_config", f"{parameters:,} parameters",
                              f"a vision tower of at most {MAX_TOWER_PARAMETERS:,} parameters is sized")
        fields["omitted_towers"] = [{
            "config_field": "vision_config", "parameters": parameters,
            "bytes": checked.mul("vision tower bytes", parameters, dtype_bytes(fields["dtype"]), width=checked.U64),
        }]
    return fields


def vision_tower_parameters(vision: dict[str, Any], source: str = "config.json") -> int:
    """Parameters of a Qwen3.5 vision tower (Qwen3_5VisionModel): patch embedding (Conv3d with bias),
    learned position embedding, ``depth`` blocks (two LayerNorms, qkv and proj with bias, a two-layer MLP
    with bias), and the patch merger (LayerNorm, two linear layers with bias)."""
    unknown = [key for key in ("deepstack_visual_indexes",) if vision.get(key)]
    if unknown:
        raise ConfigError(source, f"vision_config.{unknown[0]}", vision[unknown[0]],
                          "a vision tower with deepstack mergers memplan cannot size")
    size = {}
    for key, default in VISION_DEFAULTS.items():
        value = vision.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(source, f"vision_config.{key}", value, "must be a positive integer")
        if value > MAX_VISION_FIELD:
            raise ConfigError(source, f"vision_config.{key}", value, f"must be at most {MAX_VISION_FIELD:,}")
        size[key] = value
    h, inner, out = size["hidden_size"], size["intermediate_size"], size["out_hidden_size"]
    kernel = size["in_channels"] * size["temporal_patch_size"] * size["patch_size"] ** 2
    merged = h * size["spatial_merge_size"] ** 2
    block = 2 * 2 * h + (h * 3 * h + 3 * h) + (h * h + h) + (h * inner + inner) + (inner * h + h)
    parts = (
        kernel * h + h,  # patch_embed.proj
        size["num_position_embeddings"] * h,  # pos_embed
        size["depth"] * block,  # blocks
        2 * h + (merged * merged + merged) + (merged * out + out),  # merger
    )
    return checked.add("vision tower parameters", *parts, width=checked.U64)


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
        "tie_word_embeddings": _boolean(config, "tie_word_embeddings", False, source),
        "dtype": config[_dtype_key(config)] if _dtype_key(config) else "bfloat16",
    }
    return fields


def _qwen3_5_fields(config: dict[str, Any], source: str) -> dict[str, Any]:
    num_layers = config.get("num_hidden_layers")
    layer_types = config.get("layer_types")
    if layer_types is None and isinstance(num_layers, int) and 1 <= num_layers <= MAX_LAYERS:
        interval = config.get("full_attention_interval", 4)
        if not (isinstance(interval, int) and not isinstance(interval, bool) and interval >= 1):
            raise ConfigError(source, "full_attention_interval", interval,
                              "expected an int >= 1 (every n-th layer is full attention)")
        layer_types = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)
        ]
    return {
        "architecture": "qwen3_5",
        "attn_output_gate": _boolean(config, "attn_output_gate", True, source),
        "layer_types": layer_types,
        "linear_attention": {
            "num_key_heads": config.get("linear_num_key_heads"),
            "num_value_heads": config.get("linear_num_value_heads"),
            "key_head_dim": config.get("linear_key_head_dim"),
            "value_head_dim": config.get("linear_value_head_dim"),
            "conv_kernel_size": config.get("linear_conv_kernel_dim", 4),
        },
    }


def _refuse_unmodelled(config: dict[str, Any], source: str) -> None:
    """Fields that change the memory or the maths and that memplan does not model."""
    for field in BOOLEAN_FIELDS:
        _boolean(config, field, False, source)
    if config.get("quantization_config") is not None:
        _refuse_quantization(config["quantization_config"], "quantization_config", source)
    for field in ("rope_scaling", "rope_parameters"):
        rope = config.get(field)
        if rope is None:
            continue
        if not isinstance(rope, dict):
            raise ConfigError(source, field, rope, "must be a mapping")
        key = "rope_type" if "rope_type" in rope else "type"
        kind = rope.get(key, "default")
        if kind not in PLAIN_ROPE_TYPES:
            raise ConfigError(source, f"{field}.{key}", kind, "RoPE scaling is not modelled (the planner and the "
                              "executor compute plain RoPE); without it the model serves up to its "
                              "original_max_position_embeddings")
    if config.get("use_sliding_window", False):
        raise ConfigError(source, "use_sliding_window", True, "sliding-window attention is not modelled")
    _recurrent_state_dtype(config, source)
    if config.get("attention_bias", False):
        raise ConfigError(source, "attention_bias", True, "attention bias is not supported")
    if config.get("mlp_bias", False):
        raise ConfigError(source, "mlp_bias", True, "MLP bias is not supported")
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(source, "hidden_act", act, "only silu (SwiGLU) is supported")


def _recurrent_state_dtype(config: dict[str, Any], source: str) -> None:
    """``mamba_ssm_dtype``: absent or float32, the dtype memplan plans and runs the recurrent state in."""
    value = config.get("mamba_ssm_dtype")
    if value is not None and value != RECURRENT_STATE_DTYPE:
        raise ConfigError(source, "mamba_ssm_dtype", value, f"the recurrent state is planned and run in "
                          f"{RECURRENT_STATE_DTYPE} only (4 bytes an element); another dtype is not modelled")


def _refuse_quantization(quantization: Any, field: str, source: str) -> None:
    method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else quantization
    raise ConfigError(source, field, method, "quantized weights are not modelled: memplan plans and loads "
                      "bfloat16, float16 or float32 weights; use the unquantized checkpoint")


def _boolean(config: dict[str, Any], field: str, default: bool, source: str) -> bool:
    """``config[field]`` as a JSON boolean (``default`` when absent or null); a string such as "false" is
    refused rather than read as True."""
    value = config.get(field)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConfigError(source, field, value, "must be a JSON boolean (true or false)")
    return value
