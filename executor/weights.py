"""Fill the weights pool: from a safetensors checkpoint, a state dict, or a seed.

A checkpoint directory holds one ``*.safetensors`` file or shards that
``model.safetensors.index.json`` maps tensor names to (its ``weight_map``; without an index every
``*.safetensors`` file of the directory is read, and a name in two of them is an error). Each file
is memory-mapped and each tensor is copied from the mapping straight into its planned view: no
host copy when the dtypes agree or the view is on the host, one host staging tensor (the cast)
for a device view of another dtype.

Names, shapes and dtypes are checked against the plan first: a missing, unexpected or mis-shaped
tensor is one error listing all of them, raised before anything is written. With tensor parallelism
a checkpoint holds the full tensors and each rank copies its shard (planner/shards.py: ranges of
the full tensor along one axis) into its planned view, straight from the mapping; a padded vocab
shard's tail rows are zeroed. Qwen3.5's multimodal
checkpoints keep the text stack under ``model.language_model.``: those names serve the text model,
and the vision tower and multi-token-prediction weights are left out.
"""

from __future__ import annotations

import json
import math
import mmap
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from executor.arena import Arena
from executor.checkpoint_checks import check_checkpoint_files
from planner.shards import Shard, weight_shards

#: Checkpoint prefixes mapped to the plan's names (Qwen3.5's multimodal wrapper
#: keeps the text stack under model.language_model).
_PREFIXES = (("model.language_model.", "model."),)
#: Checkpoint tensors that are not part of the text model we serve.
_IGNORED_PREFIXES = ("model.visual.", "visual.", "mtp.")
#: A sharded checkpoint's map of tensor names to files (transformers' save_pretrained name).
INDEX_FILE = "model.safetensors.index.json"
#: safetensors dtype names -> torch dtypes.
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool}
#: The safetensors format's bound on its JSON header.
MAX_HEADER_BYTES = 100 << 20
_LENGTH_BYTES = 8  # the header length: a little-endian u64 before the header


class WeightsError(ValueError):
    """The checkpoint does not match the plan's weights."""


def has_weights(directory: str | Path) -> bool:
    """Whether ``directory`` holds a safetensors checkpoint (an index or a ``*.safetensors`` file)."""
    directory = Path(directory)
    return directory.is_dir() and ((directory / INDEX_FILE).is_file() or any(directory.glob("*.safetensors")))


