"""Checkpoint errors: ``load_checkpoint`` refuses a corrupt or mistyped safetensors checkpoint with one
CheckpointError naming the file and the tensor, before any weight view is written; the header checks agree
with the safetensors library on what it can read."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from executor.arena import materialize
from executor.checkpoint_checks import CheckpointError, check_checkpoint_dir, read_header
from executor.device import open_device
from executor.weights import load_checkpoint
from planner.loader import load_hardware, load_model, load_serving
from planner.plan import build_plan

DOWN = "model.layers.0.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def plan():
    return build_plan(load_model("tiny-qwen3"), load_hardware("cpu-sim"), load_serving("sim"))


@pytest.fixture(scope="module")
def tensors(plan) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {b.name: rng.standard_normal(b.shape).astype(np.float32) for b in plan.pool("weights").buffers}


def _save(folder: Path, tensors: dict[str, np.ndarray], shards: int = 1) -> Path:
    folder.mkdir(exist_ok=True)
    names = sorted(tensors)
    for shard in range(shards):
        save_file({n: tensors[n] for n in names[shard::shards]}, str(folder / f"model-{shard + 1}.safetensors"))
    return folder


def _weights_untouched(plan, checkpoint: Path, match: str) -> None:
    """load_checkpoint raises CheckpointError matching ``match``; the weight pool stays as it was."""
    arena = materialize(plan, open_device("auto"))
    before = {b.name: arena.tensor("weights", b.name).clone() for b in plan.pool("weights").buffers}
    with pytest.raises(CheckpointError, match=match) as error:
        load_checkpoint(arena, checkpoint)
    assert "\n" not in str(error.value)
    assert all(torch.equal(arena.tensor("weights", name), view) for name, view in before.items())


def _only_shard(folder: Path) -> Path:
    (path,) = folder.glob("*.safetensors")
    return path


def test_a_sound_checkpoint_passes_the_checks_and_loads(plan, tensors, tmp_path):
    folder = _save(tmp_path / "ckpt", tensors, shards=2)
    entries = check_checkpoint_dir(folder)
    assert set(entries) == set(tensors) and entries[DOWN].shape == tensors[DOWN].shape
    arena = materialize(plan, open_device("auto"))
    load_checkpoint(arena, folder)
    assert torch.equal(arena.tensor("weights", DOWN).cpu(), torch.from_numpy(tensors[DOWN]))


@pytest.mark.parametrize("cut, match", [(lambda n: n - 100, "truncated or corrupt"),
                                        (lambda n: 40, "header length"),
                                        (lambda n: 7, "shorter than the 8-byte"),
                                        (lambda n: 0, "0 bytes")])
def test_a_truncated_or_empty_file_is_refused(plan, tensors, tmp_path, cut, match):
    path = _only_shard(_save(tmp_path / "ckpt", tensors))
    data = path.read_bytes()
    path.write_bytes(data[: cut(len(data))])
    _weights_untouched(plan, path.parent, match)


@pytest.mark.parametrize("header, match", [(b"{not json", "malformed JSON"),
                                           (b"[1, 2]", "not a JSON object"),
                                           (b'{"a": "\xff"}', "not UTF-8"),
                                           (b'{"a": 1, "a": 2}', "duplicate key"),
                                           (b'{"a": {"dtype": "X9", "shape": [1], "data_offsets": [0, 1]}}',
                                            "not a safetensors dtype")])
def test_a_corrupt_header_is_refused(plan, tensors, tmp_path, header, match):
    path = _only_shard(_save(tmp_path / "ckpt", tensors))
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    _weights_untouched(plan, path.parent, match)


def test_a_directory_named_like_a_shard_is_refused(plan, tensors, tmp_path):
    path = _only_shard(_save(tmp_path / "ckpt", tensors))
    path.unlink()
    path.mkdir()
    _weights_untouched(plan, path.parent, "is a directory")


@pytest.mark.parametrize("dtype", ["int64", "bool", "int32", "uint8"])
def test_an_integer_or_bool_tensor_is_refused_not_cast(plan, tensors, tmp_path, dtype):
    mistyped = {**tensors, DOWN: np.ones(tensors[DOWN].shape, dtype=dtype)}
    _weights_untouched(plan, _save(tmp_path / "ckpt", mistyped), f"{DOWN} has dtype")


def test_a_tensor_in_two_shards_is_refused_naming_both(plan, tensors, tmp_path):
    folder = _save(tmp_path / "ckpt", tensors, shards=2)
    save_file({DOWN: tensors[DOWN] * 2}, str(folder / "model-3.safetensors"))
    with pytest.raises(CheckpointError, match=f"{DOWN} is also in model-"):
        check_checkpoint_dir(folder)
    _weights_untouched(plan, folder, DOWN)


def _rewrite(path: Path, change) -> None:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    change(header)
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + length :])


def _overlap(header: dict) -> None:
    """model.norm.weight moved onto the first bytes of the embedding."""
    begin = header["model.embed_tokens.weight"]["data_offsets"][0]
    size = 4 * header["model.norm.weight"]["shape"][0]
    header["model.norm.weight"]["data_offsets"] = [begin, begin + size]


@pytest.mark.parametrize("change, match", [
    (lambda h: h[DOWN].update(data_offsets=[0, 10**12]), "data_offsets"),
    (lambda h: h[DOWN].update(shape=[1, 1]), "needs"),
    (_overlap, "overlap"),
], ids=["past the data", "size not the shape's", "overlapping"])
def test_offsets_past_the_data_overlapping_or_not_matching_the_shape_are_refused(tensors, tmp_path, change, match):
    path = _only_shard(_save(tmp_path / "ckpt", tensors))
    _rewrite(path, change)
    with pytest.raises(CheckpointError, match=match):
        read_header(path)
