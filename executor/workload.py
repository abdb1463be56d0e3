"""The requests of a ``memplan run`` and their output lines.

Requests come from ``--requests`` (JSONL objects, see ``REQUEST_KEYS``), ``--prompt-ids`` (the same objects,
``prompt_ids`` required), a synthetic shared-prefix workload (``--num-requests``) or ``--batch`` random
prompts. Each becomes a ``RequestSpec``, checked against ``RequestLimits`` (the plan's vocabulary and
context, the kernels' integer widths) before anything is allocated:

- a file line that is not a request (not JSON, not an object, an unknown key, a value of the wrong type)
  makes the file bad: a ``RequestFileError`` naming the file, line and field (exit 2, before any work);
- a request whose values the plan or the kernels cannot serve (an id outside the vocabulary, a length over
  max_context, a seed outside u64, top_k over the vocabulary, a temperature below 0 or beyond float32) is
  rejected in its own output line and never reaches the engine; the others run;
- a synthetic-workload flag out of its range is a ``RunError`` naming the flag (exit 2, before any work).

The output is one JSONL line per request, in input order.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from planner.errors import ConfigError
from planner.inputs import MAX_REQUEST_FILE_BYTES, parse_json, read_text

#: Keys a --requests (or --prompt-ids) line may hold.
REQUEST_KEYS = ("prompt_ids", "prompt_len", "max_new_tokens", "stop_ids", "temperature", "top_k", "seed")
#: Seeds are the sampler's 64-bit RNG key (and numpy's / torch's seed): an unsigned 64-bit integer.
SEED_LIMIT = 1 << 64
#: The sampler keeps temperatures as float32.
FLOAT32_MAX = 3.4028234663852886e38
#: Most requests one run takes (file lines and synthetic requests together).
MAX_REQUESTS = 1 << 20

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


def engine_seed(seed: int) -> int:
    """A u64 seed as the int64 with the same 64 bits: the sampler's RNG key (kernels/sampler.py)."""
    return seed - SEED_LIMIT if seed >= SEED_LIMIT >> 1 else seed


def read_requests(args: argparse.Namespace, limits: RequestLimits) -> list[RequestSpec]:
    """The requests of ``--requests``, ``--prompt-ids`` and the synthetic workload, in that order; with none of
    them, ``--batch`` (default 1) random prompts of ``--prompt-len`` ids. See the module docstring for what
    is refused (RequestFileError, RunError) and what is rejected in its own line (``RequestSpec.error``)."""
    import numpy as np

    _check_flag("--seed", args.seed, 0, SEED_LIMIT - 1)
    _check_flag("--max-new-tokens", args.max_new_tokens, 1, None)
    specs: list[RequestSpec] = []
    if args.requests:
        specs += read_request_file(Path(args.requests), args.max_new_tokens, limits, args.seed)
    if args.prompt_ids:
        specs += read_request_file(Path(args.prompt_ids), args.max_new_tokens, limits, args.seed,
                                   prompt_ids_only=True)
    if args.num_requests is not None:
        specs += synthetic_requests(args, limits)
    elif any(value is not None for value in (args.input_len, args.output_len)) or args.shared_prefix:
        raise RunError("--input-len, --output-len and --shared-prefix need --num-requests N")
    if args.batch is not None or not specs:
        batch = 1 if args.batch is None else args.batch
        _check_flag("--batch", batch, 1, MAX_REQUESTS)
        _check_flag("--prompt-len", args.prompt_len, 1, limits.max_context, "the plan's max_context")
        _check_flag("--max-new-tokens", args.max_new_tokens, 1, limits.max_context, "the plan's max_context")
        rng = np.random.default_rng(args.seed)
        specs += [RequestSpec(rng.integers(0, limits.vocab_size, args.prompt_len).tolist(), args.max_new_tokens)
                  for _ in range(batch)]
    if len(specs) > MAX_REQUESTS:
        raise RunError(f"{len(specs):,} requests: at most {MAX_REQUESTS:,} in one run")
    for spec in specs:
        if spec.error is None:
            spec.error = _rejection(spec, limits)
    return specs


def _check_flag(flag: str, value: int, low: int, high: int | None, what: str = "") -> None:
    if value < low or (high is not None and value > high):
        bound = f"in [{low}, {high:,}]" + (f" ({what})" if what else "") if high is not None else f">= {low}"
        raise RunError(f"{flag} {value}: must be {bound}")


