"""The requests of a ``memplan run`` and their output lines.

Requests come from ``--prompt`` (text, repeatable), ``--requests`` (JSONL objects, see ``REQUEST_KEYS``),
``--prompt-ids`` (JSONL prompt lists), a synthetic shared-prefix workload (``--num-requests``) or
``--batch`` random prompts. Each becomes a ``RequestSpec``; one with an id outside the vocabulary is
marked rejected here and never reaches the engine. Text (``--prompt``, a line's ``"prompt"`` or chat
``"messages"``) is tokenized with the checkpoint's tokenizer (executor.tokenizer); without one it is an
error. A malformed file line is a ``RequestFileError`` naming the file and line; conflicting flags a
``RunError``. The output is one JSONL line per request (``output_record``, with ``"text"`` when there
is a tokenizer), written and flushed as the request finishes (``OutputWriter``): in finish order, each
naming its input index.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from executor.generation import Sampling
    from executor.tokenizer import Tokenizer

#: Keys a --requests line may hold.
REQUEST_KEYS = ("prompt_ids", "prompt_len", "max_new_tokens", "stop_ids", "temperature", "top_k", "seed",
                "prompt", "messages", "top_p", "stop", "ignore_eos")
#: A --requests line gives its prompt as exactly one of these.
PROMPT_KEYS = ("prompt_ids", "prompt_len", "prompt", "messages")
#: Sampling keys of a line; those it leaves out take the run's defaults (executor.generation).
SAMPLING_KEYS = ("temperature", "top_p", "top_k")

#: A synthetic shared-prefix workload's later requests arrive before this step: the first request's
#: prefill (step 0) has been updated by then, its prefix pages cached, also when the engine overlaps
#: steps (it updates step 0 after launching step 1).
SHARED_PREFIX_ARRIVAL_STEP = 2


class RunError(RuntimeError):
    """A ``memplan run`` usage error (conflicting or missing arguments, an impossible device)."""


class RequestFileError(ValueError):
    """A request file cannot be read or holds a malformed line."""


@dataclass
class RequestSpec:
    """One request as read from the command line, before it becomes an engine ``Request``."""

    prompt_ids: list[int]
    max_new_tokens: int
    stop_ids: list[int] = field(default_factory=list)
    temperature: float = 0.0
    top_k: int = 0
    seed: int = 0
    arrival_step: int = 0
    error: str | None = None  # rejected here (an id outside the vocabulary): never reaches the engine
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)  # stop strings (need a tokenizer)
    ignore_eos: bool = False  # the request's own ignore_eos (the run's --ignore-eos applies to all)
    given: frozenset[str] = frozenset()  # the SAMPLING_KEYS the request set itself


def read_requests(args: argparse.Namespace, vocab_size: int, tokenizer: Tokenizer | None = None,
                  sampling: Sampling | None = None) -> list[RequestSpec]:
    """The requests of ``--prompt``, ``--requests``, ``--prompt-ids`` and the synthetic workload, in that order;
    with none of them, ``--batch`` (default 1) random prompts of ``--prompt-len`` ids. Ids outside the vocabulary
    mark that request rejected; a malformed file line is a ``RequestFileError``. ``sampling``: the run's
    defaults for the sampling keys a request does not set (``apply_sampling``)."""
    import numpy as np

    specs: list[RequestSpec] = []
    for text in args.prompt or []:
        specs.append(RequestSpec(encode_prompt(tokenizer, text, "--prompt"), args.max_new_tokens, seed=args.seed))
    if args.requests:
        specs += read_request_file(Path(args.requests), args.max_new_tokens, vocab_size, args.seed, tokenizer)
    if args.prompt_ids:
        specs += [RequestSpec(ids, args.max_new_tokens, seed=args.seed)
                  for ids in read_prompt_file(Path(args.prompt_ids))]
    if args.num_requests is not None:
        specs += synthetic_requests(args, vocab_size)
    elif any(value is not None for value in (args.input_len, args.output_len)) or args.shared_prefix:
        raise RunError("--input-len, --output-len and --shared-prefix need --num-requests N")
    if args.batch is not None or not specs:
        batch = 1 if args.batch is None else args.batch
        if batch < 1 or args.prompt_len < 1:
            raise RunError(f"--batch and --prompt-len must be >= 1, got {batch} and {args.prompt_len}")
        rng = np.random.default_rng(args.seed)
        specs += [RequestSpec(rng.integers(0, vocab_size, args.prompt_len).tolist(), args.max_new_tokens,
                              seed=args.seed) for _ in range(batch)]
    mark_out_of_vocabulary(specs, vocab_size)
    if sampling is not None:
        for spec in specs:
            apply_sampling(spec, sampling)
    return specs


def mark_out_of_vocabulary(specs: list[RequestSpec], vocab_size: int) -> None:
    """Mark rejected (``error``) each request with a prompt id outside [0, vocab_size)."""
    for spec in specs:
        bad = next(((i, t) for i, t in enumerate(spec.prompt_ids) if not 0 <= t < vocab_size), None)
        if bad is not None:
            spec.error = f"prompt: id {bad[1]} at position {bad[0]} is outside the vocabulary [0, {vocab_size})"


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
        raise RunError(f"{where}: text needs a tokenizer, and the checkpoint has none (no tokenizer.json): "
                       "give --tokenizer DIR, or ids (--prompt-ids, \"prompt_ids\")")
    return tokenizer.encode(text)


def synthetic_requests(args: argparse.Namespace, vocab_size: int) -> list[RequestSpec]:
    """``--num-requests`` prompts of ``--input-len`` random ids sharing their first ``--shared-prefix`` ids.

    With a shared prefix the first request arrives at step 0 and the others at step 1: pages enter the prefix
    cache after the step that fills them, so requests admitted together could not share them."""
    import numpy as np

    count = args.num_requests
    length = args.prompt_len if args.input_len is None else args.input_len
    new_tokens = args.max_new_tokens if args.output_len is None else args.output_len
    prefix = args.shared_prefix
    if count < 1 or length < 1 or new_tokens < 1:
        raise RunError(f"--num-requests, --input-len and --output-len must be >= 1, got {count}, {length} "
                       f"and {new_tokens}")
    if not 0 <= prefix <= length:
        raise RunError(f"--shared-prefix must be in [0, --input-len {length}], got {prefix}")
    rng = np.random.default_rng(args.seed)
    shared = rng.integers(0, vocab_size, prefix).tolist()
    return [RequestSpec(shared + rng.integers(0, vocab_size, length - prefix).tolist(), new_tokens, seed=args.seed,
                        arrival_step=SHARED_PREFIX_ARRIVAL_STEP if prefix and index else 0)
            for index in range(count)]


def _read_lines(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except OSError as error:
        raise RequestFileError(f"{path}: cannot read: {error.strerror}") from None


def _json_line(path: Path, number: int, line: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as error:
        raise RequestFileError(f"{path} line {number}: not JSON: {error.msg}") from None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_int_list(value: Any) -> bool:
    return isinstance(value, list) and all(_is_int(t) for t in value)


def read_request_file(path: Path, max_new_tokens: int, vocab_size: int, seed: int,
                      tokenizer: Tokenizer | None = None) -> list[RequestSpec]:
    """One request object per non-blank line (see ``REQUEST_KEYS``); ``prompt_len`` draws random ids from the
    line's ``seed`` (else ``--seed``) and its line number; ``prompt`` and ``messages`` are tokenized."""
    import numpy as np

    specs = []
    for number, line in enumerate(_read_lines(path), start=1):
        if not line.strip():
            continue
        record = _json_line(path, number, line)

        def bad(message: str) -> RequestFileError:
            return RequestFileError(f"{path} line {number}: {message}")

        if not isinstance(record, dict):
            raise bad("expected a JSON object")
        unknown = sorted(set(record) - set(REQUEST_KEYS))
        if unknown:
            raise bad(f"unknown field {unknown[0]!r} (expected {', '.join(REQUEST_KEYS)})")
        if sum(key in record for key in PROMPT_KEYS) != 1:
            raise bad("give exactly one of \"prompt_ids\": [int, ...], \"prompt_len\": int, \"prompt\": text and "
                      "\"messages\": [{\"role\": ..., \"content\": ...}, ...]")
        if "prompt_ids" in record and not _is_int_list(record["prompt_ids"]):
            raise bad("prompt_ids: expected a list of ints")
        if "prompt_len" in record and not (_is_int(record["prompt_len"]) and record["prompt_len"] >= 0):
            raise bad("prompt_len: expected an int >= 0")
        for key in ("max_new_tokens", "seed"):
            if key in record and not _is_int(record[key]):
                raise bad(f"{key}: expected an int")
        if "stop_ids" in record and not _is_int_list(record["stop_ids"]):
            raise bad("stop_ids: expected a list of ints")
        temperature = record.get("temperature", 0.0)
        if not (isinstance(temperature, (int, float)) and not isinstance(temperature, bool)
                and math.isfinite(temperature) and temperature >= 0):
            raise bad("temperature: expected a number >= 0")
        top_k = record.get("top_k", 0)
        if not (_is_int(top_k) and top_k >= 0):
            raise bad("top_k: expected an int >= 0")
        request_seed = record.get("seed", seed)
        if "prompt_ids" in record:
            ids = list(record["prompt_ids"])
        elif "prompt_len" in record:
            ids = np.random.default_rng((abs(request_seed), number)).integers(
                0, vocab_size, record["prompt_len"]).tolist()
        else:
            ids = _text_prompt(record, tokenizer, bad)
        extras = _generation_fields(record, tokenizer, bad)
        specs.append(RequestSpec(ids, record.get("max_new_tokens", max_new_tokens), list(record.get("stop_ids", [])),
                                 float(temperature), top_k, request_seed, **extras,
                                 given=frozenset(key for key in SAMPLING_KEYS if key in record)))
    if not specs:
        raise RequestFileError(f"{path}: no requests")
    return specs


