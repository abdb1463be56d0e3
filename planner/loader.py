"""Load configs from YAML files, shipped names, or a Hugging Face config.json.

Every failure becomes a ``ConfigError`` naming the file, the field path, the
offending value and the rule it broke, so the CLI can print one line.
"""

from __future__ import annotations

import difflib
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel, ValidationError

from planner import inputs
from planner.checked import CheckedOverflowError
from planner.config import (
    VLLM_SERVING_NAMES, VLLM_STEP_TOKENS, HardwareConfig, ModelConfig, ServingConfig, graph_buckets_for_batch,
    vllm_name_clash, with_memplan_names)
from planner.errors import ConfigError, FieldRule
from planner.hf_import import model_from_hf_config

if TYPE_CHECKING:
    from planner.plan import MemoryPlan

#: The shipped configs: package data of ``planner`` (``configs/`` at the checkout's root links here).
CONFIG_ROOT = Path(__file__).resolve().parent / "configs"

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
            what = ("is a directory, not a config file" if path.name.endswith((".json", ".yaml", ".yml"))
                    else "is a directory without a config.json")
            raise ConfigError(str(path), "", "", f"{what} (an HF checkpoint directory holds config.json and "
                                                 "*.safetensors)")
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
    raw = {} if spec is None else _read_yaml(_resolve(spec, "serving"))
    file_names = _file_names(raw)
    data = serving_with_memplan_names(raw, serving_source(spec))
    # refuses a field given both ways
    given = serving_with_memplan_names(_given(overrides), serving_source(spec, overrides))
    try:
        if given:
            try:
                validate(ServingConfig, data, serving_source(spec))
            except ConfigError as error:
                if error.field:  # a field of its own, not a rule between fields
                    raise
        return validate(ServingConfig, _merged_serving(data, given), serving_source(spec, overrides))
    except ConfigError as error:  # the file's field by the name it is written under (vLLM's or memplan's)
        from_flag = error.field in given and error.source == serving_source(spec, overrides)
        if error.field not in file_names or from_flag:
            raise
        raise ConfigError(error.source, file_names[error.field], error.value, error.rule) from None


def _file_names(data: Any) -> dict[str, str]:
    """memplan's name -> the vLLM name a serving file writes it under, for the fields it writes so."""
    if not isinstance(data, dict):
        return {}
    return {VLLM_SERVING_NAMES[key]: key for key in data if key in VLLM_SERVING_NAMES}


def serving_source(spec: str | None, overrides: dict[str, Any] | None = None) -> str:
    """What errors about the serving config of ``load_serving(spec, overrides)`` name: its file
    ("defaults" when None), with " + flags" when overrides are given."""
    source = "defaults" if spec is None else str(_resolve(spec, "serving"))
    return f"{source} + flags" if _given(overrides) else source


def _given(overrides: dict[str, Any] | None) -> dict[str, Any]:
    """The flag overrides actually given (None: the flag was not passed)."""
    return {k: v for k, v in (overrides or {}).items() if v is not None}


def serving_with_memplan_names(data: Any, source: str) -> Any:
    """A serving mapping with vLLM's key names replaced by memplan's (a name given both ways is an error)."""
    if not isinstance(data, dict):
        return data  # validate names the rule
    clash = vllm_name_clash(data)
    if clash:
        vllm_name, field = clash
        what = f"sets {field}" if vllm_name == VLLM_STEP_TOKENS else f"vLLM's name of {field}"
        raise ConfigError(source, vllm_name, data[vllm_name], f"{what}, which is given too; give one of them")
    return with_memplan_names(data)


