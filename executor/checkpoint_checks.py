"""Checks of a checkpoint's safetensors files before any tensor is read (no torch: header parsing only).

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON header, then the tensor data.
The header maps each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets into the
data) and may hold a ``"__metadata__"`` mapping of strings. Every file is checked to be a regular file whose
header parses (through planner.inputs: UTF-8, no duplicate keys, bounded nesting), whose tensors tile its
data exactly (no overlap, no hole), each ``prod(shape) x itemsize`` bytes, and whose dtypes are floating
point (an integer or bool tensor would be cast silently into a float weight view). A tensor name given by two
files is refused instead of one silently winning. Every problem is a ``CheckpointError`` naming the file,
the tensor and the rule.
"""

from __future__ import annotations

import math
import os
import stat
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from planner.errors import ConfigError
from planner.inputs import decode_utf8, parse_json, reason

#: Bytes of each safetensors dtype's element.
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
               "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
#: The dtypes a weight may be stored in: floating point, converted to the planned dtype on load (FP8 needs
#: scales that are not served).
WEIGHT_DTYPES = ("F16", "BF16", "F32", "F64")
#: The safetensors library's own bound on the header.
MAX_HEADER_BYTES = 100_000_000
_METADATA = "__metadata__"


class CheckpointError(ValueError):
    """A checkpoint file is unreadable, corrupt, or holds a tensor the weights cannot take."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors header: where its bytes lie in the file's data."""

    path: Path
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def check_checkpoint_dir(directory: Path) -> dict[str, TensorEntry]:
    """Every tensor of the checkpoint directory's ``*.safetensors`` files, checked (see the module docstring)."""
    try:
        is_dir = directory.is_dir()
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{directory}: cannot read: {reason(error)}") from None
    if not is_dir:
        raise CheckpointError(f"{directory}: not a directory (an HF checkpoint directory holds config.json and "
                              "*.safetensors)")
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no *.safetensors files")
    return check_checkpoint_files(files)


def check_checkpoint_files(files: Iterable[Path]) -> dict[str, TensorEntry]:
    """The tensors of ``files`` by name; a name in two files, or a non-float dtype, is a CheckpointError."""
    tensors: dict[str, TensorEntry] = {}
    for path in files:
        for name, entry in read_header(path).items():
            if name in tensors:
                raise CheckpointError(f"{path}: tensor {name} is also in {tensors[name].path.name}; a tensor may be "
                                      "stored in one file only")
            tensors[name] = entry
    check_weight_dtypes(tensors.values())
    return tensors


def check_weight_dtypes(entries: Iterable[TensorEntry]) -> None:
    """Refuse a tensor stored in a dtype that is not floating point (WEIGHT_DTYPES)."""
    for entry in entries:
        if entry.dtype not in WEIGHT_DTYPES:
            raise CheckpointError(f"{entry.path}: tensor {entry.name} has dtype {entry.dtype}; weights must be "
                                  f"floating point ({', '.join(WEIGHT_DTYPES)}), not cast from integers or bools")


def read_header(path: Path) -> dict[str, TensorEntry]:
    """The tensors of one safetensors file, checked against the file's size (nothing else is read)."""
    try:
        info = os.stat(path)
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{path}: cannot read: {reason(error)}") from None
    if stat.S_ISDIR(info.st_mode):
        raise CheckpointError(f"{path}: is a directory, not a safetensors file")
    if not stat.S_ISREG(info.st_mode):
        raise CheckpointError(f"{path}: not a regular file (a FIFO, device or socket)")
    size = info.st_size
    if size < 8:
        raise CheckpointError(f"{path}: {size} bytes, shorter than the 8-byte safetensors header length (empty or "
                              "truncated)")
    try:
        with open(path, "rb") as stream:
            (length,) = struct.unpack("<Q", stream.read(8))
            if length == 0 or length > MAX_HEADER_BYTES or 8 + length > size:
                raise CheckpointError(f"{path}: safetensors header length {length:,} does not fit the file of "
                                      f"{size:,} bytes (at most {MAX_HEADER_BYTES:,}): corrupt or truncated")
            raw = stream.read(length)
    except OSError as error:
        raise CheckpointError(f"{path}: cannot read: {reason(error)}") from None
    try:
        header = parse_json(decode_utf8(raw, f"{path} (safetensors header)"), f"{path} (safetensors header)")
    except ConfigError as error:
        raise CheckpointError(str(error)) from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the safetensors header is not a JSON object")
    data_bytes = size - 8 - length
    entries = {name: _entry(path, name, value) for name, value in header.items() if name != _METADATA}
    metadata = header.get(_METADATA, {})
    if not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise CheckpointError(f"{path}: safetensors header {_METADATA} must map names to strings")
    _check_ranges(path, entries.values(), data_bytes)
    return entries


def _entry(path: Path, name: str, value: Any) -> TensorEntry:
    def bad(rule: str) -> CheckpointError:
        return CheckpointError(f"{path}: safetensors header tensor {name}: {rule}")

    if not isinstance(value, dict) or set(value) != {"dtype", "shape", "data_offsets"}:
        raise bad("expected {\"dtype\", \"shape\", \"data_offsets\"}")
    dtype, shape, offsets = value["dtype"], value["shape"], value["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        raise bad(f"dtype {dtype!r} is not a safetensors dtype ({', '.join(DTYPE_BYTES)})")
    if not (isinstance(shape, list) and all(_is_int(d) and d >= 0 for d in shape)):
        raise bad(f"shape {shape!r} is not a list of ints >= 0")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise bad(f"data_offsets {offsets!r} is not [begin, end] with 0 <= begin <= end")
    expected = math.prod(shape) * DTYPE_BYTES[dtype]
    if offsets[1] - offsets[0] != expected:
        raise bad(f"data_offsets {offsets} hold {offsets[1] - offsets[0]:,} bytes; shape {shape} of {dtype} "
                  f"needs {expected:,}")
    return TensorEntry(path, name, dtype, tuple(shape), offsets[0], offsets[1])


def _check_ranges(path: Path, entries: Iterable[TensorEntry], data_bytes: int) -> None:
    """The tensors tile the file's data exactly, as the format requires: no overlap, no hole, nothing past
    the end and nothing after the last tensor."""
    cursor, previous = 0, None
    for entry in sorted(entries, key=lambda e: (e.begin, e.end)):
        if entry.end > data_bytes:
            raise CheckpointError(f"{path}: tensor {entry.name} ends at data byte {entry.end:,}, the file holds "
                                  f"{data_bytes:,} data bytes: truncated or corrupt (data_offsets)")
        if entry.begin < cursor:
            raise CheckpointError(f"{path}: tensors {previous.name} and {entry.name} overlap (data_offsets "
                                  f"[{previous.begin}, {previous.end}] and [{entry.begin}, {entry.end}])")
        if entry.begin > cursor:
            raise CheckpointError(f"{path}: data bytes {cursor:,}..{entry.begin:,} before tensor {entry.name} belong "
                                  "to no tensor (data_offsets): corrupt")
        cursor, previous = entry.end, entry
    if cursor != data_bytes:
        raise CheckpointError(f"{path}: the file holds {data_bytes:,} data bytes, its tensors {cursor:,} "
                              "(data_offsets): corrupt, or a header that does not belong to the data")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
