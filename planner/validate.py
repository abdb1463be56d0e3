"""``memplan validate``: configs and plans against the schemas, then against the planner.

A config passes when it validates against its JSON Schema and loads into its
pydantic model (the semantic rules). A plan passes when it validates against
the plan schema, loads, and equals the plan the planner builds from the
plan's own model, hardware and serving configs: a hand-edited or stale plan
fails, naming the first field that differs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jsonschema

from planner.checked import CheckedOverflowError
from planner.errors import ConfigError, PlanDoesNotFit

if TYPE_CHECKING:
    from planner.plan import MemoryPlan

CONFIG_KINDS = {"models": "model", "hardware": "hardware", "serving": "serving"}
CONFIG_SUFFIXES = (".yaml", ".yml", ".json")


def validate_paths(paths: list[Path]) -> tuple[list[str], int]:
    """Validate every config/plan file under ``paths``; return (problems, files checked)."""
    files: list[Path] = []
    problems: list[str] = []
    for path in paths:
        if _is_dir(path):
            found, unreadable = _config_files(path)
            files += found
            problems += unreadable
            if not found and not unreadable:
                problems.append(f"{path}: a directory without {', '.join(CONFIG_SUFFIXES)} files to validate")
        else:
            files.append(path)
    for file in files:
        try:
            problems += validate_file(file)
        except CheckedOverflowError as error:  # a count no width holds, wherever it was computed: this file's
            problems.append(f"{file}: {error}")
    return problems, len(files)


def _config_files(folder: Path) -> tuple[list[Path], list[str]]:
    """The config-suffixed files under ``folder`` (links to folders not followed) and the folders that
    could not be listed."""
    files, problems = [], []

    def unreadable(error: OSError) -> None:
        problems.append(f"{error.filename}: cannot list: {error.strerror}")

    for root, folders, names in os.walk(folder, onerror=unreadable):
        folders.sort()
        files += [Path(root) / name for name in sorted(names) if Path(name).suffix in CONFIG_SUFFIXES]
    return files, problems


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except (OSError, ValueError):
        return False


def validate_file(path: Path) -> list[str]:
    """Problems found in one file (empty when it is valid)."""
    from planner.loader import _read_json, _read_yaml  # one reader, one set of error messages

    try:
        data = _read_json(path) if path.suffix == ".json" else _read_yaml(path)
    except ConfigError as error:
        return [str(error)]
    kind = _kind(path, data)
    if kind == "hf_config":
        return _semantic(path, "model", data)
    problems = _against_schema(path, kind, data)
    return problems or _semantic(path, kind, data)


def _kind(path: Path, data: dict[str, Any]) -> str:
    if "schema_version" in data:
        return "plan"
    if _is_hf_config(path, data):
        return "hf_config"
    if path.parent.name in CONFIG_KINDS:
        return CONFIG_KINDS[path.parent.name]
    if "architecture" in data:
        return "model"
    if "device_memory_bytes" in data:
        return "hardware"
    return "serving"


def _is_hf_config(path: Path, data: dict[str, Any]) -> bool:
    return "model_type" in data or path.name == "config.json"


def _against_schema(path: Path, kind: str, data: Any) -> list[str]:
    from planner.schema import load_committed

    validator = jsonschema.Draft202012Validator(load_committed(kind))
    errors = sorted(validator.iter_errors(data), key=lambda e: [str(part) for part in e.absolute_path])
    first: dict[str, Any] = {}  # one error a field: a bad enum value breaks its "enum" and its "type" at once,
    for error in errors:        # and a field's error covers those of the values inside it
        where = ".".join(str(p) for p in error.absolute_path) or "<root>"
        if not any(where.startswith(f"{kept}.") for kept in first if kept != "<root>"):
            first.setdefault(where, error)
    return [f"{path}: {where}: {_schema_message(error)} (schema {kind})" for where, error in list(first.items())[:5]]


def _schema_message(error: jsonschema.ValidationError) -> str:
    """jsonschema's message, or for two names of one field given together (``dependentSchemas``: vLLM's
    name beside memplan's) the names, not the whole mapping and the schema."""
    schema_path = list(error.schema_path)
    if error.validator == "not" and schema_path[:1] == ["dependentSchemas"] and isinstance(error.instance, dict):
        given = schema_path[1]
        others = [name for name in _required_names(error.validator_value) if name in error.instance]
        return f"{given} and {', '.join(others)} are given together; give one of them"
    return error.message


