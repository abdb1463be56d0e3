"""The requests of a ``memplan run`` and their output lines.

Requests come from ``--prompt`` (text, repeatable), ``--requests`` (JSONL objects, see ``REQUEST_KEYS``),
``--prompt-ids`` (the same objects, ``prompt_ids`` required), a synthetic shared-prefix workload
(``--num-requests``) or ``--batch`` random prompts. Text (``--prompt``, a line's ``"prompt"`` or chat
``"messages"``) is tokenized with the checkpoint's tokenizer (executor.tokenizer); without one it is an
error. Each request becomes a ``RequestSpec``, takes the run's sampling defaults for the keys it does not
set (``apply_sampling``) and, without a seed of its own, a seed of its own drawn from ``--seed`` and its
place in the run (``request_seed``: unseeded requests sample independently, as in vLLM, and a run repeats
with the same ``--seed``), and is then checked against ``RequestLimits`` (the plan's vocabulary and context,
the kernels' integer widths) before anything is allocated:

- a file line that is not a request (not JSON, not an object, an unknown key, a value of the wrong type,
  text or stop strings without a tokenizer) makes the file bad: a ``RequestFileError`` naming the file,
  line and field (exit 2, before any work);
- a request whose values the plan or the kernels cannot serve (an id outside the vocabulary, a length over
  max_context, a seed outside u64, top_k over the vocabulary, a temperature below 0 or beyond float32,
  top_p outside (0, 1], an empty stop string) is rejected in its own output line, naming the field, and
  never reaches the engine; the others run;
- a flag out of its range is a ``RunError`` naming the flag (exit 2, before any work).

The output is one JSONL line per request (``output_record``, with ``"text"`` when there is a tokenizer),
written and flushed as the request finishes (``OutputWriter``): in finish order, each naming its input
index. With ``--out`` the lines go to ``OUT.partial``, renamed to ``OUT`` when the run ends.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from planner.errors import ConfigError, escaped
from planner.inputs import MAX_REQUEST_FILE_BYTES, parse_json, read_text

if TYPE_CHECKING:
    from executor.generation import Sampling
    from executor.tokenizer import Tokenizer

#: Keys a --requests (or --prompt-ids) line may hold.
REQUEST_KEYS = ("prompt_ids", "prompt_len", "prompt", "messages", "max_new_tokens", "stop_ids", "stop",
                "ignore_eos", "temperature", "top_p", "top_k", "seed")
#: A --requests line gives its prompt as exactly one of these.
PROMPT_KEYS = ("prompt_ids", "prompt_len", "prompt", "messages")
#: Sampling keys of a line; those it leaves out take the run's defaults (executor.generation).
SAMPLING_KEYS = ("temperature", "top_p", "top_k")
#: Seeds are the sampler's 64-bit RNG key (and numpy's / torch's seed): an unsigned 64-bit integer.
SEED_LIMIT = 1 << 64
#: The sampler keeps temperatures as float32.
FLOAT32_MAX = 3.4028234663852886e38
#: Most requests one run takes (file lines and synthetic requests together).
MAX_REQUESTS = 1 << 20
#: The suffix of the file --out's lines are written to until the run ends.
PARTIAL_SUFFIX = ".partial"

#: A synthetic shared-prefix workload's later requests arrive before this step: the first request's
#: prefill (step 0) has been updated by then, its prefix pages cached, also when the engine overlaps
#: steps (it updates step 0 after launching step 1).
SHARED_PREFIX_ARRIVAL_STEP = 2


class RunError(RuntimeError):
    """A ``memplan run`` usage error (conflicting or missing arguments, an impossible device)."""


class RequestFileError(ValueError):
    """A request file cannot be read or holds a line that is not a request."""


@dataclass(frozen=True)
class RequestLimits:
    """What a request may ask of the plan: ids below ``vocab_size``, lengths up to ``max_context``."""

    vocab_size: int
    max_context: int


@dataclass
class RequestSpec:
    """One request as read from the command line, before it becomes an engine ``Request``."""

    prompt_ids: list[int]
    max_new_tokens: int
    stop_ids: list[int] = field(default_factory=list)
    temperature: float = 0.0
    top_k: int = 0
    seed: int = 0  # in [0, SEED_LIMIT); the engine gets it as the int64 of the same 64 bits (engine_seed)
    arrival_step: int = 0
    error: str | None = None  # rejected here (a value the plan or kernels cannot serve): never reaches the engine
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)  # stop strings (need a tokenizer)
    ignore_eos: bool = False  # the request's own ignore_eos (the run's --ignore-eos applies to all)
    given: frozenset[str] = frozenset()  # the SAMPLING_KEYS (and "seed") the request set itself
    prompt_key: str = "prompt_ids"  # where the prompt came from ("prompt", "messages", "--prompt"): errors name it
    arrival_s: float | None = None  # seconds after the engine starts at which it arrives (None: by arrival_step)
    prompt_len: int = 0  # a "prompt_len" line's length: its output line names it where no ids were drawn


def request_seed(run_seed: int, index: int) -> int:
    """The seed of the ``index``-th request of a run seeded ``run_seed`` that sets none: a u64 of its own, so
    unseeded requests draw independent samples (two equal prompts differ, as in vLLM) and the run repeats."""
    import numpy as np

    return int(np.random.SeedSequence((run_seed, index)).generate_state(1, np.uint64)[0])


def engine_seed(seed: int) -> int:
    """A u64 seed as the int64 with the same 64 bits: the sampler's RNG key (kernels/sampler.py)."""
    return seed - SEED_LIMIT if seed >= SEED_LIMIT >> 1 else seed