def _text_prompt(record: dict, tokenizer: Tokenizer | None, bad: Callable[[str], RequestFileError]) -> list[int]:
    """The ids of a line's ``prompt`` (text) or ``messages`` (a chat, through the chat template)."""
    from executor.tokenizer import TokenizerError

    key = "prompt" if "prompt" in record else "messages"
    if tokenizer is None:
        raise bad(f"{key}: text needs a tokenizer, and the checkpoint has none (no tokenizer.json): give "
                  "--tokenizer DIR, or \"prompt_ids\"")
    if key == "prompt":
        if not isinstance(record["prompt"], str):
            raise bad("prompt: expected a string")
        return tokenizer.encode(record["prompt"])
    messages = record["messages"]
    if not (isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in messages)):
        raise bad("messages: expected a non-empty list of {\"role\": str, \"content\": ...} objects")
    try:
        return tokenizer.encode_chat(messages)
    except TokenizerError as error:
        raise bad(f"messages: {error}") from None


def _generation_fields(record: dict, tokenizer: Tokenizer | None,
                       bad: Callable[[str], RequestFileError]) -> dict[str, Any]:
    """A line's ``top_p``, ``stop`` (a string or a list of them; needs a tokenizer) and ``ignore_eos``."""
    fields: dict[str, Any] = {}
    if "top_p" in record:
        top_p = record["top_p"]
        if not (isinstance(top_p, (int, float)) and not isinstance(top_p, bool) and 0 < top_p <= 1):
            raise bad("top_p: expected a number in (0, 1]")
        fields["top_p"] = float(top_p)
    if "stop" in record:
        stop = [record["stop"]] if isinstance(record["stop"], str) else record["stop"]
        if not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
            raise bad("stop: expected a non-empty string or a list of them")
        if stop and tokenizer is None:
            raise bad("stop: stop strings need a tokenizer, and the checkpoint has none (no tokenizer.json)")
        fields["stop"] = stop
    if "ignore_eos" in record:
        if not isinstance(record["ignore_eos"], bool):
            raise bad("ignore_eos: expected true or false")
        fields["ignore_eos"] = record["ignore_eos"]
    return fields