def load_checkpoint(arena: Arena, checkpoint: str | Path) -> int:
    """Copy every tensor of an HF checkpoint directory into the arena; return bytes loaded."""
    directory = Path(checkpoint)
    index = directory / INDEX_FILE
    files = (sorted({directory / file for file in _read_weight_map(index).values()}) if index.is_file()
             else sorted(directory.glob("*.safetensors")))
    check_checkpoint_files(files)  # CheckpointError: a corrupt file, a non-float dtype, a tensor in two files
    tensors = checkpoint_tensors(directory)
    readers: dict[str, Callable[[], torch.Tensor]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for name, (shard, entry) in tensors.items():
        readers[name] = lambda s=shard, n=name: s.tensor(n)
        shapes[name] = entry.shape
    return _load(arena, readers, shapes, str(directory))


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file: its dtype name, shape and byte range in the data section."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


class SafetensorsFile:
    """A safetensors file, memory-mapped (copy-on-write: the mapping is never written back); ``tensor(name)``
    is a torch view of the mapping. The header is checked as the format defines it: a JSON object of
    entries whose dtype is known, whose shape is a list of ints >= 0, and whose byte range lies in the
    data section and holds exactly shape x dtype bytes."""

    def __init__(self, path: Path):
        self.path = path
        try:
            with open(path, "rb") as stream:
                size = stream.seek(0, 2)
                stream.seek(0)
                length = int.from_bytes(stream.read(_LENGTH_BYTES), "little") if size >= _LENGTH_BYTES else -1
                if not 0 < length <= min(MAX_HEADER_BYTES, size - _LENGTH_BYTES):
                    raise WeightsError(f"{path}: not a safetensors file (header length {length}, file {size} bytes)")
                header = stream.read(length)
                self._map = mmap.mmap(stream.fileno(), 0, access=mmap.ACCESS_COPY)
        except OSError as error:
            raise WeightsError(f"{path}: cannot read: {error.strerror}") from None
        self._data_start = _LENGTH_BYTES + length
        self.entries = _parse_header(path, header, size - self._data_start)

    def tensor(self, name: str) -> torch.Tensor:
        entry = self.entries[name]
        dtype = SAFETENSORS_DTYPES[entry.dtype]
        count = math.prod(entry.shape)
        if count == 0:
            return torch.empty(entry.shape, dtype=dtype)
        flat = torch.frombuffer(self._map, dtype=dtype, count=count, offset=self._data_start + entry.start)
        return flat.view(entry.shape)


def checkpoint_tensors(directory: Path) -> dict[str, tuple[SafetensorsFile, TensorEntry]]:
    """Every tensor of a checkpoint directory: name -> (its file, its entry), from the index's weight_map
    when there is one, else from every ``*.safetensors`` file."""
    index = directory / INDEX_FILE
    if index.is_file():
        weight_map = _read_weight_map(index)
        shards = {file: SafetensorsFile(directory / file) for file in sorted(set(weight_map.values()))}
        tensors = {}
        for name, file in weight_map.items():
            shard = shards[file]
            if name not in shard.entries:
                raise WeightsError(f"{index}: weight_map puts {name} in {file}, which does not hold it")
            tensors[name] = (shard, shard.entries[name])
        return tensors
    paths = sorted(directory.glob("*.safetensors"))
    if not paths:
        raise WeightsError(f"{directory}: no *.safetensors files (and no {INDEX_FILE})")
    tensors = {}
    for path in paths:
        shard = SafetensorsFile(path)
        for name, entry in shard.entries.items():
            if name in tensors:
                raise WeightsError(f"{directory}: {name} is in both {tensors[name][0].path.name} and {path.name} "
                                   f"(an {INDEX_FILE} would say which to read)")
            tensors[name] = (shard, entry)
    return tensors


def _read_weight_map(index: Path) -> dict[str, str]:
    try:
        data = json.loads(index.read_text())
    except OSError as error:
        raise WeightsError(f"{index}: cannot read: {error.strerror}") from None
    except json.JSONDecodeError as error:
        raise WeightsError(f"{index}: malformed JSON at line {error.lineno}: {error.msg}") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise WeightsError(f"{index}: weight_map: expected an object of tensor name -> file name")
    missing = sorted({file for file in weight_map.values() if not (index.parent / file).is_file()})
    if missing:
        raise WeightsError(f"{index}: weight_map names shards that are not in {index.parent}: {', '.join(missing)}")
    outside = sorted({file for file in weight_map.values() if Path(file).name != file})
    if outside:
        raise WeightsError(f"{index}: weight_map names files outside its directory: {', '.join(outside)}")
    return weight_map


def _parse_header(path: Path, header: bytes, data_bytes: int) -> dict[str, TensorEntry]:
    try:
        data = json.loads(header)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise WeightsError(f"{path}: not a safetensors file (its header is not JSON)") from None
    if not isinstance(data, dict):
        raise WeightsError(f"{path}: not a safetensors file (its header is not a JSON object)")
    entries = {}
    for name, value in data.items():
        if name == "__metadata__":
            continue
        bad = _entry_problem(value, data_bytes)
        if bad:
            raise WeightsError(f"{path}: tensor {name}: {bad}")
        entries[name] = TensorEntry(value["dtype"], tuple(value["shape"]), *value["data_offsets"])
    return entries


def _entry_problem(value: object, data_bytes: int) -> str | None:
    if not isinstance(value, dict):
        return "expected an object with dtype, shape and data_offsets"
    dtype, shape, offsets = value.get("dtype"), value.get("shape"), value.get("data_offsets")
    if dtype not in SAFETENSORS_DTYPES:
        return f"dtype {dtype!r} is not one of {', '.join(SAFETENSORS_DTYPES)}"
    if not (isinstance(shape, list) and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape)):
        return f"shape {shape!r}: expected a list of ints >= 0"
    if not (isinstance(offsets, list) and len(offsets) == 2
            and all(isinstance(n, int) and not isinstance(n, bool) for n in offsets)):
        return f"data_offsets {offsets!r}: expected [start, end]"
    start, end = offsets
    if not 0 <= start <= end <= data_bytes:
        return f"data_offsets {offsets} outside the data section of {data_bytes} bytes"
    itemsize = torch.empty((), dtype=SAFETENSORS_DTYPES[dtype]).element_size()
    if end - start != math.prod(shape) * itemsize:
        return (f"data_offsets {offsets} hold {end - start} bytes, shape {shape} of {dtype} needs "
                f"{math.prod(shape) * itemsize}")
    return None