def read_requests(args: argparse.Namespace, limits: RequestLimits, tokenizer: Tokenizer | None = None,
                  sampling: Sampling | None = None) -> list[RequestSpec]:
    """The requests of ``--prompt``, ``--requests``, ``--prompt-ids`` and the synthetic workload, in that order;
    with none of them, ``--batch`` (default 1) random prompts of ``--prompt-len`` ids. ``sampling``: the run's
    defaults for the sampling keys a request does not set (``apply_sampling``), applied before the checks.
    See the module docstring for what is refused (RequestFileError, RunError) and what is rejected in its own
    line (``RequestSpec.error``)."""
    import numpy as np

    _check_flag("--seed", args.seed, 0, SEED_LIMIT - 1)
    _check_flag("--max-new-tokens", args.max_new_tokens, 1, None)
    specs: list[RequestSpec] = []
    for text in args.prompt or []:
        specs.append(RequestSpec(encode_prompt(tokenizer, text, "--prompt"), args.max_new_tokens,
                                 prompt_key="--prompt"))
    if args.requests:
        specs += read_request_file(Path(args.requests), args.max_new_tokens, limits, args.seed, tokenizer, sampling)
    if args.prompt_ids:
        specs += read_request_file(Path(args.prompt_ids), args.max_new_tokens, limits, args.seed, tokenizer,
                                   sampling, prompt_ids_only=True)
    if args.num_requests is not None:
        specs += synthetic_requests(args, limits)
    elif any(value is not None for value in (args.input_len, args.output_len)) or args.shared_prefix:
        raise RunError("--input-len, --output-len and --shared-prefix need --num-requests N")
    if args.batch is not None or not specs:
        batch = 1 if args.batch is None else args.batch
        _check_flag("--batch", batch, 1, MAX_REQUESTS)
        _check_flag("--prompt-len", args.prompt_len, 1, limits.max_context, "the plan's max_context")
        _check_flag("--max-new-tokens", args.max_new_tokens, 1, limits.max_context, "the plan's max_context")
        _check_total("--prompt-len", args.prompt_len, "--max-new-tokens", args.max_new_tokens, limits)
        rng = np.random.default_rng(args.seed)
        specs += [RequestSpec(rng.integers(0, limits.vocab_size, args.prompt_len).tolist(), args.max_new_tokens)
                  for _ in range(batch)]
    if len(specs) > MAX_REQUESTS:
        raise RunError(f"{len(specs):,} requests: at most {MAX_REQUESTS:,} in one run")
    for index, spec in enumerate(specs):
        if "seed" not in spec.given:
            spec.seed = request_seed(args.seed, index)
        settle(spec, limits, sampling)
    return specs


