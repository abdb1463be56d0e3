"""Hypothesis strategies for untrusted input: configs and plan files with one field replaced by a nasty
value, request lines, raw file bytes, and safetensors corruptions."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

from executor.workload import REQUEST_KEYS

#: Integers at the edges of the widths the planner and the kernels use.
EDGE_INTS = [0, 1, -1, 2**31 - 1, 2**31, 2**32 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63) - 1, 2**70,
             10**13, 10**30]
#: Floats at the edges: JSON cannot hold the non-finite ones, YAML (.inf, .nan) and Python's json can.
EDGE_FLOATS = [0.0, -0.0, 1e-300, 1e39, 1e308, float("inf"), float("-inf"), float("nan"), 0.5, -1.5]
#: Strings with control characters, a date-like, a number-like and an over-long one.
EDGE_STRINGS = ["", " ", "a\nb", "\x00", "\u202e", "2024-01-01", "16", "yes", "x" * 500, "bfloat16\n"]


def scalars() -> st.SearchStrategy[Any]:
    return st.one_of(st.sampled_from(EDGE_INTS), st.integers(), st.sampled_from(EDGE_FLOATS), st.floats(),
                     st.sampled_from(EDGE_STRINGS), st.text(max_size=20), st.booleans(), st.none())


def values() -> st.SearchStrategy[Any]:
    """Any JSON-like value (non-finite floats included), nested a few levels."""
    return st.recursive(scalars(), lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)), max_leaves=8)


def _paths(data: Any, prefix: tuple = ()) -> list[tuple]:
    """Every key path of ``data`` (mappings and lists), the root's own keys included."""
    found = []
    if isinstance(data, dict):
        for key, value in data.items():
            found.append(prefix + (key,))
            found += _paths(value, prefix + (key,))
    elif isinstance(data, list):
        for index, value in enumerate(data):
            found.append(prefix + (index,))
            found += _paths(value, prefix + (index,))
    return found


def _replace(data: Any, path: tuple, value: Any) -> Any:
    data = json.loads(json.dumps(data))
    target = data
    for part in path[:-1]:
        target = target[part]
    target[path[-1]] = value
    return data


def _delete(data: Any, path: tuple) -> Any:
    data = json.loads(json.dumps(data))
    target = data
    for part in path[:-1]:
        target = target[part]
    del target[path[-1]]
    return data


@st.composite
def mutated(draw: st.DrawFn, base: dict[str, Any]) -> dict[str, Any]:
    """``base`` with one field replaced by a nasty value, deleted, or one unknown field added."""
    paths = _paths(base)
    action = draw(st.sampled_from(["replace", "replace", "replace", "delete", "add"]))
    if action == "add":
        return {**base, draw(st.text(min_size=1, max_size=12)): draw(values())}
    path = draw(st.sampled_from(paths))
    if action == "delete":
        return _delete(base, path)
    return _replace(base, path, draw(values()))


@st.composite
def request_lines(draw: st.DrawFn) -> str:
    """One --requests line: a JSON object of request keys (and now and then another key) with any values,
    or now and then not an object at all."""
    keys = draw(st.lists(st.sampled_from([*REQUEST_KEYS, "bogus"]), max_size=5, unique=True))
    record = {}
    for key in keys:
        if key in ("prompt_ids", "stop_ids"):
            record[key] = draw(st.one_of(st.lists(st.one_of(st.integers(-5, 300), st.sampled_from(EDGE_INTS)),
                                                  max_size=6), values()))
        else:
            record[key] = draw(st.one_of(st.sampled_from(EDGE_INTS), st.integers(-5, 300),
                                         st.sampled_from(EDGE_FLOATS), values()))
    if draw(st.integers(0, 9)) == 0:
        return json.dumps(draw(values()))
    return json.dumps(record)


def raw_documents() -> st.SearchStrategy[bytes]:
    """Bytes a reader may be given: random bytes, JSON/YAML-looking text with duplicates, deep nests,
    aliases and tags."""
    fragments = st.sampled_from([b"a: 1\n", b"a: 2\n", b"{", b"}", b"[", b"]", b'"x": ', b"&r [*r]", b"*r",
                                 b"!!set {1}", b"2024-01-01", b".inf", b".nan", b"NaN", b"Infinity", b"\xff",
                                 b"\x00", b"\t", b"- ", b"? ", b"9" * 80, b",", b"\n", b"  "])
    return st.one_of(st.binary(max_size=64), st.lists(fragments, max_size=24).map(b"".join))


@st.composite
def safetensors_corruptions(draw: st.DrawFn, original: bytes) -> bytes:
    """``original`` (a safetensors file) truncated, with bytes overwritten, or with its header rewritten."""
    kind = draw(st.sampled_from(["truncate", "overwrite", "length", "header"]))
    if kind == "truncate":
        return original[: draw(st.integers(0, len(original) - 1))]
    if kind == "overwrite":
        at = draw(st.integers(0, len(original) - 1))
        patch = draw(st.binary(min_size=1, max_size=8))
        return original[:at] + patch + original[at + len(patch):]
    length = int.from_bytes(original[:8], "little")
    if kind == "length":
        return draw(st.sampled_from([0, 1, length - 1, length + 1, 2**63, 2**64 - 1])).to_bytes(8, "little") \
            + original[8:]
    header = json.loads(original[8 : 8 + length])
    name = draw(st.sampled_from(sorted(k for k in header if k != "__metadata__")))
    field = draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
    header[name][field] = draw(st.one_of(values(), st.sampled_from(["I64", "BOOL", "F8_E4M3", "X"]),
                                         st.lists(st.sampled_from(EDGE_INTS), max_size=3)))
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + original[8 + length:]
