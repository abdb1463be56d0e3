"""Load configs from YAML files, shipped names, or a Hugging Face config.json.

Every failure becomes a ``ConfigError`` naming the file, the field path, the
offending value and the rule it broke, so the CLI can print one line.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from planner.config import (
    HardwareConfig, ModelConfig, ServingConfig, graph_buckets_for_batch, vllm_name_clash, with_memplan_names)
from planner.errors import ConfigError
from planner.hf_import import model_from_hf_config

if TYPE_CHECKING:
    from planner.plan import MemoryPlan

#: The shipped configs: package data of ``planner`` (``configs/`` at the checkout's root links here).
CONFIG_ROOT = Path(__file__).resolve().parent / "configs"

T = TypeVar("T", bound=BaseModel)


def load_model(spec: str) -> ModelConfig:
    """A model from a YAML path, a shipped name (``qwen3-8b``), an HF config.json or checkpoint dir."""
    path = _resolve(spec, "models")
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json":
        data = _read_json(path)
        try:
            return model_from_hf_config(data, name=path.parent.name or path.stem)
        except ConfigError as error:
            raise ConfigError(str(path), error.field, error.value, error.rule) from None
    return validate(ModelConfig, _read_yaml(path), str(path))


def load_hardware(spec: str) -> HardwareConfig:
    """Hardware from a YAML path or a shipped name (``h200``)."""
    path = _resolve(spec, "hardware")
    return validate(HardwareConfig, _read_yaml(path), str(path))


def load_serving(spec: str | None, overrides: dict[str, Any] | None = None) -> ServingConfig:
    """Serving from a YAML path or shipped name (defaults when None), with flag overrides applied."""
    return validate(ServingConfig, _serving_data(spec, overrides), serving_source(spec, overrides))


def serving_source(spec: str | None, overrides: dict[str, Any] | None = None) -> str:
    """What errors about the serving config of ``load_serving(spec, overrides)`` name: its file
    ("defaults" when None), with " + flags" when overrides are given."""
    source = "defaults" if spec is None else str(_resolve(spec, "serving"))
    return f"{source} + flags" if _given(overrides) else source


def _given(overrides: dict[str, Any] | None) -> dict[str, Any]:
    """The flag overrides actually given (None: the flag was not passed)."""
    return {k: v for k, v in (overrides or {}).items() if v is not None}


def _serving_data(spec: str | None, overrides: dict[str, Any] | None) -> Any:
    data: Any = {} if spec is None else _read_yaml(_resolve(spec, "serving"))
    if not isinstance(data, dict):
        return data  # validate names the rule
    clash = vllm_name_clash(data)
    if clash:
        raise ConfigError(serving_source(spec), clash[0], data[clash[0]],
                          f"vLLM's name of {clash[1]}, which is given too; give one of them")
    data = with_memplan_names(data)
    given = _given(overrides)
    if "max_batch" in given and "decode_graph_batch_sizes" not in given:
        buckets = data.get("decode_graph_batch_sizes")
        if isinstance(buckets, list) and all(isinstance(b, int) for b in buckets):
            old_batch = data.get("max_batch", 64)
            data["decode_graph_batch_sizes"] = list(graph_buckets_for_batch(
                tuple(buckets), old_batch if isinstance(old_batch, int) else 64, given["max_batch"]))
    return {**data, **given}


def plan_from_configs(model: str, hardware: str, serving: str | None,
                      overrides: dict[str, Any] | None = None) -> MemoryPlan:
    """Load the model, hardware and serving configs (with flag overrides) and build their plan. ``serving``
    None: the hardware's default_serving (the same for ``memplan plan`` and ``memplan run``)."""
    from planner.plan import build_plan

    hardware_config = load_hardware(hardware)
    serving = hardware_config.default_serving if serving is None else serving
    return build_plan(load_model(model), hardware_config, load_serving(serving, overrides),
                      serving_source=serving_source(serving, overrides))


def validate(model_type: type[T], data: Any, source: str) -> T:
    """Validate ``data`` strictly (JSON semantics: 1 is a valid float, "1" is not an int)."""
    if not isinstance(data, dict):
        raise ConfigError(source, "", data, "expected a mapping of fields")
    try:
        return model_type.model_validate_json(json.dumps(data))
    except ValidationError as error:
        first = error.errors()[0]
        field = ".".join(str(part) for part in first["loc"])
        raise ConfigError(source, field, first.get("input"), _rule(first)) from None
    except (TypeError, ValueError) as error:  # json.dumps of YAML oddities (dates, sets)
        raise ConfigError(source, "", data, str(error)) from None


def _rule(error: dict[str, Any]) -> str:
    message = error["msg"]
    if message.startswith("Value error, "):
        message = message[len("Value error, ") :]
    return message


#: Other names of shipped configs (lower case): what users type for a card.
ALIASES = {
    "hardware": {"h100": "h100-sxm", "h100-80gb": "h100-sxm", "a100": "a100-80gb", "a100-80g": "a100-80gb",
                 "5090": "rtx-5090", "rtx5090": "rtx-5090", "l40-s": "l40s", "sim": "cpu-sim"},
}


def _resolve(spec: str, kind: str) -> Path:
    path = Path(spec)
    if path.exists():
        return path
    folder = CONFIG_ROOT / kind
    name = spec.lower()
    name = ALIASES.get(kind, {}).get(name, name)
    shipped = folder / f"{name}.yaml"
    if shipped.exists():
        return shipped
    names = sorted(p.stem for p in folder.glob("*.yaml"))
    close = difflib.get_close_matches(name, [*names, *ALIASES.get(kind, {})], n=3, cutoff=0.6)
    suggestion = "; did you mean " + " or ".join(
        dict.fromkeys(ALIASES.get(kind, {}).get(c, c) for c in close)) + "?" if close else ""
    raise ConfigError(spec, "", spec, f"no such file, and not a shipped {kind} name "
                                      f"({', '.join(names)}){suggestion}")


def _read_yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(str(path), where, "", f"malformed YAML: {getattr(error, 'problem', error)}") from None
    except OSError as error:
        raise ConfigError(str(path), "", "", f"cannot read: {error.strerror}") from None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ConfigError(str(path), f"line {error.lineno}", "", f"malformed JSON: {error.msg}") from None
    except OSError as error:
        raise ConfigError(str(path), "", "", f"cannot read: {error.strerror}") from None
