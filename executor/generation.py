"""How requests generate: the checkpoint's defaults, the sampling parameters, stop strings and text.

``read_generation_defaults(DIR, vocab_size)`` reads what a checkpoint says about generation:

- EOS ids: generation_config.json's ``eos_token_id`` (an int or a list), else config.json's (top level,
  then a multimodal wrapper's ``text_config``). A request stops when it samples one (finish_reason
  "stop", the id kept in ``output_ids``) unless it asks ``ignore_eos`` (vLLM's name).
- Sampling: what HF ``generate`` does with the checkpoint. With ``do_sample: true`` its
  ``temperature``, ``top_p`` and ``top_k`` (HF's defaults 1.0, 1.0 and 50 for the ones it leaves
  out); without, greedy.

A request's sampling parameter comes from, in order: the request (a --requests line, or the Python
API's ``SamplingParams``), the run (``--temperature``, ``--top-p``, ``--top-k``), the checkpoint's
defaults, greedy. ``resolve_sampling`` merges the run's flags into the checkpoint's defaults field by
field and says where each came from (the run report prints it).

Stop strings (``stop``, vLLM's name): ``RequestText`` detokenizes a request's ids as they arrive and
finishes the request when its text contains one (finish_reason "stop"); the text ends before the
stop string, the ids end with the token that completed it. It also streams the text (a single
``--prompt`` on the terminal), holding back the last ``len(longest stop) - 1`` characters until
they cannot begin a stop string.

Host-side: neither torch nor numba.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from planner.errors import ConfigError

if TYPE_CHECKING:
    from executor.tokenizer import IncrementalDetokenizer, Tokenizer

GENERATION_CONFIG_FILE = "generation_config.json"
MODEL_CONFIG_FILE = "config.json"
#: HF GenerationConfig's values for sampling fields a generation_config.json with do_sample leaves out.
HF_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50}
#: The seed is the sampler's 64-bit RNG key.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
#: Sampling fields a run flag, a request line or SamplingParams may set.
SAMPLING_FIELDS = ("temperature", "top_p", "top_k")
#: generation_config.json fields that change sampling and are not applied here, with their neutral value:
#: the report names those a checkpoint sets to something else.
UNAPPLIED_FIELDS = {"repetition_penalty": 1.0, "min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                    "typical_p": 1.0, "no_repeat_ngram_size": 0}


@dataclass(frozen=True)
class Sampling:
    """Sampling parameters and where each came from ("checkpoint DIR/generation_config.json", "--top-p", ...)."""

    temperature: float = 0.0  # <= 0: greedy
    top_p: float = 1.0  # 1: no nucleus
    top_k: int = 0  # 0: no restriction
    sources: tuple[tuple[str, str], ...] = ()  # (field, source) of the fields not at the greedy default

    @property
    def is_greedy(self) -> bool:
        return not self.temperature > 0 or self.top_k == 1

    def describe(self) -> str:
        """One line for the run report."""
        values = f"temperature {self.temperature:g}, top_p {self.top_p:g}, top_k {self.top_k}"
        if not self.sources:
            return f"greedy ({values}: no checkpoint defaults, no run flags)"
        by_source: dict[str, list[str]] = {}
        for name, source in self.sources:
            by_source.setdefault(source, []).append(name)
        origin = "; ".join(f"{', '.join(names)} from {source}" for source, names in by_source.items())
        return f"{values} ({origin}) for requests that set none"


@dataclass(frozen=True)
class GenerationDefaults:
    """What a checkpoint says about generation: its EOS ids and its sampling defaults."""

    eos_ids: tuple[int, ...] = ()
    eos_source: str | None = None  # the file that named them
    sampling: Sampling = Sampling()
    unapplied: tuple[str, ...] = ()  # "repetition_penalty 1.05", ...: set by the checkpoint, not applied here

    def describe_eos(self, ignore_eos: bool) -> str:
        if not self.eos_ids:
            return "none (the checkpoint names no eos_token_id): requests stop at max_new_tokens or their stop ids"
        ids = ", ".join(str(i) for i in self.eos_ids)
        suffix = " ignored (--ignore-eos)" if ignore_eos else " stop requests (finish_reason \"stop\")"
        return f"[{ids}] from {self.eos_source}:{suffix}"


def read_generation_defaults(directory: str | Path | None, vocab_size: int) -> GenerationDefaults:
    """The generation defaults of a checkpoint directory (none for None or a directory without the files);
    a malformed field is a ConfigError naming the file and the field."""
    if directory is None:
        return GenerationDefaults()
    directory = Path(directory)
    generation_path, config_path = directory / GENERATION_CONFIG_FILE, directory / MODEL_CONFIG_FILE
    generation = _read_object(generation_path)
    config = _read_object(config_path)
    eos_ids, eos_source = (), None
    for path, data, where in ((generation_path, generation, ""), (config_path, config, ""),
                              (config_path, config.get("text_config") or {}, "text_config.")):
        if isinstance(data, dict) and data.get("eos_token_id") is not None:
            eos_ids = _eos_ids(data["eos_token_id"], str(path), f"{where}eos_token_id", vocab_size)
            eos_source = str(path)
            break
    unapplied = tuple(f"{name} {generation[name]}" for name, neutral in UNAPPLIED_FIELDS.items()
                      if generation.get(name) not in (None, neutral))
    return GenerationDefaults(eos_ids, eos_source, _checkpoint_sampling(generation, str(generation_path)), unapplied)


def resolve_sampling(checkpoint: Sampling, *, temperature: float | None = None, top_p: float | None = None,
                     top_k: int | None = None) -> Sampling:
    """The run's sampling defaults: each flag given replaces the checkpoint's value of its field."""
    flags = {"temperature": temperature, "top_p": top_p, "top_k": top_k}
    given = {name: value for name, value in flags.items() if value is not None}
    if not given:
        return checkpoint
    check_sampling("run flags", **given)
    sources = dict(checkpoint.sources)
    sources.update({name: f"--{name.replace('_', '-')}" for name in given})
    return replace(checkpoint, **given, sources=tuple(sources.items()))


def check_sampling(source: str, temperature: float | None = None, top_p: float | None = None,
                   top_k: int | None = None) -> None:
    """The rules of the sampling fields (ConfigError naming ``source``): temperature a finite number >= 0,
    top_p in (0, 1], top_k an int >= 0."""
    if temperature is not None and not (_is_number(temperature) and math.isfinite(temperature) and temperature >= 0):
        raise ConfigError(source, "temperature", temperature, "expected a finite number >= 0 (0: greedy)")
    if top_p is not None and not (_is_number(top_p) and 0 < top_p <= 1):
        raise ConfigError(source, "top_p", top_p, "expected a number in (0, 1] (1: no nucleus)")
    if top_k is not None and not (isinstance(top_k, int) and not isinstance(top_k, bool) and top_k >= 0):
        raise ConfigError(source, "top_k", top_k, "expected an int >= 0 (0: no restriction)")


class SamplingParams(BaseModel):
    """How one request of the Python API generates (vLLM's ``SamplingParams``, with its names where they mean
    the same). A field left None takes the LLM's defaults: the checkpoint's generation_config.json, else greedy."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_new_tokens: int = Field(16, ge=1, description="tokens generated at most (vLLM's max_tokens)")
    temperature: float | None = Field(None, ge=0, allow_inf_nan=False, description="0: greedy")
    top_p: float | None = Field(None, gt=0, le=1, description="nucleus mass; 1: no nucleus")
    top_k: int | None = Field(None, ge=0, description="0: no restriction")
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX,
                             description="the request's RNG key (default: one of its own, from the LLM's seed and "
                                         "the request's place among its requests: unseeded requests sample apart)")
    stop: tuple[str, ...] = Field((), description="stop strings: the text ends before the first one")
    stop_ids: tuple[int, ...] = Field((), description="ids that stop the request (kept in output_ids)")
    ignore_eos: bool = Field(False, description="generate past the checkpoint's EOS ids")

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop_string(cls, value: Any) -> Any:
        return (value,) if isinstance(value, str) else value

    @field_validator("stop")
    @classmethod
    def _non_empty_stop_strings(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if any(not text for text in value):
            raise ValueError("stop strings must not be empty")
        return value


class RequestText:
    """One request's text as its ids arrive: stop strings checked, the text streamed to ``on_text``."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = (), on_text: Callable[[str], None] | None = None):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.detokenizer: IncrementalDetokenizer = tokenizer.detokenizer()
        self.on_text = on_text
        self._hold = max((len(text) for text in self.stop), default=1) - 1  # chars that may begin a stop string
        self._shown = ""

    def add(self, ids: Sequence[int]) -> bool:
        """Take the request's new ids; True when its text contains a stop string."""
        before = len(self.detokenizer.text)
        self.detokenizer.add(ids)
        text = self.detokenizer.text
        cut = first_stop(text, self.stop, max(0, before - self._hold))
        if cut is not None:
            self._show(text[:cut])
            return True
        self._show(text[: len(text) - self._hold])
        return False

    def finish(self, output_ids: Sequence[int]) -> str:
        """The request's final text (the whole decode, cut before its first stop string); streams the rest."""
        text = finished_text(self.tokenizer, output_ids, self.stop)
        self._show(text)
        return text

    def _show(self, text: str) -> None:
        if self.on_text is not None and len(text) > len(self._shown) and text.startswith(self._shown):
            self.on_text(text[len(self._shown) :])
            self._shown = text


def finished_text(tokenizer: Tokenizer, output_ids: Sequence[int], stop: Sequence[str] = ()) -> str:
    """A finished request's text: its ids decoded (special tokens skipped), cut before its first stop string."""
    text = tokenizer.decode(output_ids)
    cut = first_stop(text, stop, 0)
    return text if cut is None else text[:cut]


def first_stop(text: str, stop: Sequence[str], start: int) -> int | None:
    """Where the earliest stop string in ``text[start:]`` begins, or None."""
    hits = [index for index in (text.find(s, start) for s in stop) if index >= 0]
    return min(hits) if hits else None


def _checkpoint_sampling(generation: Mapping[str, Any], source: str) -> Sampling:
    if generation.get("do_sample") is not True:
        return Sampling()
    values = {name: generation.get(name, HF_SAMPLING_DEFAULTS[name]) for name in SAMPLING_FIELDS}
    values = {name: (HF_SAMPLING_DEFAULTS[name] if value is None else value) for name, value in values.items()}
    check_sampling(source, **values)
    sources = tuple((name, f"{source}" if name in generation else f"HF's default ({source} has do_sample)")
                    for name in SAMPLING_FIELDS)
    return Sampling(float(values["temperature"]), float(values["top_p"]), int(values["top_k"]), sources)


def _eos_ids(value: Any, source: str, field: str, vocab_size: int) -> tuple[int, ...]:
    ids = [value] if not isinstance(value, list) else value
    if not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ConfigError(source, field, value, "expected an int or a non-empty list of ints")
    outside = [i for i in ids if not 0 <= i < vocab_size]
    if outside:
        raise ConfigError(source, field, value, f"id {outside[0]} is outside the vocabulary [0, {vocab_size})")
    return tuple(dict.fromkeys(ids))


def _read_object(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except OSError as error:
        raise ConfigError(str(path), "", "", f"cannot read: {error.strerror}") from None
    except json.JSONDecodeError as error:
        raise ConfigError(str(path), f"line {error.lineno}", "", f"malformed JSON: {error.msg}") from None
    if not isinstance(data, dict):
        raise ConfigError(str(path), "", "", "expected a JSON object")
    return data


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
