"""``memplan run``: build (or load) a plan, materialize it once, load weights, generate, and report.

stdout (or ``--out``): one JSONL line per request, ``{"request", "prompt_len", "output_ids"}``.
stderr: planned vs allocated bytes per pool, the device allocator's view (CUDA),
allocations after warm-up (CUDA), prefill tokens/s and decode TPOT.

Exit codes: 0 ok; 2 a bad config, plan file, checkpoint, prompt or a request
over a planned capacity (one line); 3 the plan does not fit (raised to
planner.cli.main, which maps ConfigError / PlanDoesNotFit / CheckedOverflowError).

torch and numba are imported inside ``run``, after the simulator is chosen:
NUMBA_ENABLE_CUDASIM must be set before numba.cuda is first imported.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from planner.errors import ConfigError

if TYPE_CHECKING:
    from executor.arena import Arena
    from executor.generate import GenerationResult
    from planner.plan import MemoryPlan

EXIT_OK, EXIT_ERROR = 0, 2

#: The simulator keeps the arena in host memory; refuse plans bigger than this there.
SIM_MAX_MATERIALIZED_BYTES = 1 << 30
#: The serving config used when --hardware is cpu-sim and --serving is not given.
SIM_HARDWARE, SIM_SERVING = "cpu-sim", "sim"


class RunError(RuntimeError):
    """A ``memplan run`` usage error (conflicting or missing arguments, an impossible device)."""


def run(args: argparse.Namespace) -> int:
    """Run ``memplan run``; return the exit code (ConfigError and PlanDoesNotFit propagate)."""
    _choose_simulator(args.device)
    from executor.device import DeviceError
    from executor.generate import PromptError
    from executor.step import CapacityError
    from executor.weights import WeightsError

    labels = ((CapacityError, "capacity error"), (WeightsError, "weights error"), (PromptError, "prompt error"),
              (DeviceError, "device error"), (RunError, "error"))
    try:
        return _run(args)
    except tuple(kind for kind, _ in labels) as error:
        label = next(text for kind, text in labels if isinstance(error, kind))
        print(f"memplan: {label}: {error}", file=sys.stderr)
        return EXIT_ERROR


def _choose_simulator(device: str) -> None:
    """Enable the Numba CUDA simulator for ``--device sim`` (or auto without CUDA), before numba.cuda loads."""
    if device == "sim":
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    elif device == "auto":
        import torch

        if not torch.cuda.is_available():
            os.environ["NUMBA_ENABLE_CUDASIM"] = "1"


def _run(args: argparse.Namespace) -> int:
    from executor.arena import materialize
    from executor.device import open_device
    from executor.generate import generate, validate_requests
    from executor.models import build_model

    plan = load_plan(args)
    device = open_device(args.device)
    _check_fits_device(plan, device.is_sim)
    prompts = read_prompts(args, plan.model.vocab_size)
    validate_requests(plan, prompts, args.max_new_tokens)  # before anything is allocated
    try:
        arena = materialize(plan, device)
    except ValueError as error:  # e.g. tensor_parallel_size != 1
        raise RunError(str(error)) from None
    _load_weights(arena, args)
    model = build_model(arena)
    result = generate(model, plan, prompts, args.max_new_tokens, warmup=not device.is_sim)
    _write_outputs(prompts, result, args.out)
    print(summary(plan, arena, result), file=sys.stderr)
    return EXIT_OK


# -- the plan -----------------------------------------------------------------------------------------------------


def load_plan(args: argparse.Namespace) -> MemoryPlan:
    """The plan from ``--plan FILE`` (checked against the planner), or built from the config flags."""
    from planner.cli import plan_from_args, serving_overrides

    if args.plan:
        given = [flag for flag, value in (("--model", args.model), ("--serving", args.serving)) if value]
        given += [f"--{name.replace('_', '-')}" for name, value in serving_overrides(args).items() if value is not None]
        if given:
            raise RunError(f"--plan replaces --model, --serving and the serving flags; drop {', '.join(given)}")
        return read_plan_file(Path(args.plan))
    args = argparse.Namespace(**vars(args))
    if args.model is None:
        if not args.checkpoint:
            raise RunError("give --model, --checkpoint DIR (its config.json) or --plan FILE")
        args.model = args.checkpoint
    if args.serving is None and _hardware_name(args.hardware) == SIM_HARDWARE:
        args.serving = SIM_SERVING
    return plan_from_args(args)


def read_plan_file(path: Path) -> MemoryPlan:
    """A plan JSON file, validated and equal to what this planner builds from its own configs."""
    from pydantic import ValidationError

    from planner.plan import MemoryPlan, build_plan

    try:
        plan = MemoryPlan.model_validate_json(path.read_text())
    except OSError as error:
        raise ConfigError(str(path), "", "", f"cannot read: {error.strerror}") from None
    except ValidationError as error:
        first = error.errors()[0]
        field = ".".join(str(part) for part in first["loc"])
        raise ConfigError(str(path), field, first.get("input"), first["msg"]) from None
    rebuilt = build_plan(plan.model, plan.hardware, plan.serving)
    if plan != rebuilt:
        where, value, expected = _first_difference(plan.model_dump(), rebuilt.model_dump())
        raise ConfigError(str(path), where, value,
                          f"differs from the plan this planner builds from the file's configs ({expected!r}); re-plan")
    return plan


def _first_difference(ours: Any, theirs: Any, path: str = "") -> tuple[str, Any, Any]:
    """The dotted path of the first leaf where two dumped plans differ, with both values."""
    if isinstance(ours, dict) and isinstance(theirs, dict) and ours.keys() == theirs.keys():
        for key in ours:
            if ours[key] != theirs[key]:
                return _first_difference(ours[key], theirs[key], f"{path}.{key}" if path else str(key))
    if isinstance(ours, (list, tuple)) and isinstance(theirs, (list, tuple)) and len(ours) == len(theirs):
        for index, (a, b) in enumerate(zip(ours, theirs)):
            if a != b:
                return _first_difference(a, b, f"{path}[{index}]")
    return path, ours, theirs


def _hardware_name(spec: str) -> str:
    from planner.loader import load_hardware

    return load_hardware(spec).name


def _check_fits_device(plan: MemoryPlan, simulator: bool) -> None:
    total = materialized_bytes(plan)
    if simulator and total > SIM_MAX_MATERIALIZED_BYTES:
        raise RunError(f"the simulator runs tiny configs in host memory; this plan ({plan.model.name} on "
                       f"{plan.hardware.name}) materializes {total:,} bytes: use --hardware {SIM_HARDWARE} "
                       f"and a tiny model, or --device cuda")


def materialized_bytes(plan: MemoryPlan) -> int:
    """Bytes of every pool the executor allocates (budget-only lines excluded)."""
    return sum(pool.bytes for pool in plan.pools if pool.materialized)


# -- weights and prompts ------------------------------------------------------------------------------------------


def _load_weights(arena: Arena, args: argparse.Namespace) -> None:
    from executor.weights import WeightsError, fill_random, load_checkpoint

    if args.checkpoint and args.random_weights:
        raise RunError("give --checkpoint DIR or --random-weights, not both")
    if args.checkpoint:
        load_checkpoint(arena, args.checkpoint)
    elif args.random_weights:
        fill_random(arena, args.seed)
    else:
        raise WeightsError("no weights: give --checkpoint DIR or --random-weights")


def read_prompts(args: argparse.Namespace, vocab_size: int) -> list[list[int]]:
    """Prompts from ``--prompt-ids`` (JSONL), else ``--batch`` random prompts of ``--prompt-len`` ids."""
    from executor.generate import PromptError

    if args.prompt_ids:
        return read_prompt_file(Path(args.prompt_ids))
    if args.batch < 1 or args.prompt_len < 1:
        raise PromptError(f"--batch and --prompt-len must be >= 1, got {args.batch} and {args.prompt_len}")
    import numpy as np

    rng = np.random.default_rng(args.seed)
    return [rng.integers(0, vocab_size, args.prompt_len).tolist() for _ in range(args.batch)]


def read_prompt_file(path: Path) -> list[list[int]]:
    """One ``{"prompt_ids": [int, ...]}`` object per non-blank line."""
    from executor.generate import PromptError

    try:
        lines = path.read_text().splitlines()
    except OSError as error:
        raise PromptError(f"{path}: cannot read: {error.strerror}") from None
    prompts = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise PromptError(f"{path} line {number}: not JSON: {error.msg}") from None
        ids = record.get("prompt_ids") if isinstance(record, dict) else None
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise PromptError(f"{path} line {number}: expected {{\"prompt_ids\": [int, ...]}}")
        prompts.append(ids)
    if not prompts:
        raise PromptError(f"{path}: no prompts")
    return prompts


# -- output -------------------------------------------------------------------------------------------------------


def _write_outputs(prompts: list[list[int]], result: GenerationResult, out: str | None) -> None:
    if out:
        with open(out, "w") as stream:
            write_jsonl(prompts, result, stream)
    else:
        write_jsonl(prompts, result, sys.stdout)
        sys.stdout.flush()


def write_jsonl(prompts: list[list[int]], result: GenerationResult, stream: TextIO) -> None:
    for index, (prompt, output) in enumerate(zip(prompts, result.outputs)):
        stream.write(json.dumps({"request": index, "prompt_len": len(prompt), "output_ids": output}) + "\n")


def summary(plan: MemoryPlan, arena: Arena, result: GenerationResult) -> str:
    """The stderr report: planned vs allocated bytes, the allocator's view, timings."""
    device = arena.device
    lines = [f"memplan run: {plan.model.name} on {plan.hardware.name} (device {device.kind}), "
             f"{len(result.outputs)} request(s) in {result.waves} wave(s), {plan.capacity.kv_pages} KV pages",
             f"  {'pool':<16} {'planned bytes':>16} {'allocated bytes':>16}"]
    for pool in plan.pools:
        if pool.materialized:
            lines.append(f"  {pool.name:<16} {pool.bytes:>16,} {arena.pools[pool.name].numel():>16,}")
    lines.append(f"  {'total':<16} {materialized_bytes(plan):>16,} {arena.allocated_bytes:>16,}")
    lines.append(f"device allocator: {_allocator_line(plan, arena)}")
    lines.append(f"allocations after warm-up: {_allocations_line(result, device.is_sim)}")
    lines.append(f"prefill: {result.prefill_tokens} tokens in {result.prefill_seconds:.3f} s = "
                 f"{result.prefill_tokens_per_s:,.1f} tokens/s")
    lines.append(f"decode TPOT: {result.decode_tpot_ms:.3f} ms (median of {len(result.decode_step_seconds)} steps)")
    return "\n".join(lines)


def _allocator_line(plan: MemoryPlan, arena: Arena) -> str:
    if arena.device.is_sim:
        return "n/a (simulator)"
    import torch

    allocated = torch.cuda.memory_allocated(arena.device.torch_device)
    planned = materialized_bytes(plan)
    return (f"torch.cuda.memory_allocated {allocated:,} bytes vs plan materialized {planned:,} bytes "
            f"({allocated - planned:+,})")


def _allocations_line(result: GenerationResult, simulator: bool) -> str:
    if simulator:
        return "n/a (simulator)"
    if result.allocations_after_warmup is None:
        return "n/a (no decode step: --max-new-tokens 1)"
    return f"{result.allocations_after_warmup} (allocation.all.allocated, first decode step to the end)"
