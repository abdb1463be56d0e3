"""Loading an HF checkpoint into the planned weight views."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from executor.arena import materialize
from executor.device import open_device
from executor.checkpoint_checks import CheckpointError
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


def test_sharded_checkpoint_loads_through_its_index(tmp_path):
    hf = hf_model(load_model("tiny-qwen3"), seed=4)
    hf.save_pretrained(tmp_path, max_shard_size="60KB")
    shards = sorted(tmp_path.glob("*.safetensors"))
    assert len(shards) > 3 and (tmp_path / "model.safetensors.index.json").exists()
    save_file({"model.norm.weight": torch.full((64,), 9.0)}, str(tmp_path / "stale.safetensors"))  # not indexed
    arena = _arena("tiny-qwen3")
    load_checkpoint(arena, tmp_path)
    for key, tensor in hf.state_dict().items():
        assert torch.equal(arena.tensor("weights", key), tensor), key


def test_a_sharded_multimodal_checkpoint_serves_its_text_weights(tmp_path):
    """Qwen3.5's wrapper: model.language_model.* in shards named by an index, a vision tower and MTP
    weights beside them, a bf16 checkpoint cast into the float32 plan."""
    import json

    hf = hf_model(load_model("tiny-qwen3.5"), seed=6)
    state = {k.replace("model.", "model.language_model.", 1): v.to(torch.bfloat16) for k, v in hf.state_dict().items()}
    state["model.visual.patch_embed.weight"] = torch.zeros(4, 3)
    state["mtp.fc.weight"] = torch.zeros(2, 2)
    names = sorted(state)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in halves.items():
        save_file({k: state[k].contiguous() for k in keys}, str(tmp_path / file))
    weight_map = {k: file for file, keys in halves.items() for k in keys}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    arena = _arena("tiny-qwen3.5")
    load_checkpoint(arena, tmp_path)
    for key, tensor in hf.state_dict().items():
        view = arena.tensor("weights", key)
        assert torch.equal(view, tensor.to(torch.bfloat16).to(view.dtype)), key


def _index_problem(tmp_path, edit) -> str:
    import json

    hf = hf_model(load_model("tiny-qwen3"), seed=4)
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    index = tmp_path / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    edit(tmp_path, data["weight_map"])
    index.write_text(json.dumps(data))
    arena = _arena("tiny-qwen3")
    before = arena.pools["weights"].clone()
    with pytest.raises(WeightsError) as error:
        load_checkpoint(arena, tmp_path)
    assert torch.equal(before, arena.pools["weights"])  # nothing written
    return str(error.value)


def test_an_index_naming_a_missing_shard_or_the_wrong_one_is_an_error(tmp_path):
    def drop_shard(directory, weight_map):
        (directory / weight_map["model.norm.weight"]).unlink()

    message = _index_problem(tmp_path / "missing", drop_shard)
    assert "weight_map names shards that are not in" in message

    def misplace(directory, weight_map):
        files = sorted(set(weight_map.values()))
        name = "model.norm.weight"
        weight_map[name] = next(f for f in files if f != weight_map[name])

    assert "weight_map puts model.norm.weight in" in _index_problem(tmp_path / "wrong", misplace)


@pytest.mark.parametrize("corrupt", [
    lambda raw: raw[:4],
    lambda raw: (10**9).to_bytes(8, "little") + raw[8:],
    lambda raw: raw[:8] + b"\xff" + raw[9:],
    lambda raw: raw[: len(raw) - 4],
])
def test_a_corrupt_safetensors_file_is_an_error_naming_it(tmp_path, corrupt):
    """The checkpoint checks (executor/checkpoint_checks.py, whose own tests hold each message) refuse
    the file before the loader maps it; the error names the file."""
    hf = hf_model(load_model("tiny-qwen3"), seed=1)
    hf.save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    path.write_bytes(corrupt(path.read_bytes()))
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(_arena("tiny-qwen3"), tmp_path)
    assert str(path) in str(error.value)