def settle(spec: RequestSpec, limits: RequestLimits, sampling: Sampling | None) -> None:
    """The run's sampling defaults into ``spec`` (when given), then its rejection, if any (idempotent)."""
    if sampling is not None:
        apply_sampling(spec, sampling)
    if spec.error is None:
        spec.error = _rejection(spec, limits)


def apply_sampling(spec: RequestSpec, sampling: Sampling) -> None:
    """The run's sampling defaults for the SAMPLING_KEYS ``spec`` did not set itself."""
    for key in SAMPLING_KEYS:
        if key not in spec.given:
            setattr(spec, key, getattr(sampling, key))


def add_eos(specs: list[RequestSpec], eos_ids: tuple[int, ...], ignore_eos: bool) -> None:
    """The checkpoint's EOS ids join each request's stop ids, unless the run or the request ignores them."""
    for spec in specs:
        if eos_ids and not (ignore_eos or spec.ignore_eos):
            spec.stop_ids = list(dict.fromkeys([*spec.stop_ids, *eos_ids]))


def encode_prompt(tokenizer: Tokenizer | None, text: str, where: str) -> list[int]:
    """A text prompt's ids; without a tokenizer a RunError saying where the text came from."""
    if tokenizer is None:
        raise RunError(f"{where}: text needs a tokenizer, and this run has none (no checkpoint's tokenizer.json, "
                       "no --tokenizer): give --tokenizer DIR, or ids (--prompt-ids, \"prompt_ids\")")
    return tokenizer.encode(text)


def mark_out_of_vocabulary(specs: list[RequestSpec], vocab_size: int) -> None:
    """Mark rejected (``error``) each request with a prompt id outside [0, vocab_size)."""
    for spec in specs:
        if spec.error is None:
            spec.error = _out_of_vocabulary(spec, vocab_size)


def _out_of_vocabulary(spec: RequestSpec, vocab: int) -> str | None:
    bad = next(((i, t) for i, t in enumerate(spec.prompt_ids) if not 0 <= t < vocab), None)
    if bad is None:
        return None
    return f"{spec.prompt_key}: id {bad[1]} at position {bad[0]} is outside the vocabulary [0, {vocab})"


def _check_flag(flag: str, value: int, low: int, high: int | None, what: str = "") -> None:
    if value < low or (high is not None and value > high):
        bound = f"in [{low}, {high:,}]" + (f" ({what})" if what else "") if high is not None else f">= {low}"
        raise RunError(f"{flag} {value}: must be {bound}")


def _check_total(prompt_flag: str, prompt: int, output_flag: str, output: int, limits: RequestLimits) -> None:
    """Synthetic requests are all alike: one over max_context would reject them all, so it is a flag error."""
    if prompt + output > limits.max_context:
        raise RunError(f"{prompt_flag} {prompt} + {output_flag} {output} = {prompt + output:,}: a request must fit "
                       f"the plan's max_context {limits.max_context:,}")


