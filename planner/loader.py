"""Load configs from YAML files, shipped names, or a Hugging Face config.json.

Every failure becomes a ``ConfigError`` naming the file, the field path, the
offending value and the rule it broke, so the CLI can print one line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel, ValidationError

from planner import inputs
from planner.checked import CheckedOverflowError
from planner.config import HardwareConfig, ModelConfig, ServingConfig
from planner.errors import ConfigError
from planner.hf_import import model_from_hf_config

if TYPE_CHECKING:
    from planner.plan import MemoryPlan

CONFIG_ROOT = Path(__file__).resolve().parent.parent / "configs"

T = TypeVar("T", bound=BaseModel)


def load_model(spec: str) -> ModelConfig:
    """A model from a YAML path, a shipped name (``qwen3-8b``), an HF config.json or checkpoint dir."""
    path = model_path(spec)
    if path.suffix == ".json":
        data = _read_json(path)
        try:
            return model_from_hf_config(data, name=hf_model_name(path))
        except ConfigError as error:
            raise ConfigError(str(path), error.field, error.value, error.rule) from None
    return validate(ModelConfig, _read_yaml(path), str(path))


def model_path(spec: str) -> Path:
    """The file ``load_model(spec)`` reads: a YAML file, a shipped name's YAML, or an HF config.json (of a
    checkpoint directory)."""
    path = _resolve(spec, "models")
    if _is_dir(path):
        if not _is_file(path / "config.json"):
            raise ConfigError(str(path), "", "", "is a directory without a config.json (an HF checkpoint directory "
                                                 "holds config.json and *.safetensors)")
        return path / "config.json"
    return path


def hf_model_name(path: Path) -> str:
    """The model name of an HF config.json: its folder's name (``config.json`` of the working directory
    included), else the file's stem."""
    return path.absolute().parent.name or path.stem


def load_hardware(spec: str) -> HardwareConfig:
    """Hardware from a YAML path or a shipped name (``h200``)."""
    path = _resolve(spec, "hardware")
    return validate(HardwareConfig, _read_yaml(path), str(path))


def load_serving(spec: str | None, overrides: dict[str, Any] | None = None) -> ServingConfig:
    """Serving from a YAML path or shipped name (defaults when None), with flag overrides applied.
    A bad field of the file is named with the file even when a flag replaces it; only the rules between
    fields are left to the merged config (a flag may be what satisfies them)."""
    data: dict[str, Any] = {} if spec is None else _read_yaml(_resolve(spec, "serving"))
    if _given(overrides):
        try:
            validate(ServingConfig, data, serving_source(spec))
        except ConfigError as error:
            if error.field:  # a field of its own, not a rule between fields
                raise
    return validate(ServingConfig, _merged_serving(data, overrides), serving_source(spec, overrides))


def serving_source(spec: str | None, overrides: dict[str, Any] | None = None) -> str:
    """What errors about the serving config of ``load_serving(spec, overrides)`` name: its file
    ("defaults" when None), with " + flags" when overrides are given."""
    source = "defaults" if spec is None else str(_resolve(spec, "serving"))
    return f"{source} + flags" if _given(overrides) else source


def _given(overrides: dict[str, Any] | None) -> dict[str, Any]:
    """The flag overrides actually given (None: the flag was not passed)."""
    return {k: v for k, v in (overrides or {}).items() if v is not None}


def _merged_serving(data: dict[str, Any], overrides: dict[str, Any] | None) -> dict[str, Any]:
    given = _given(overrides)
    if given:
        buckets = data.get("decode_graph_batch_sizes", list(ServingConfig().decode_graph_batch_sizes))
        if ("max_batch" in given and "decode_graph_batch_sizes" not in given and _is_int(given["max_batch"])
                and isinstance(buckets, list) and all(_is_int(b) for b in buckets)):
            # Like vLLM's capture sizes: buckets above a lowered batch limit are dropped. Buckets that are
            # not a list of ints stay as given, for the validation to name.
            given["decode_graph_batch_sizes"] = [b for b in buckets if b <= given["max_batch"]] or [1]
        data = {**data, **given}
    return data


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def plan_from_configs(model: str, hardware: str, serving: str | None,
                      overrides: dict[str, Any] | None = None) -> MemoryPlan:
    """Load the model, hardware and serving configs (with flag overrides) and build their plan.
    A quantity that leaves its checked width is a ConfigError naming the three configs."""
    from planner.plan import build_plan

    configs = load_model(model), load_hardware(hardware), load_serving(serving, overrides)
    source = serving_source(serving, overrides)
    try:
        return build_plan(*configs, serving_source=source)
    except CheckedOverflowError as error:
        names = f"{model_path(model)} + {_resolve(hardware, 'hardware')} + {source}"
        raise overflow_error(names, error) from None


def overflow_error(source: str, error: CheckedOverflowError) -> ConfigError:
    """A checked-width overflow of the planner as a ConfigError naming ``source`` (the configs) and the
    quantity: these configs give a count the kernels or the byte accounting cannot hold."""
    return ConfigError(source, error.quantity, error.result,
                       f"{error.operation} overflows {error.width.label} (allowed {error.width.min:,}.."
                       f"{error.width.max:,}): these configs give more than the planner can index; use a smaller "
                       "device, batch, context or memory share, or larger pages")


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
    except (TypeError, ValueError) as error:  # a value that skipped planner.inputs (a caller's own dict)
        raise ConfigError(source, "", "", f"not plain JSON values: {error}") from None


def _rule(error: dict[str, Any]) -> str:
    message = error["msg"]
    if message.startswith("Value error, "):
        message = message[len("Value error, ") :]
    return message


def _resolve(spec: str, kind: str) -> Path:
    path = Path(spec)
    if _exists(path, spec):
        return path
    shipped = CONFIG_ROOT / kind / f"{spec}.yaml"
    if _exists(shipped, spec):
        return shipped
    names = sorted(p.stem for p in (CONFIG_ROOT / kind).glob("*.yaml"))
    raise ConfigError(spec, "", spec, f"no such file, and not a shipped {kind} name ({', '.join(names)})")


def resolve_config(spec: str, kind: str) -> Path | None:
    """The file a config spec names (``kind``: models, hardware, serving), or None when it names none."""
    try:
        return model_path(spec) if kind == "models" else _resolve(spec, kind)
    except ConfigError:
        return None


def _exists(path: Path, spec: str) -> bool:
    try:
        return path.exists()
    except (OSError, ValueError) as error:  # a name too long, a NUL byte
        raise ConfigError(spec, "", "", f"cannot read: {inputs.reason(error)}") from None


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except (OSError, ValueError):
        return False


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except (OSError, ValueError):
        return False


def _read_yaml(path: Path) -> dict[str, Any]:
    """A YAML config through the untrusted-input boundary (planner.inputs): a mapping of plain values."""
    return inputs.load_yaml(path)


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON config or plan through the untrusted-input boundary (planner.inputs): an object of plain values."""
    return inputs.load_json(path)