def _merged_serving(data: Any, given: dict[str, Any]) -> Any:
    """The serving file's fields with the flags ``given`` (memplan's names) over them. Default graph buckets
    follow a new max_batch and given ones lose those above it; buckets that are not a list of ints stay as
    given, for the validation to name."""
    if not given or not isinstance(data, dict):
        return data
    data = dict(data)
    if "max_batch" in given and "decode_graph_batch_sizes" not in given and _is_int(given["max_batch"]):
        buckets = data.get("decode_graph_batch_sizes")
        if isinstance(buckets, list) and all(_is_int(b) for b in buckets):
            old_batch = data.get("max_batch", 64)
            data["decode_graph_batch_sizes"] = list(graph_buckets_for_batch(
                tuple(buckets), old_batch if _is_int(old_batch) else 64, given["max_batch"]))
    return {**data, **given}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def plan_from_configs(model: str, hardware: str, serving: str | None,
                      overrides: dict[str, Any] | None = None) -> MemoryPlan:
    """Load the model, hardware and serving configs (with flag overrides) and build their plan. ``serving``
    None: the hardware's default_serving (the same for ``memplan plan`` and ``memplan run``). A quantity
    that leaves its checked width is a ConfigError naming the three configs."""
    from planner.plan import build_plan

    hardware_config = load_hardware(hardware)
    if serving is None:
        serving = check_default_serving(hardware_config, str(_resolve(hardware, "hardware")))
    configs = load_model(model), hardware_config, load_serving(serving, overrides)
    source = serving_source(serving, overrides)
    try:
        return build_plan(*configs, serving_source=source)
    except CheckedOverflowError as error:
        names = f"{model_path(model)} + {_resolve(hardware, 'hardware')} + {source}"
        raise overflow_error(names, error) from None


def check_default_serving(hardware: HardwareConfig, source: str) -> str:
    """The hardware's default_serving; a ConfigError naming ``source`` (its file) where it names no serving
    file and no shipped serving config."""
    if resolve_config(hardware.default_serving, "serving") is None:
        raise ConfigError(source, "default_serving", hardware.default_serving,
                          "names no serving file and no shipped serving config (configs/serving/*.yaml); give "
                          "--serving")
    return hardware.default_serving


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
        field = _field_path(first)
        cause = first.get("ctx", {}).get("error")
        if isinstance(cause, FieldRule):  # a rule between fields: name the field it reports, not the mapping
            prefix = f"{field}." if field else ""
            raise ConfigError(source, prefix + cause.field, cause.value, _rule(first)) from None
        raise ConfigError(source, field, first.get("input"), _rule(first)) from None
    except (TypeError, ValueError) as error:  # a value that skipped planner.inputs (a caller's own dict)
        raise ConfigError(source, "", "", f"not plain JSON values: {error}") from None


#: What pydantic adds to an error's location for the branch of a union it tried ("constrained-int",
#: "literal['auto']", "function-after[...]", "int"): not a field, so not in the path an error names.
_UNION_BRANCH = re.compile(r"^(constrained-\w+|[a-z-]+\[.*\]|int|float|str|bool|none)$")


def _field_path(error: dict[str, Any]) -> str:
    """The dotted field path of a pydantic error, without union branch tags (an unknown key stays as given)."""
    loc = list(error["loc"])
    keep = [part for index, part in enumerate(loc)
            if not (isinstance(part, str) and _UNION_BRANCH.match(part)
                    and not (error["type"] == "extra_forbidden" and index == len(loc) - 1))]
    return ".".join(str(part) for part in keep)


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
    if _exists(path, spec):
        return path
    folder = CONFIG_ROOT / kind
    name = spec.lower()
    name = ALIASES.get(kind, {}).get(name, name)
    shipped = folder / f"{name}.yaml"
    if _exists(shipped, spec):
        return shipped
    names = sorted(p.stem for p in folder.glob("*.yaml"))
    close = difflib.get_close_matches(name, [*names, *ALIASES.get(kind, {})], n=3, cutoff=0.6)
    suggestion = "; did you mean " + " or ".join(
        dict.fromkeys(ALIASES.get(kind, {}).get(c, c) for c in close)) + "?" if close else ""
    raise ConfigError(spec, "", spec, f"no such file, and not a shipped {kind} name "
                                      f"({', '.join(names)}){suggestion}")


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
