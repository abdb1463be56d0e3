"""The requests of a ``memplan run`` and their output lines.

Requests come from ``--requests`` (JSONL objects, see ``REQUEST_KEYS``), ``--prompt-ids`` (JSONL prompt
lists), a synthetic shared-prefix workload (``--num-requests``) or ``--batch`` random prompts. Each becomes a
``RequestSpec``; one with an id outside the vocabulary is marked rejected here and never reaches the engine.
A malformed file line is a ``RequestFileError`` naming the file and line; conflicting flags a ``RunError``.
The output is one JSONL line per request, in input order.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

#: Keys a --requests line may hold.
REQUEST_KEYS = ("prompt_ids", "prompt_len", "max_new_tokens", "stop_ids", "temperature", "top_k", "seed")

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


def read_requests(args: argparse.Namespace, vocab_size: int) -> list[RequestSpec]:
    """The requests of ``--requests``, ``--prompt-ids`` and the synthetic workload, in that order; with none of
    them, ``--batch`` (default 1) random prompts of ``--prompt-len`` ids. Ids outside the vocabulary mark that
    request rejected; a malformed file line is a ``RequestFileError``."""
    import numpy as np

    specs: list[RequestSpec] = []
    if args.requests:
        specs += read_request_file(Path(args.requests), args.max_new_tokens, vocab_size, args.seed)
    if args.prompt_ids:
        specs += [RequestSpec(ids, args.max_new_tokens) for ids in read_prompt_file(Path(args.prompt_ids))]
    if args.num_requests is not None:
        specs += synthetic_requests(args, vocab_size)
    elif any(value is not None for value in (args.input_len, args.output_len)) or args.shared_prefix:
        raise RunError("--input-len, --output-len and --shared-prefix need --num-requests N")
    if args.batch is not None or not specs:
        batch = 1 if args.batch is None else args.batch
        if batch < 1 or args.prompt_len < 1:
            raise RunError(f"--batch and --prompt-len must be >= 1, got {batch} and {args.prompt_len}")
        rng = np.random.default_rng(args.seed)
        specs += [RequestSpec(rng.integers(0, vocab_size, args.prompt_len).tolist(), args.max_new_tokens)
                  for _ in range(batch)]
    for spec in specs:
        bad = next(((i, t) for i, t in enumerate(spec.prompt_ids) if not 0 <= t < vocab_size), None)
        if bad is not None:
            spec.error = f"prompt: id {bad[1]} at position {bad[0]} is outside the vocabulary [0, {vocab_size})"
    return specs


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
    return [RequestSpec(shared + rng.integers(0, vocab_size, length - prefix).tolist(), new_tokens,
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


def read_request_file(path: Path, max_new_tokens: int, vocab_size: int, seed: int) -> list[RequestSpec]:
    """One request object per non-blank line (see ``REQUEST_KEYS``); ``prompt_len`` draws random ids from the
    line's ``seed`` (else ``--seed``) and its line number."""
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
        if ("prompt_ids" in record) == ("prompt_len" in record):
            raise bad("give exactly one of \"prompt_ids\": [int, ...] and \"prompt_len\": int")
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
        else:
            ids = np.random.default_rng((abs(request_seed), number)).integers(
                0, vocab_size, record["prompt_len"]).tolist()
        specs.append(RequestSpec(ids, record.get("max_new_tokens", max_new_tokens), list(record.get("stop_ids", [])),
                                 float(temperature), top_k, request_seed))
    if not specs:
        raise RequestFileError(f"{path}: no requests")
    return specs


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


def write_outputs(specs: list[RequestSpec], results: dict, out: str | None) -> None:
    if out:
        with open(out, "w") as stream:
            write_jsonl(specs, results, stream)
    else:
        write_jsonl(specs, results, sys.stdout)
        sys.stdout.flush()


def output_record(index: int, spec: RequestSpec, result: Any | None) -> dict:
    """One request's output line; ``result`` is the engine's RequestResult (None: rejected here)."""
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


def write_jsonl(specs: list[RequestSpec], results: dict, stream: TextIO) -> None:
    for index, spec in enumerate(specs):
        stream.write(json.dumps(output_record(index, spec, results.get(index))) + "\n")
