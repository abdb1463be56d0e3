"""Loading an HF checkpoint into the planned weight views."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from executor.arena import materialize
from executor.device import open_device
from executor.weights import WeightsError, fill_random, load_checkpoint
from planner.loader import load_hardware, load_model, load_serving
from planner.plan import build_plan
from tests.hf_reference import hf_model


def _arena(name: str):
    plan = build_plan(load_model(name), load_hardware("cpu-sim"), load_serving("sim"))
    return materialize(plan, open_device("auto"))


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen3.5"])
def test_save_pretrained_checkpoint_loads_into_every_view(tmp_path, name):
    hf = hf_model(load_model(name), seed=7)
    hf.save_pretrained(tmp_path)
    arena = _arena(name)
    loaded = load_checkpoint(arena, tmp_path)
    assert loaded == arena.plan.pool("weights").bytes - _padding(arena.plan.pool("weights"))
    for key, tensor in hf.state_dict().items():
        if key == "lm_head.weight" and arena.plan.model.tie_word_embeddings:
            continue
        assert torch.equal(arena.tensor("weights", key), tensor.to(arena.tensor("weights", key).dtype)), key


def _padding(pool) -> int:
    return pool.bytes - sum(b.bytes for b in pool.buffers)


def _broken_checkpoint(tmp_path, edit):
    hf = hf_model(load_model("tiny-qwen3"), seed=1)
    hf.save_pretrained(tmp_path)
    path = next(tmp_path.glob("*.safetensors"))
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return tmp_path


def test_missing_unexpected_and_misshaped_tensors_are_listed_together(tmp_path):
    def edit(tensors):
        del tensors["model.layers.1.mlp.up_proj.weight"]
        tensors["model.layers.0.extra.weight"] = torch.zeros(3)
        tensors["model.norm.weight"] = torch.zeros(65)

    arena = _arena("tiny-qwen3")
    before = arena.pools["weights"].clone()
    with pytest.raises(WeightsError) as error:
        load_checkpoint(arena, _broken_checkpoint(tmp_path, edit))
    message = str(error.value)
    assert "missing: model.layers.1.mlp.up_proj.weight" in message
    assert "unexpected: model.layers.0.extra.weight" in message
    assert "mis-shaped: model.norm.weight [65] (planned [64])" in message
    assert torch.equal(before, arena.pools["weights"])  # nothing written


def test_multimodal_wrapper_names_map_to_the_text_model(tmp_path):
    hf = hf_model(load_model("tiny-qwen3.5"), seed=2)
    state = {k.replace("model.", "model.language_model.", 1): v for k, v in hf.state_dict().items()}
    state["model.visual.blocks.0.weight"] = torch.zeros(2)
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    arena = _arena("tiny-qwen3.5")
    load_checkpoint(arena, tmp_path)
    assert torch.equal(arena.tensor("weights", "model.norm.weight"), hf.state_dict()["model.norm.weight"])


def test_random_weights_fill_every_view_deterministically():
    first, second = _arena("tiny-qwen3.5-g6"), _arena("tiny-qwen3.5-g6")
    fill_random(first, seed=3)
    fill_random(second, seed=3)
    assert torch.equal(first.pools["weights"], second.pools["weights"])
    for buffer in first.plan.pool("weights").buffers:
        assert torch.isfinite(first.tensor("weights", buffer.name)).all(), buffer.name
