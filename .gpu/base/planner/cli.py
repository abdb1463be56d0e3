"""``memplan``: plan, validate, run.

Exit codes: 0 the plan fits (or validates); 2 a bad config or plan file (one
line naming the file, field, value and rule; no traceback); 3 the plan does not
fit (biggest consumers and the serving knob that would fit).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from planner.checked import CheckedOverflowError
from planner.errors import ConfigError, PlanDoesNotFit

EXIT_OK, EXIT_BAD_CONFIG, EXIT_DOES_NOT_FIT = 0, 2, 3

#: flag -> ServingConfig field; flags are named like vLLM's where they mean the same.
SERVING_FLAGS = {
    "max_batch": ("--max-batch", "--max-num-seqs", int),
    "max_context": ("--max-context", "--max-model-len", int),
    "page_size": ("--page-size", "--block-size", int),
    "gpu_memory_utilization": ("--gpu-memory-utilization", None, float),
    "max_prefill_tokens": ("--max-prefill-tokens", "--max-num-batched-tokens", int),
    "tensor_parallel_size": ("--tensor-parallel-size", "-tp", int),
    "kv_cache_dtype": ("--kv-cache-dtype", None, str),
    "dtype": ("--dtype", None, str),
    "gemm_attention_min_tokens": ("--gemm-attention-min-tokens", None, int),
    "prefill_attention": ("--prefill-attention", None, str),
    "decode_gemv_max_batch": ("--decode-gemv-max-batch", None, int),
}


def add_config_arguments(parser: argparse.ArgumentParser, *, model_required: bool = True) -> None:
    """--model/--hardware/--serving and the serving override flags (shared by plan and run)."""
    parser.add_argument("--model", required=model_required,
                        help="YAML file, shipped name (qwen3-8b), HF config.json or checkpoint directory")
    parser.add_argument("--hardware", default="h200", help="YAML file or shipped name (default: h200)")
    parser.add_argument("--serving", default=None, help="YAML file or shipped name (default: configs/serving/default.yaml)")
    for field, (flag, alias, kind) in SERVING_FLAGS.items():
        names = [flag] + ([alias] if alias else [])
        parser.add_argument(*names, dest=field, type=kind, default=None, help=f"override serving.{field}")


def serving_overrides(args: argparse.Namespace) -> dict[str, object]:
    return {field: getattr(args, field) for field in SERVING_FLAGS}


def plan_from_args(args: argparse.Namespace):
    """Load the three configs named by ``args`` and build the plan."""
    from planner.loader import load_hardware, load_model, load_serving, serving_source
    from planner.plan import build_plan

    model = load_model(args.model)
    hardware = load_hardware(args.hardware)
    spec, overrides = args.serving or "default", serving_overrides(args)
    serving = load_serving(spec, overrides)
    return build_plan(model, hardware, serving, serving_source=serving_source(spec, overrides))


def _cmd_plan(args: argparse.Namespace) -> int:
    from planner.report import format_table

    plan = plan_from_args(args)
    text = format_table(plan) if args.format == "table" else plan.model_dump_json(indent=1)
    if args.out:
        Path(args.out).write_text(plan.model_dump_json(indent=1) + "\n")
    if args.format == "table" or not args.out:
        print(text)
    return EXIT_OK


def _cmd_validate(args: argparse.Namespace) -> int:
    from planner.validate import validate_paths

    problems, checked_count = validate_paths([Path(p) for p in args.paths])
    for problem in problems:
        print(problem, file=sys.stderr)
    print(f"validated {checked_count} file(s): {len(problems)} problem(s)")
    return EXIT_BAD_CONFIG if problems else EXIT_OK


def _cmd_run(args: argparse.Namespace) -> int:
    from executor.cli import run  # torch and numba load only for `memplan run`

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memplan", description="Plan and run LLM inference memory, byte for byte.")
    commands = parser.add_subparsers(dest="command", required=True)

    plan = commands.add_parser("plan", help="build a memory plan and print its budget")
    add_config_arguments(plan)
    plan.add_argument("--format", choices=("json", "table"), default="json")
    plan.add_argument("--out", help="write the plan JSON here")
    plan.set_defaults(handler=_cmd_plan)

    validate = commands.add_parser("validate", help="check configs and plans against the schemas and the planner")
    validate.add_argument("paths", nargs="+", help="config files, plan JSON files, or directories of them")
    validate.set_defaults(handler=_cmd_validate)

    run = commands.add_parser("run", help="materialize a plan on the device and run the model")
    add_config_arguments(run, model_required=False)
    from planner.run_args import add_run_arguments

    add_run_arguments(run)
    run.set_defaults(handler=_cmd_run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except ConfigError as error:
        print(f"memplan: config error: {error}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    except CheckedOverflowError as error:
        print(f"memplan: config error: {error}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    except PlanDoesNotFit as error:
        print(f"memplan: does not fit: {error}", file=sys.stderr)
        return EXIT_DOES_NOT_FIT


if __name__ == "__main__":
    sys.exit(main())