def _rejection(spec: RequestSpec, limits: RequestLimits) -> str | None:
    """Why the plan or the kernels cannot serve ``spec`` (None: they can), naming the field. The scheduler adds
    the rules that involve the plan's pools (prompt + max_new_tokens over max_context, KV pages)."""
    vocab, context = limits.vocab_size, limits.max_context
    where = spec.prompt_key
    unit = "ids" if where == "prompt_ids" else "tokens"
    if not spec.prompt_ids:
        return f"{where}: empty"
    if len(spec.prompt_ids) > context:
        return f"{where}: {len(spec.prompt_ids)} {unit}, over the plan's max_context {context}"
    out_of_vocabulary = _out_of_vocabulary(spec, vocab)
    if out_of_vocabulary is not None:
        return out_of_vocabulary
    if not 1 <= spec.max_new_tokens <= context:
        return f"max_new_tokens = {spec.max_new_tokens}: must be in [1, {context}] (the plan's max_context)"
    bad_stop = next((t for t in spec.stop_ids if not 0 <= t < vocab), None)
    if bad_stop is not None:
        return f"stop_ids: id {bad_stop} is outside the vocabulary [0, {vocab})"
    if not 0 <= spec.temperature <= FLOAT32_MAX:
        return f"temperature = {spec.temperature!r}: must be in [0, {FLOAT32_MAX:.4g}] (float32)"
    if not 0 < spec.top_p <= 1:
        return f"top_p = {spec.top_p!r}: must be in (0, 1] (1: no nucleus)"
    if not 0 <= spec.top_k <= vocab:
        return f"top_k = {spec.top_k}: must be in [0, {vocab}] (0: no restriction; at most the vocabulary)"
    if not 0 <= spec.seed < SEED_LIMIT:
        return f"seed = {spec.seed}: must be in [0, 2**64) (an unsigned 64-bit RNG key)"
    if any(not s for s in spec.stop):
        return "stop: an empty string (every stop string has at least one character)"
    return None


def synthetic_requests(args: argparse.Namespace, limits: RequestLimits) -> list[RequestSpec]:
    """``--num-requests`` prompts of ``--input-len`` random ids sharing their first ``--shared-prefix`` ids.

    With a shared prefix the first request arrives at step 0 and the others at step 1: pages enter the prefix
    cache after the step that fills them, so requests admitted together could not share them."""
    import numpy as np

    count = args.num_requests
    length = args.prompt_len if args.input_len is None else args.input_len
    new_tokens = args.max_new_tokens if args.output_len is None else args.output_len
    prefix = args.shared_prefix
    _check_flag("--num-requests", count, 1, MAX_REQUESTS)
    length_flag = "--input-len" if args.input_len is not None else "--prompt-len"
    tokens_flag = "--output-len" if args.output_len is not None else "--max-new-tokens"
    _check_flag(length_flag, length, 1, limits.max_context, "the plan's max_context")
    _check_flag(tokens_flag, new_tokens, 1, limits.max_context, "the plan's max_context")
    _check_total(length_flag, length, tokens_flag, new_tokens, limits)
    if not 0 <= prefix <= length:
        raise RunError(f"--shared-prefix must be in [0, --input-len {length}], got {prefix}")
    rng = np.random.default_rng(args.seed)
    shared = rng.integers(0, limits.vocab_size, prefix).tolist()
    return [RequestSpec(shared + rng.integers(0, limits.vocab_size, length - prefix).tolist(), new_tokens,
                        arrival_step=SHARED_PREFIX_ARRIVAL_STEP if prefix and index else 0)
            for index in range(count)]


def _read_lines(path: Path) -> list[str]:
    try:
        return read_text(path, MAX_REQUEST_FILE_BYTES).splitlines()
    except ConfigError as error:
        raise RequestFileError(str(error)) from None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_int_list(value: Any) -> bool:
    return isinstance(value, list) and all(_is_int(t) for t in value)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_stop(value: Any) -> bool:
    return isinstance(value, str) or (isinstance(value, list) and all(isinstance(s, str) for s in value))


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in value)


#: What each key's value must be (its type: the bounds are the rejection rules).
_KEY_TYPES = {"prompt_ids": (_is_int_list, "a list of ints"), "prompt_len": (_is_int, "an int"),
              "max_new_tokens": (_is_int, "an int"), "stop_ids": (_is_int_list, "a list of ints"),
              "temperature": (_is_number, "a number"), "top_k": (_is_int, "an int"), "seed": (_is_int, "an int"),
              "prompt": (lambda value: isinstance(value, str), "a string"),
              "messages": (_is_messages, "a non-empty list of {\"role\": str, \"content\": ...} objects"),
              "top_p": (_is_number, "a number"), "stop": (_is_stop, "a string or a list of strings"),
              "ignore_eos": (lambda value: isinstance(value, bool), "true or false")}