def read_prompt_file(path: Path) -> list[list[int]]:
    """One ``{"prompt_ids": [int, ...]}`` object per non-blank line."""
    prompts = []
    for number, line in enumerate(_read_lines(path), start=1):
        if not line.strip():
            continue
        record = _json_line(path, number, line)
        ids = record.get("prompt_ids") if isinstance(record, dict) else None
        if not _is_int_list(ids):
            raise RequestFileError(f"{path} line {number}: expected {{\"prompt_ids\": [int, ...]}}")
        prompts.append(ids)
    if not prompts:
        raise RequestFileError(f"{path}: no prompts")
    return prompts


def output_record(index: int, spec: RequestSpec, result: Any | None, text: str | None = None) -> dict:
    """One request's output line; ``result`` is the engine's RequestResult (None: rejected here); ``text``
    (its detokenized output, when the run has a tokenizer) goes beside ``output_ids``."""
    if text is not None:  # the record without text, "text" inserted after "output_ids"
        items = list(output_record(index, spec, result).items())
        at = [key for key, _ in items].index("output_ids") + 1
        return dict(items[:at] + [("text", text)] + items[at:])
    if result is None:
        return {"request": index, "prompt_len": len(spec.prompt_ids), "output_ids": [], "finish_reason": "rejected",
                "ttft_ms": None, "token_latencies_ms": [], "error": spec.error}
    record = {"request": index, "prompt_len": result.prompt_len, "output_ids": list(result.output_ids),
              "finish_reason": result.finish_reason,
              "ttft_ms": None if result.ttft_s is None else round(result.ttft_s * 1e3, 3),
              "token_latencies_ms": [round(latency * 1e3, 3) for latency in result.token_latencies_s]}
    if result.error is not None:
        record["error"] = result.error
    return record


class OutputWriter:
    """Output lines written as requests finish: to ``--out`` (opened at the start, each line flushed, so an
    interrupted run keeps what finished), else to ``stream`` (stdout); ``None`` and no ``out``: no lines."""

    def __init__(self, out: str | None, stream: TextIO | None):
        self._file = None
        if out:
            try:
                self._file = open(out, "w")
            except OSError as error:
                raise RunError(f"--out {out}: cannot write: {error.strerror}") from None
        self._stream = self._file or stream

    def write(self, record: dict) -> None:
        if self._stream is not None:
            self._stream.write(json.dumps(record) + "\n")
            self._stream.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
