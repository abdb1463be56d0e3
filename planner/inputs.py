"""The one boundary for untrusted files: configs, plans, request lines and checkpoint headers.

Every reader goes through here. A file is read only when it is a regular file under its size limit, decoded
as strict UTF-8 (a leading BOM is dropped), and parsed into plain JSON values: mappings with string keys,
lists, strings, booleans, null, integers of at most ``MAX_INT_BITS`` bits and finite floats, nested at most
``MAX_DEPTH`` levels; YAML booleans and numbers follow YAML 1.2's core schema (``010`` is ten, ``yes`` a
string). Duplicate keys (YAML and JSON) are errors, never "the last one wins"; YAML values with
no JSON meaning (dates, sets, binary) are errors naming their field, as is a YAML alias graph that expands
to more than ``MAX_YAML_VALUES`` values. Every failure is a ``ConfigError`` naming the file, the field path
(``a.b[2]``), the value and the rule, so nothing below this module sees unvalidated data.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from pathlib import Path
from typing import Any

import yaml

from planner.errors import ConfigError

#: Largest JSON config or plan file read (bytes); a plan of the largest shipped model is well under 1 MiB.
MAX_DOCUMENT_BYTES = 64 << 20
#: Largest YAML config read (bytes): a shipped config is under 2 KiB, and PyYAML parses about 1 MB/s.
MAX_YAML_BYTES = 4 << 20
#: Largest request or prompt file read (bytes).
MAX_REQUEST_FILE_BYTES = 1 << 30
#: Deepest nesting of mappings and lists; the deepest config (a plan) nests 6.
MAX_DEPTH = 64
#: Integers beyond this many bits are refused where they are read (seeds are 64 bits, sizes less).
MAX_INT_BITS = 128
#: Values a YAML document may expand to through its aliases.
MAX_YAML_VALUES = 100_000
#: Longest run of digits json parses into an integer (Python's own limit is 4300).
_MAX_INT_DIGITS = 64
_BOM = "\ufeff"


def read_text(path: Path, limit: int = MAX_DOCUMENT_BYTES) -> str:
    """The UTF-8 text of the regular file ``path`` (at most ``limit`` bytes); ConfigError otherwise."""
    source = str(path)
    try:
        info = os.stat(path)
    except (OSError, ValueError) as error:
        raise ConfigError(source, "", "", f"cannot read: {reason(error)}") from None
    if stat.S_ISDIR(info.st_mode):
        raise ConfigError(source, "", "", "cannot read: is a directory, not a file")
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(source, "", "", "cannot read: not a regular file (a FIFO, device or socket)")
    if info.st_size > limit:
        raise ConfigError(source, "", info.st_size, f"file size in bytes is over the reader's limit of {limit:,}")
    try:
        with open(path, "rb") as stream:
            data = stream.read(limit + 1)
    except OSError as error:
        raise ConfigError(source, "", "", f"cannot read: {reason(error)}") from None
    if len(data) > limit:
        raise ConfigError(source, "", len(data), f"file size in bytes is over the reader's limit of {limit:,}")
    return decode_utf8(data, source)


def decode_utf8(data: bytes, source: str) -> str:
    """``data`` as strict UTF-8 text without a leading BOM; ConfigError naming the first bad byte."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data[: error.start].count(b"\n") + 1
        raise ConfigError(source, f"line {line}, byte {error.start}", data[error.start : error.start + 4],
                          "not UTF-8 text") from None
    return text[1:] if text.startswith(_BOM) else text


def load_yaml(path: Path) -> dict[str, Any]:
    """A YAML file whose top level is a mapping, as plain JSON values."""
    return _mapping(parse_yaml(read_text(path, MAX_YAML_BYTES), str(path)), str(path))


def load_json(path: Path) -> dict[str, Any]:
    """A JSON file whose top level is an object, as plain JSON values."""
    text = read_text(path)
    if not text.strip():
        raise ConfigError(str(path), "", "", "the file is empty; expected a JSON object of fields")
    return _mapping(parse_json(text, str(path)), str(path))


def parse_yaml(text: str, source: str) -> Any:
    """One YAML document as plain JSON values (checked as the module docstring says)."""
    _check_flow_depth(text, source)
    node = None
    try:
        _check_yaml_depth(text, source)
        loader = _Loader(text)
        try:
            node = loader.get_single_node()
            if node is None:
                return None
            _check_yaml_keys(node, source)
            data = loader.construct_document(node)
        finally:
            loader.dispose()
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(source, where, "", f"malformed YAML: {getattr(error, 'problem', None) or error}") from None
    except ConfigError:
        raise
    except ValueError as error:  # int() of a number with more digits than Python converts
        scalar = _longest_scalar(node)
        where = "" if scalar is None else f"line {scalar.start_mark.line + 1}, column {scalar.start_mark.column + 1}"
        raise ConfigError(source, where, "", f"malformed YAML: {error}") from None
    return check_values(data, source, max_values=MAX_YAML_VALUES)