def load_state_dict(arena: Arena, tensors: Mapping[str, torch.Tensor], source: str = "state dict") -> int:
    """Copy a name -> tensor mapping (e.g. an HF model's state_dict) into the arena."""
    readers = {name: (lambda t=tensor: t) for name, tensor in tensors.items()}
    return _load(arena, readers, {name: tuple(t.shape) for name, t in tensors.items()}, source)


def fill_random(arena: Arena, seed: int) -> int:
    """Random weights of the planned shapes, initialised like HF (norms at their identity). With tensor
    parallelism each rank draws its shards from ``seed`` and its rank (the replicated norms are
    constants, so every rank holds the same ones) and zeroes a padded vocab shard's tail rows."""
    generator = torch.Generator(device=arena.device.torch_device).manual_seed(seed + arena.rank)
    zero_centred = arena.plan.model.architecture == "qwen3_5"
    shards = weight_shards(arena.plan.model, arena.plan.geometry, arena.rank)
    total = 0
    for buffer in arena.plan.pool("weights").buffers:
        view = arena.tensor("weights", buffer.name)
        _init(buffer.name, view, generator, zero_centred)
        shard = shards[buffer.name]
        if shard.axis is not None and shard.length < view.shape[shard.axis]:
            view.narrow(shard.axis, shard.length, view.shape[shard.axis] - shard.length).zero_()
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
    shards = weight_shards(arena.plan.model, arena.plan.geometry, arena.rank)
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
    misshaped = [f"{key} {list(shapes[key])} (planned {list(shards[name].full_shape)})"
                 for name, key in found.items() if tuple(shapes[key]) != shards[name].full_shape]
    problems = []
    for label, items in (("missing", missing), ("unexpected", sorted(unexpected)), ("mis-shaped", misshaped)):
        if items:
            shown = ", ".join(items[:8]) + (f", ... ({len(items)} in all)" if len(items) > 8 else "")
            problems.append(f"{label}: {shown}")
    if problems:
        raise WeightsError(f"{source} does not match the plan's weights: " + "; ".join(problems))
    total = 0
    for name, key in found.items():
        _copy_shard(readers[key](), arena.tensor("weights", name), shards[name])
        total += planned[name].bytes
    return total


def _copy_shard(full: torch.Tensor, view: torch.Tensor, shard: Shard) -> None:
    """Copy ``shard``'s ranges of the full tensor into the planned ``view``, in order from its start; zero
    the view's rest (a padded vocab shard's tail). A_log and dt_bias are planned float32."""
    if shard.axis is None:
        pieces = [(full, view)]
    else:
        pieces, filled = [], 0
        for start, stop in shard.ranges:
            pieces.append((full.narrow(shard.axis, start, stop - start), view.narrow(shard.axis, filled, stop - start)))
            filled += stop - start
        if filled < view.shape[shard.axis]:
            view.narrow(shard.axis, filled, view.shape[shard.axis] - filled).zero_()
    for piece, destination in pieces:
        if piece.dtype != destination.dtype and piece.device != destination.device:
            piece = piece.to(destination.dtype)  # cast on the host: copy_ across devices and dtypes stages on the device
        destination.copy_(piece)
