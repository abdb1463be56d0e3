"""``memplan validate``: configs and plans against the schemas, then against the planner.

A config passes when it validates against its JSON Schema and loads into its
pydantic model (the semantic rules). A plan passes when it validates against
the plan schema, loads, and equals the plan the planner builds from the
plan's own model, hardware and serving configs: a hand-edited or stale plan
fails, naming the first field that differs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema

from planner.errors import ConfigError

CONFIG_KINDS = {"models": "model", "hardware": "hardware", "serving": "serving"}


def validate_paths(paths: list[Path]) -> tuple[list[str], int]:
    """Validate every config/plan file under ``paths``; return (problems, files checked)."""
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.suffix in (".yaml", ".yml", ".json"))
        else:
            files.append(path)
    problems = [problem for file in files for problem in validate_file(file)]
    return problems, len(files)


def validate_file(path: Path) -> list[str]:
    """Problems found in one file (empty when it is valid)."""
    from planner.loader import _read_json, _read_yaml  # one reader, one set of error messages

    try:
        data = _read_json(path) if path.suffix == ".json" else _read_yaml(path)
    except ConfigError as error:
        return [str(error)]
    kind = _kind(path, data)
    if kind is None:
        return [f"{path}: cannot tell whether this is a model, hardware, serving config or a plan"]
    if kind == "hf_config":
        return _semantic(path, "model", data)
    problems = _against_schema(path, kind, data)
    return problems or _semantic(path, kind, data)


def _kind(path: Path, data: Any) -> str | None:
    if not isinstance(data, dict):
        return None
    if "schema_version" in data:
        return "plan"
    if "model_type" in data:
        return "hf_config"
    if path.parent.name in CONFIG_KINDS:
        return CONFIG_KINDS[path.parent.name]
    if "architecture" in data:
        return "model"
    if "device_memory_bytes" in data:
        return "hardware"
    return "serving"


def _against_schema(path: Path, kind: str, data: Any) -> list[str]:
    from planner.schema import load_committed

    validator = jsonschema.Draft202012Validator(load_committed(kind))
    errors = sorted(validator.iter_errors(data), key=lambda e: list(e.absolute_path))
    return [
        f"{path}: {'.'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message} (schema {kind})"
        for e in errors[:5]
    ]


def _semantic(path: Path, kind: str, data: Any) -> list[str]:
    from planner.config import HardwareConfig, ModelConfig, ServingConfig
    from planner.hf_import import model_from_hf_config
    from planner.loader import validate

    try:
        if kind == "plan":
            return _plan_matches_planner(path, data)
        if kind == "model" and "model_type" in data:
            model_from_hf_config(data, name=path.parent.name)
        else:
            validate({"model": ModelConfig, "hardware": HardwareConfig, "serving": ServingConfig}[kind], data, str(path))
    except ConfigError as error:
        return [str(ConfigError(str(path), error.field, error.value, error.rule))]
    return []


def _plan_matches_planner(path: Path, data: dict[str, Any]) -> list[str]:
    from planner.errors import PlanDoesNotFit
    from planner.plan import MemoryPlan

    try:
        difference = plan_difference(MemoryPlan.model_validate_json(json.dumps(data)))
    except (ValueError, PlanDoesNotFit) as error:
        return [f"{path}: {str(error).splitlines()[0]}"]
    if difference is None:
        return []
    where, found, expected = difference
    return [f"{path}: differs from the plan the planner builds for its configs: {where} = {found!r}, "
            f"planner has {expected!r}"]


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