def _longest_scalar(node: yaml.Node | None) -> yaml.ScalarNode | None:
    """The scalar of ``node``'s tree with the longest text (the number too long to convert), None for none."""
    longest, stack = None, [] if node is None else [node]
    while stack:
        item = stack.pop()
        if isinstance(item, yaml.ScalarNode):
            if longest is None or len(item.value) > len(longest.value):
                longest = item
        elif isinstance(item, yaml.MappingNode):
            stack += [part for pair in item.value for part in pair]
        elif isinstance(item, yaml.SequenceNode):
            stack += item.value
    return longest


def parse_json(text: str, source: str, field: str = "") -> Any:
    """One JSON value as plain JSON values; ``field`` prefixes the paths that errors name."""
    try:
        data = json.loads(text, object_pairs_hook=_Object, parse_int=_parse_int)
    except json.JSONDecodeError as error:
        where = f"line {error.lineno}, column {error.colno}"
        raise ConfigError(source, where, "", f"malformed JSON: {error.msg}") from None
    except RecursionError:
        raise ConfigError(source, field, "", f"nested deeper than {MAX_DEPTH} levels") from None
    return check_values(data, source, field)


def check_values(data: Any, source: str, field: str = "", max_values: int | None = None) -> Any:
    """``data`` as plain JSON values (dicts, lists, str, int, finite float, bool, None); ConfigError naming
    the first field that is not one, is nested too deep, or repeats a key."""
    stack: list[tuple[Any, str, int]] = [(data, field, 0)]
    seen = 0
    while stack:
        value, where, depth = stack.pop()
        seen += 1
        if max_values is not None and seen > max_values:
            raise ConfigError(source, where, "", f"expands to more than {max_values:,} values (YAML aliases)")
        if depth > MAX_DEPTH:
            shown = where if len(where) <= 60 else where[:57] + "..."
            raise ConfigError(source, shown, "", f"nested deeper than {MAX_DEPTH} levels")
        if isinstance(value, dict):
            duplicate = getattr(value, "duplicate", None)
            if duplicate is not None:
                raise ConfigError(source, _join(where, duplicate), "", "duplicate key: each key may appear once")
            for key, item in value.items():
                if not isinstance(key, str):
                    raise ConfigError(source, _join(where, str(key)), key,
                                      f"keys must be strings, got {_a(_kind(key))}")
                stack.append((item, _join(where, key), depth + 1))
        elif isinstance(value, list):
            stack.extend((item, f"{where}[{index}]", depth + 1) for index, item in enumerate(value))
        elif isinstance(value, _TooManyDigits):
            raise ConfigError(source, where, f"{value.digits} digits", f"an integer of at most {MAX_INT_BITS} bits")
        elif isinstance(value, bool) or value is None or isinstance(value, str):
            continue
        elif isinstance(value, int):
            if value.bit_length() > MAX_INT_BITS:
                raise ConfigError(source, where, value, f"an integer of at most {MAX_INT_BITS} bits")
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise ConfigError(source, where, value, "must be a finite number")
        else:
            raise ConfigError(source, where, value, f"a YAML {_kind(value)} is not a config value; quote it to "
                                                    "give a string")
    return data


def _mapping(data: Any, source: str) -> dict[str, Any]:
    if data is None:
        raise ConfigError(source, "", None, "the file is empty or null; expected a mapping of fields")
    if not isinstance(data, dict):
        raise ConfigError(source, "", data, f"expected a mapping of fields at the top level, got {_a(_kind(data))}")
    return data


class _Object(dict):
    """A JSON object; ``duplicate`` names a key given twice (reported with its path by check_values)."""

    duplicate: str | None = None

    def __init__(self, pairs: list[tuple[str, Any]]):
        super().__init__(pairs)
        if len(self) != len(pairs):
            seen: set[str] = set()
            self.duplicate = next(key for key, _ in pairs if key in seen or seen.add(key))


class _TooManyDigits:
    """An integer literal too long to convert; check_values refuses it with its path."""

    def __init__(self, digits: int):
        self.digits = digits