def _required_names(schema: Any) -> list[str]:
    """The field names ``required`` lists anywhere in ``schema``."""
    if isinstance(schema, dict):
        return [*schema.get("required", []), *(name for value in schema.values() for name in _required_names(value))]
    if isinstance(schema, list):
        return [name for item in schema for name in _required_names(item)]
    return []


def _semantic(path: Path, kind: str, data: Any) -> list[str]:
    from planner.config import HardwareConfig, ModelConfig, ServingConfig
    from planner.hf_import import model_from_hf_config
    from planner.loader import check_default_serving, hf_model_name, serving_with_memplan_names, validate

    try:
        if kind == "plan":
            check_plan(data, str(path))
            return []
        if kind == "model" and _is_hf_config(path, data):
            model_from_hf_config(data, name=hf_model_name(path))
        elif kind == "serving":  # vLLM's key names as the loader reads them
            validate(ServingConfig, serving_with_memplan_names(data, str(path)), str(path))
        else:
            config = validate({"model": ModelConfig, "hardware": HardwareConfig}[kind], data, str(path))
            if kind == "hardware":
                check_default_serving(config, str(path))
    except ConfigError as error:
        return [str(ConfigError(str(path), error.field, error.value, error.rule))]
    return []


def load_plan_file(path: Path) -> MemoryPlan:
    """A plan JSON file, validated and equal to what this planner builds from its own configs; every
    problem a ConfigError naming the file and the field."""
    from planner.loader import _read_json

    return check_plan(_read_json(path), str(path))


def check_plan(data: dict[str, Any], source: str) -> MemoryPlan:
    """``data`` (plain JSON values) as a MemoryPlan equal to the one the planner builds from the plan's own
    model, hardware and serving configs; ConfigError naming ``source`` and the first wrong field."""
    from planner.loader import overflow_error, validate
    from planner.plan import MemoryPlan

    plan = validate(MemoryPlan, data, source)
    try:
        difference = plan_difference(plan)
    except ConfigError as error:  # a rule between the plan's configs (check_compatible names serving fields)
        field = f"serving.{error.field}" if error.source == "serving" else error.field
        raise ConfigError(source, field, error.value, error.rule) from None
    except CheckedOverflowError as error:
        raise overflow_error(source, error) from None
    except PlanDoesNotFit as error:
        first_line = str(error).splitlines()[0]
        raise ConfigError(source, "serving", "", f"the plan's configs do not fit: {first_line}") from None
    if difference is not None:
        where, found, expected = difference
        raise ConfigError(source, where.lstrip("."), found,
                          f"differs from the plan this planner builds from the file's configs ({expected!r}); re-plan")
    return plan


def plan_difference(plan: Any) -> tuple[str, Any, Any] | None:
    """None when ``plan`` equals what the planner builds from its own configs, else the first
    differing field as (dotted path, the plan's value, the planner's value)."""
    from planner.plan import build_plan

    rebuilt = build_plan(plan.model, plan.hardware, plan.serving)
    if rebuilt == plan:
        return None
    return _first_difference(rebuilt.model_dump(), plan.model_dump())


def _first_difference(expected: Any, actual: Any, where: str = "") -> tuple[str, Any, Any] | None:
    if isinstance(expected, dict) and isinstance(actual, dict):
        for key in expected:
            if key not in actual:
                return f"{where}.{key}", "<missing>", expected[key]
            found = _first_difference(expected[key], actual[key], f"{where}.{key}")
            if found:
                return found
        return None
    if isinstance(expected, (list, tuple)) and isinstance(actual, (list, tuple)):
        if len(expected) != len(actual):
            return where, f"{len(actual)} entries", f"{len(expected)} entries"
        for index, (e, a) in enumerate(zip(expected, actual)):
            found = _first_difference(e, a, f"{where}[{index}]")
            if found:
                return found
        return None
    return None if expected == actual else (where, actual, expected)