def _rejection(spec: RequestSpec, limits: RequestLimits) -> str | None:
    """Why the plan or the kernels cannot serve ``spec`` (None: they can). The scheduler adds the rules that
    involve the plan's pools (prompt + max_new_tokens over max_context, KV pages)."""
    vocab, context = limits.vocab_size, limits.max_context
    if not spec.prompt_ids:
        return "prompt_ids: empty"
    if len(spec.prompt_ids) > context:
        return f"prompt_ids: {len(spec.prompt_ids)} ids, over the plan's max_context {context}"
    bad = next(((i, t) for i, t in enumerate(spec.prompt_ids) if not 0 <= t < vocab), None)
    if bad is not None:
        return f"prompt_ids: id {bad[1]} at position {bad[0]} is outside the vocabulary [0, {vocab})"
    if not 1 <= spec.max_new_tokens <= context:
        return f"max_new_tokens = {spec.max_new_tokens}: must be in [1, {context}] (the plan's max_context)"
    bad_stop = next((t for t in spec.stop_ids if not 0 <= t < vocab), None)
    if bad_stop is not None:
        return f"stop_ids: id {bad_stop} is outside the vocabulary [0, {vocab})"
    if not 0 <= spec.temperature <= FLOAT32_MAX:
        return f"temperature = {spec.temperature!r}: must be in [0, {FLOAT32_MAX:.4g}] (float32)"
    if not 0 <= spec.top_k <= vocab:
        return f"top_k = {spec.top_k}: must be in [0, {vocab}] (0: no restriction; at most the vocabulary)"
    if not 0 <= spec.seed < SEED_LIMIT:
        return f"seed = {spec.seed}: must be in [0, 2**64) (an unsigned 64-bit RNG key)"
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
    _check_flag("--input-len" if args.input_len is not None else "--prompt-len", length, 1, limits.max_context,
                "the plan's max_context")
    _check_flag("--output-len" if args.output_len is not None else "--max-new-tokens", new_tokens, 1,
                limits.max_context, "the plan's max_context")
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


#: What each key's value must be (its type: the bounds are the rejection rules).
_KEY_TYPES = {"prompt_ids": (_is_int_list, "a list of ints"), "prompt_len": (_is_int, "an int"),
              "max_new_tokens": (_is_int, "an int"), "stop_ids": (_is_int_list, "a list of ints"),
              "temperature": (_is_number, "a number"), "top_k": (_is_int, "an int"), "seed": (_is_int, "an int")}


def read_request_file(path: Path, max_new_tokens: int, limits: RequestLimits, seed: int,
                      prompt_ids_only: bool = False) -> list[RequestSpec]:
    """One request object per non-blank line (see ``REQUEST_KEYS``); ``prompt_len`` draws random ids from the
    line's ``seed`` (else ``--seed``) and its line number. ``prompt_ids_only`` (``--prompt-ids``): every line
    gives ``prompt_ids``."""
    import numpy as np

    specs = []
    for number, line in enumerate(_read_lines(path), start=1):
        if not line.strip():
            continue
        where = f"{path} line {number}"
        try:
            record = parse_json(line, where)
        except ConfigError as error:
            raise RequestFileError(str(error)) from None

        def bad(message: str) -> RequestFileError:
            return RequestFileError(f"{where}: {message}")

        if not isinstance(record, dict):
            raise bad("expected a JSON object")
        unknown = sorted(set(record) - set(REQUEST_KEYS))
        if unknown:
            raise bad(f"unknown field {unknown[0]!r} (expected {', '.join(REQUEST_KEYS)})")
        if prompt_ids_only and "prompt_ids" not in record:
            raise bad("expected {\"prompt_ids\": [int, ...]} (and optionally " + ", ".join(REQUEST_KEYS[2:]) + ")")
        if ("prompt_ids" in record) == ("prompt_len" in record):
            raise bad("give exactly one of \"prompt_ids\": [int, ...] and \"prompt_len\": int")
        for key, value in record.items():
            is_type, kind = _KEY_TYPES[key]
            if not is_type(value):
                raise bad(f"{key}: expected {kind}, got {json.dumps(value)[:40]}")
        request_seed = record.get("seed", seed)
        spec = RequestSpec([], record.get("max_new_tokens", max_new_tokens), list(record.get("stop_ids", [])),
                           float(record.get("temperature", 0.0)), record.get("top_k", 0), request_seed)
        if "prompt_ids" in record:
            spec.prompt_ids = list(record["prompt_ids"])
        elif not 1 <= record["prompt_len"] <= limits.max_context:
            spec.error = (f"prompt_len = {record['prompt_len']}: must be in [1, {limits.max_context}] (the plan's "
                          "max_context)")
        elif not 0 <= request_seed < SEED_LIMIT:
            spec.error = f"seed = {request_seed}: must be in [0, 2**64) (an unsigned 64-bit RNG key)"
        else:
            spec.prompt_ids = np.random.default_rng((request_seed, number)).integers(
                0, limits.vocab_size, record["prompt_len"]).tolist()
        if spec.error is None:
            spec.error = _rejection(spec, limits)
        specs.append(spec)
        if len(specs) > MAX_REQUESTS:
            raise bad(f"more than {MAX_REQUESTS:,} requests in one run")
    if not specs:
        raise RequestFileError(f"{path}: no requests (the file has no non-blank line)")
    return specs


def write_outputs(specs: list[RequestSpec], results: dict, out: Path | None) -> None:
    """The output lines to stdout, or atomically to ``out`` (checked by planner.output_file before the run)."""
    if out is not None:
        from io import StringIO

        from planner.output_file import write_atomically

        text = StringIO()
        write_jsonl(specs, results, text)
        write_atomically(out, text.getvalue())
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
