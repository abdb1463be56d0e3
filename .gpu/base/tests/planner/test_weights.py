"""The weights pool against HF transformers' own models (an independent count)."""

from __future__ import annotations

import pytest

from planner.loader import load_model, load_serving
from planner.geometry import build_geometry
from planner.weights import build_weights
from tests.hf_reference import hf_model
from tests.planner.conftest import REAL_MODELS, TINY_MODELS

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


def _planned(name: str, tp: int = 1):
    model = load_model(name)
    geometry = build_geometry(model, load_serving("default", {"tensor_parallel_size": tp}))
    return model, build_weights(geometry, model.dtype, model.tie_word_embeddings)


@pytest.mark.parametrize("name", TINY_MODELS)
def test_tiny_weights_equal_hf_state_dict(name):
    model, pool = _planned(name)
    reference = hf_model(model, device="meta").state_dict()
    if model.tie_word_embeddings:
        reference.pop("lm_head.weight")  # tied: HF lists the embedding twice, the checkpoint stores it once
    planned = {b.name: b.shape for b in pool.buffers}
    assert planned == {k: tuple(v.shape) for k, v in reference.items()}


@pytest.mark.parametrize("name", REAL_MODELS)
def test_real_parameter_counts_equal_hf(name):
    model, pool = _planned(name)
    reference = hf_model(model, device="meta")
    # parameters() lists a tied matrix once, as the checkpoint stores it.
    expected = sum(p.numel() for p in reference.parameters())
    planned = sum(b.bytes // {"bfloat16": 2, "float32": 4}[b.dtype] for b in pool.buffers)
    assert planned == expected


def test_qwen3_8b_parameter_count_is_the_public_figure():
    _, pool = _planned("qwen3-8b")
    assert sum(b.bytes // 2 for b in pool.buffers) == 8_190_735_360


def test_fused_views_cover_their_parts_contiguously():
    _, pool = _planned("qwen3.5-4b")
    by_name = {b.name: b for b in pool.buffers}
    for view in pool.fused:
        parts = [by_name[p] for p in view.parts]
        assert parts[0].offset == view.offset
        for before, after in zip(parts, parts[1:]):
            assert before.offset + before.bytes == after.offset
        assert sum(p.shape[0] for p in parts) == view.shape[0]
        assert all(p.shape[1:] == view.shape[1:] for p in parts)


def test_tensor_parallel_shards_heads_and_replicates_kv():
    _, pool = _planned("qwen3-8b", tp=16)  # 32 q heads, 8 kv heads: kv heads replicate
    q = pool.buffer("model.layers.0.self_attn.q_proj.weight")
    k = pool.buffer("model.layers.0.self_attn.k_proj.weight")
    embed = pool.buffer("model.embed_tokens.weight")
    assert q.shape == (2 * 128, 4096)
    assert k.shape == (1 * 128, 4096)
    assert embed.shape == (151936 // 16, 4096)
