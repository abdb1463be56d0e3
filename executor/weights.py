"""Fill the weights pool: from a safetensors checkpoint, a state dict, or a seed.

Tensors are read one at a time and copied straight into their planned views
(one staging tensor at most). Names, shapes and dtypes are checked against the
plan first: a missing, unexpected or mis-shaped tensor is one error listing all
of them, raised before anything is written.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from executor.arena import Arena
from executor.checkpoint_checks import check_checkpoint_files

#: Checkpoint prefixes mapped to the plan's names (Qwen3.5's multimodal wrapper
#: keeps the text stack under model.language_model).
_PREFIXES = (("model.language_model.", "model."),)
#: Checkpoint tensors that are not part of the text model we serve.
_IGNORED_PREFIXES = ("model.visual.", "visual.", "mtp.")


class WeightsError(ValueError):
    """The checkpoint does not match the plan's weights."""


def load_checkpoint(arena: Arena, checkpoint: str | Path) -> int:
    """Copy every tensor of an HF checkpoint directory into the arena; return bytes loaded."""
    from safetensors import safe_open

    directory = Path(checkpoint)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"{directory}: no *.safetensors files")
    check_checkpoint_files(files)  # CheckpointError: a corrupt file, a non-float dtype, a tensor in two files
    handles = [safe_open(str(path), framework="pt") for path in files]
    readers: dict[str, Callable[[], torch.Tensor]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for handle in handles:
        for key in handle.keys():
            readers[key] = lambda h=handle, k=key: h.get_tensor(k)
            shapes[key] = tuple(handle.get_slice(key).get_shape())
    return _load(arena, readers, shapes, str(directory))


def load_state_dict(arena: Arena, tensors: Mapping[str, torch.Tensor], source: str = "state dict") -> int:
    """Copy a name -> tensor mapping (e.g. an HF model's state_dict) into the arena."""
    readers = {name: (lambda t=tensor: t) for name, tensor in tensors.items()}
    return _load(arena, readers, {name: tuple(t.shape) for name, t in tensors.items()}, source)


def fill_random(arena: Arena, seed: int) -> int:
    """Random weights of the planned shapes, initialised like HF (norms at their identity)."""
    generator = torch.Generator(device=arena.device.torch_device).manual_seed(seed)
    zero_centred = arena.plan.model.architecture == "qwen3_5"
    total = 0
    for buffer in arena.plan.pool("weights").buffers:
        view = arena.tensor("weights", buffer.name)
        _init(buffer.name, view, generator, zero_centred)
        total += buffer.bytes
    return total


def _init(name: str, view: torch.Tensor, generator: torch.Generator, zero_centred: bool) -> None:
    if name.endswith("A_log"):
        view.uniform_(0.0, 16.0, generator=generator).clamp_(min=1e-3).log_()
    elif name.endswith("dt_bias"):
        view.fill_(1.0)
    elif name.endswith("linear_attn.norm.weight"):
        view.fill_(1.0)  # RMSNormGated multiplies by w, not 1 + w
    elif "norm" in name.rsplit(".", 2)[-2]:
        view.fill_(0.0 if zero_centred else 1.0)
    elif name.endswith("conv1d.weight"):
        bound = 1.0 / math.sqrt(view.shape[-1])
        view.uniform_(-bound, bound, generator=generator)
    else:
        view.normal_(0.0, 0.02, generator=generator)


def _canonical(name: str) -> str | None:
    if name.startswith(_IGNORED_PREFIXES):
        return None
    for old, new in _PREFIXES:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def _load(arena: Arena, readers: Mapping[str, Callable[[], torch.Tensor]], shapes: Mapping[str, tuple[int, ...]],
          source: str) -> int:
    planned = {b.name: b for b in arena.plan.pool("weights").buffers}
    tied = arena.plan.model.tie_word_embeddings
    found: dict[str, str] = {}
    unexpected = []
    for key in readers:
        name = _canonical(key)
        if name is None or (tied and name == "lm_head.weight"):
            continue  # not ours, or the tied copy of the embedding
        if name not in planned:
            unexpected.append(key)
        else:
            found[name] = key
    missing = sorted(set(planned) - set(found))
    misshaped = [f"{key} {list(shapes[key])} (planned {list(planned[name].shape)})"
                 for name, key in found.items() if tuple(shapes[key]) != planned[name].shape]
    problems = []
    for label, items in (("missing", missing), ("unexpected", sorted(unexpected)), ("mis-shaped", misshaped)):
        if items:
            shown = ", ".join(items[:8]) + (f", ... ({len(items)} in all)" if len(items) > 8 else "")
            problems.append(f"{label}: {shown}")
    if problems:
        raise WeightsError(f"{source} does not match the plan's weights: " + "; ".join(problems))
    total = 0
    for name, key in found.items():
        view = arena.tensor("weights", name)
        view.copy_(readers[key]())  # casts to the planned dtype (A_log, dt_bias stay float32)
        total += planned[name].bytes
    return total