def read_request_file(path: Path, max_new_tokens: int, limits: RequestLimits, seed: int,
                      tokenizer: Tokenizer | None = None, sampling: Sampling | None = None,
                      prompt_ids_only: bool = False) -> list[RequestSpec]:
    """One request object per non-blank line (see ``REQUEST_KEYS``); ``prompt_len`` draws random ids from the
    line's ``seed`` (else ``--seed``) and its line number; ``prompt`` and ``messages`` are tokenized, then
    length-checked like ids. ``sampling``: the run's defaults (see ``read_requests``). ``prompt_ids_only``
    (``--prompt-ids``): every line gives ``prompt_ids``."""
    import numpy as np

    specs = []
    for number, line in enumerate(_read_lines(path), start=1):
        if not line.strip():
            continue
        where = f"{path} line {number}"
        try:
            record = parse_json(line, where)
        except ConfigError as error:  # the file's line is known: name the column within it, and the key
            field = escaped(error.field.removeprefix("line 1, "))
            raise RequestFileError(f"{where}: " + (f"{field}: " if field else "") + escaped(error.rule)) from None

        def bad(message: str) -> RequestFileError:
            return RequestFileError(f"{where}: {message}")

        if not isinstance(record, dict):
            raise bad("expected a JSON object")
        unknown = sorted(set(record) - set(REQUEST_KEYS))
        if unknown:
            raise bad(f"unknown field {unknown[0]!r} (expected {', '.join(REQUEST_KEYS)})")
        if prompt_ids_only and "prompt_ids" not in record:
            raise bad("expected {\"prompt_ids\": [int, ...]} (and optionally "
                      + ", ".join(key for key in REQUEST_KEYS if key not in PROMPT_KEYS) + ")")
        if sum(key in record for key in PROMPT_KEYS) != 1:
            raise bad("give exactly one of \"prompt_ids\": [int, ...], \"prompt_len\": int, \"prompt\": text and "
                      "\"messages\": [{\"role\": ..., \"content\": ...}, ...]")
        for key, value in record.items():
            is_type, kind = _KEY_TYPES[key]
            if not is_type(value):
                raise bad(f"{key}: expected {kind}, got {json.dumps(value)[:40]}")
        text_key = next((key for key in ("prompt", "messages", "stop") if key in record), None)
        if text_key is not None and tokenizer is None:
            needs = "stop strings need" if text_key == "stop" else "text needs"
            raise bad(f"{text_key}: {needs} a tokenizer, and this run has none (no checkpoint's tokenizer.json, "
                      "no --tokenizer): give --tokenizer DIR, or \"prompt_ids\"")
        stop = [record["stop"]] if isinstance(record.get("stop"), str) else list(record.get("stop", []))
        line_seed = record.get("seed", seed)
        prompt_key = next(key for key in PROMPT_KEYS if key in record)
        spec = RequestSpec([], record.get("max_new_tokens", max_new_tokens), list(record.get("stop_ids", [])),
                           float(record.get("temperature", 0.0)), record.get("top_k", 0), line_seed,
                           top_p=float(record.get("top_p", 1.0)), stop=stop,
                           ignore_eos=record.get("ignore_eos", False),
                           given=frozenset(key for key in (*SAMPLING_KEYS, "seed") if key in record),
                           prompt_key="prompt_ids" if prompt_key == "prompt_len" else prompt_key)
        if prompt_key == "prompt_ids":
            spec.prompt_ids = list(record["prompt_ids"])
        elif prompt_key in ("prompt", "messages"):
            spec.prompt_ids = _text_prompt(record, tokenizer, bad)
        elif not 1 <= record["prompt_len"] <= limits.max_context:
            spec.prompt_len = record["prompt_len"]
            spec.error = (f"prompt_len = {record['prompt_len']}: must be in [1, {limits.max_context}] (the plan's "
                          "max_context)")
        elif not 0 <= line_seed < SEED_LIMIT:
            spec.error = f"seed = {line_seed}: must be in [0, 2**64) (an unsigned 64-bit RNG key)"
        else:
            spec.prompt_ids = np.random.default_rng((line_seed, number)).integers(
                0, limits.vocab_size, record["prompt_len"]).tolist()
        settle(spec, limits, sampling)
        specs.append(spec)
        if len(specs) > MAX_REQUESTS:
            raise bad(f"more than {MAX_REQUESTS:,} requests in one run")
    if not specs:
        raise RequestFileError(f"{path}: no requests (the file has no non-blank line)")
    return specs