def _parse_int(text: str) -> int | _TooManyDigits:
    return int(text) if len(text) <= _MAX_INT_DIGITS else _TooManyDigits(len(text))


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's core schema for booleans and numbers, not YAML 1.1's: ``010`` is
    ten (not eight), ``1e-6`` a number (not a string), and ``1:30``, ``0b11``, ``1_000``, ``yes`` and ``on``
    are strings (not 90, 3, 1000 and true). Duplicate keys are found on the composed nodes before
    construction."""


_BOOL, _INT, _FLOAT = (f"tag:yaml.org,2002:{kind}" for kind in ("bool", "int", "float"))
_Loader.yaml_implicit_resolvers = {  # YAML 1.1's bool, int and float forms dropped, the others kept
    first: [(tag, pattern) for tag, pattern in resolvers if tag not in (_BOOL, _INT, _FLOAT)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Loader.add_implicit_resolver(_BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
_Loader.add_implicit_resolver(_INT, re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"),
                              list("-+0123456789"))
_Loader.add_implicit_resolver(
    _FLOAT, re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
                       r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"), list("-+0123456789."))


def _construct_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    text = loader.construct_scalar(node)
    for prefix, base in (("0o", 8), ("0x", 16)):
        if text.startswith(prefix):
            return int(text[2:], base)
    return int(text)  # decimal, leading zeros and all: YAML 1.2 has no implicit octal


def _construct_float(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> float:
    text = loader.construct_scalar(node).lower()
    return float(text.replace(".inf", "inf").replace(".nan", "nan"))  # check_values refuses inf and nan


def _construct_bool(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> bool:
    return loader.construct_scalar(node).lower() == "true"


_Loader.add_constructor(_INT, _construct_int)
_Loader.add_constructor(_FLOAT, _construct_float)
_Loader.add_constructor(_BOOL, _construct_bool)


def _check_flow_depth(text: str, source: str) -> None:
    """Refuse flow collections (``[``, ``{``) nested past MAX_DEPTH before PyYAML scans them: its scanner
    keeps a possible key per open flow level and takes time quadratic in their depth. A bracket opens a
    collection where a YAML node can start (after ``[ { , : - ?`` or at a line's start); quoted scalars,
    which start there too, and comments are skipped."""
    depth, line, index, size = 0, 1, 0, len(text)
    previous = "\n"  # the last character that is not a space
    while index < size:
        char = text[index]
        node_start = previous in _NODE_START
        if char in "\"'" and node_start:
            end = _after_quoted(text, index)
            line += text.count("\n", index, end)
            index, previous = end, char
            continue
        if char == "#" and (index == 0 or text[index - 1] in " \t\n"):
            index = text.find("\n", index)
            index = size if index < 0 else index
            continue
        if char in "[{" and node_start:
            depth += 1
            if depth > MAX_DEPTH:
                raise ConfigError(source, f"line {line}", "", f"nested deeper than {MAX_DEPTH} levels")
        elif char in "]}":
            depth = max(depth - 1, 0)
        if char == "\n":
            line += 1
        if char not in " \t":
            previous = char
        index += 1


_NODE_START = "[{,:-?\n"


def _after_quoted(text: str, start: int) -> int:
    """The index after the quoted scalar that starts at ``start`` (the end of the text when unclosed)."""
    quote, index = text[start], start + 1
    while index < len(text):
        if quote == '"' and text[index] == "\\":
            index += 2
            continue
        if text[index] == quote:
            if quote == "'" and text[index + 1 : index + 2] == "'":
                index += 2
                continue
            return index + 1
        index += 1
    return len(text)


def _check_yaml_depth(text: str, source: str) -> None:
    """Refuse nesting past MAX_DEPTH from the parser's events (iterative, before the recursive composer)."""
    depth = 0
    for event in yaml.parse(text, Loader=_Loader):
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > MAX_DEPTH:
                mark = event.start_mark
                raise ConfigError(source, f"line {mark.line + 1}, column {mark.column + 1}", "",
                                  f"nested deeper than {MAX_DEPTH} levels")
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1


def _check_yaml_keys(root: yaml.Node, source: str) -> None:
    """Refuse a key given twice in one mapping, naming its path and both lines."""
    stack: list[tuple[yaml.Node, str]] = [(root, "")]
    visited: set[int] = set()
    while stack:
        node, where = stack.pop()
        if id(node) in visited:  # an alias: checked where its anchor is
            continue
        visited.add(id(node))
        if isinstance(node, yaml.MappingNode):
            lines: dict[str, int] = {}
            for key_node, value_node in node.value:
                key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
                if key is not None and key != "<<":
                    line = key_node.start_mark.line + 1
                    if key in lines:
                        raise ConfigError(source, _join(where, key), "",
                                          f"duplicate key (lines {lines[key]} and {line}): each key may appear once")
                    lines[key] = line
                stack.append((value_node, _join(where, key if key is not None else "?")))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend((item, f"{where}[{index}]") for index, item in enumerate(node.value))


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _a(noun: str) -> str:
    """``noun`` with its indefinite article."""
    return f"{'an' if noun[:1] in 'aeiou' else 'a'} {noun}"


def _kind(value: Any) -> str:
    names = {dict: "mapping", list: "list", str: "string", bool: "boolean", int: "integer", float: "number",
             type(None): "null"}
    for kind, name in names.items():
        if type(value) is kind or (kind is dict and isinstance(value, dict)):
            return name
    return {"date": "date", "datetime": "timestamp", "set": "set", "bytes": "binary value",
            "tuple": "complex key"}.get(type(value).__name__, type(value).__name__)


def reason(error: Exception) -> str:
    """What an OSError (or a path ValueError, such as a NUL byte) says, without its errno and path."""
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return str(error)
