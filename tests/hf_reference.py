"""Build Hugging Face reference models from memplan model configs (tests only)."""

from __future__ import annotations

from typing import Any

from planner.config import ModelConfig


def hf_config_dict(model: ModelConfig) -> dict[str, Any]:
    """The HF config.json contents of ``model`` (what save_pretrained would write)."""
    common = {
        "hidden_size": model.hidden_size,
        "num_hidden_layers": model.num_layers,
        "intermediate_size": model.intermediate_size,
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.num_key_value_heads,
        "head_dim": model.head_dim,
        "vocab_size": model.vocab_size,
        "max_position_embeddings": model.max_position_embeddings,
        "rms_norm_eps": model.rms_norm_eps,
        "tie_word_embeddings": model.tie_word_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
    }
    if model.architecture == "qwen3":
        return {**common, "model_type": "qwen3",
                "rope_parameters": {"rope_type": "default", "rope_theta": model.rope_theta}}
    from planner.config import LinearAttentionConfig

    # HF wants linear-attention fields even when no layer uses them.
    lin = model.linear_attention or LinearAttentionConfig(num_key_heads=1, num_value_heads=1, key_head_dim=8,
                                                          value_head_dim=8)
    half = model.rotary_dim // 2  # mrope sections must sum to rotary_dim / 2
    return {
        **common,
        "model_type": "qwen3_5_text",
        "layer_types": list(model.kinds),
        "linear_num_key_heads": lin.num_key_heads,
        "linear_num_value_heads": lin.num_value_heads,
        "linear_key_head_dim": lin.key_head_dim,
        "linear_value_head_dim": lin.value_head_dim,
        "linear_conv_kernel_dim": lin.conv_kernel_size,
        "mamba_ssm_dtype": "float32",
        "rope_parameters": {
            "rope_type": "default", "rope_theta": model.rope_theta,
            "partial_rotary_factor": model.partial_rotary_factor,
            "mrope_section": [half - 2 * (half // 3), half // 3, half // 3],
        },
    }


def hf_config(model: ModelConfig):
    """A transformers config object for ``model``."""
    from transformers import Qwen3_5TextConfig, Qwen3Config

    data = hf_config_dict(model)
    kind = data.pop("model_type")
    return (Qwen3Config if kind == "qwen3" else Qwen3_5TextConfig)(**data)


def hf_model(model: ModelConfig, *, device: str = "cpu", dtype=None, seed: int = 0):
    """A randomly initialised HF causal LM of ``model``'s shape (``device='meta'`` allocates nothing)."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3ForCausalLM

    config = hf_config(model)
    cls = Qwen3ForCausalLM if model.architecture == "qwen3" else Qwen3_5ForCausalLM
    torch.manual_seed(seed)
    with torch.device(device):
        module = cls(config)
    if dtype is not None:
        module = module.to(dtype)
    return module.eval()