def _text_prompt(record: dict, tokenizer: Tokenizer, bad: Callable[[str], RequestFileError]) -> list[int]:
    """The ids of a line's ``prompt`` (text) or ``messages`` (a chat, through the chat template)."""
    from executor.tokenizer import TokenizerError

    if "prompt" in record:
        return tokenizer.encode(record["prompt"])
    try:
        return tokenizer.encode_chat(record["messages"])
    except TokenizerError as error:
        raise bad(f"messages: {error}") from None


def output_record(index: int, spec: RequestSpec, result: Any | None, text: str | None = None) -> dict:
    """One request's output line; ``result`` is the engine's RequestResult (None: rejected here); ``text``
    (its detokenized output, when the run has a tokenizer) goes beside ``output_ids``."""
    if text is not None:  # the record without text, "text" inserted after "output_ids"
        items = list(output_record(index, spec, result).items())
        at = [key for key, _ in items].index("output_ids") + 1
        return dict(items[:at] + [("text", text)] + items[at:])
    if result is None:
        return {"request": index, "prompt_len": len(spec.prompt_ids) or spec.prompt_len, "output_ids": [],
                "finish_reason": "rejected",
                "ttft_ms": None, "token_latencies_ms": [], "error": spec.error}
    record = {"request": index, "prompt_len": result.prompt_len, "output_ids": list(result.output_ids),
              "finish_reason": result.finish_reason,
              "ttft_ms": None if result.ttft_s is None else round(result.ttft_s * 1e3, 3),
              "token_latencies_ms": [round(latency * 1e3, 3) for latency in result.token_latencies_s]}
    if result.error is not None:
        record["error"] = result.error
    return record


def partial_path(out: Path) -> Path:
    """Where --out's lines are written until the run ends: ``OUT.partial``, next to ``OUT``."""
    return out.with_name(out.name + PARTIAL_SUFFIX)


class OutputWriter:
    """Output lines written as requests finish, each flushed: to ``out``'s ``OUT.partial`` (opened at the start,
    so an interrupted run keeps what finished there), else to ``stream`` (stdout); ``None`` and no ``out``: no
    lines. ``commit()`` renames ``OUT.partial`` to ``OUT`` (with the mode of the file it replaces); ``close()``
    without it leaves ``OUT`` untouched and the partial lines in ``OUT.partial``. ``out`` is checked by
    planner.output_file.check_out_path before the run (``OUT`` and ``OUT.partial``)."""

    def __init__(self, out: Path | None, stream: TextIO | None):
        from planner.output_file import COMMAND_LINE, OUT_FLAG, file_mode
        from planner.inputs import reason

        self._out = out
        self._file = None
        if out is not None:
            partial = partial_path(out)
            try:
                mode = file_mode(out)
                handle = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
                os.fchmod(handle, mode)
                self._file = os.fdopen(handle, "w", encoding="utf-8")
            except OSError as error:
                raise ConfigError(COMMAND_LINE, OUT_FLAG, str(partial), f"cannot write: {reason(error)}") from None
        self._stream = self._file or stream

    def write(self, record: dict) -> None:
        if self._stream is not None:
            self._stream.write(json.dumps(record) + "\n")
            self._stream.flush()

    def commit(self) -> None:
        """The run ended: ``OUT.partial`` becomes ``OUT`` (one rename)."""
        if self._file is None:
            return
        from planner.output_file import COMMAND_LINE, OUT_FLAG
        from planner.inputs import reason

        try:
            os.fsync(self._file.fileno())
            self.close()
            os.replace(partial_path(self._out), self._out)
        except OSError as error:
            raise ConfigError(COMMAND_LINE, OUT_FLAG, str(self._out), f"cannot write: {reason(error)}") from None

    def close(self) -> None:
        if self._file is not None and not self._file.closed:
            self._file.close()
