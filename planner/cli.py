"""``memplan``: the one command-line module (plan, validate, run); ``memplan --help`` needs no torch.

Exit codes: 0 the plan fits (or validates); 2 a bad config, plan file or flag (one
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
from planner.errors import ConfigError, PlanDoesNotFit, one_line

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
    """The serving flags as ServingConfig fields (None: the flag was not given)."""
    return {field: getattr(args, field) for field in SERVING_FLAGS}


def _cmd_plan(args: argparse.Namespace) -> int:
    from planner.loader import plan_from_configs
    from planner.output_file import check_out_path, config_inputs, write_atomically
    from planner.report import format_table

    serving = args.serving or "default"
    out = check_out_path(args.out, config_inputs(args.model, args.hardware, serving)) if args.out else None
    plan = plan_from_configs(args.model, args.hardware, serving, serving_overrides(args))
    text = format_table(plan) if args.format == "table" else plan.model_dump_json(indent=1)
    if out is not None:
        write_atomically(out, plan.model_dump_json(indent=1) + "\n")
    if args.format == "table" or not args.out:
        print(text)
    return EXIT_OK


def _cmd_validate(args: argparse.Namespace) -> int:
    from planner.validate import validate_paths

    problems, checked_count = validate_paths([Path(p) for p in args.paths])
    for problem in problems:
        print(one_line(problem), file=sys.stderr)
    print(f"validated {checked_count} file(s): {len(problems)} problem(s)")
    return EXIT_BAD_CONFIG if problems else EXIT_OK


def _cmd_run(args: argparse.Namespace) -> int:
    from executor.runner import run  # torch and numba load only for `memplan run`

    return run(args, serving_overrides(args))


RUN_DESCRIPTION = """\
Build the plan (from --model/--hardware/--serving and the serving flags, or load
it with --plan), materialize it on the device once, load the weights, run the
requests through the engine (continuous batching, chunked prefill, on-demand KV
pages, preemption, prefix caching), print one JSONL line per request and a
report on stderr (planned vs allocated bytes, tokens/s, TTFT and TPOT p50/p99,
prefix-cache hit rate, peak KV pages and recurrent slots, preemptions,
allocations after warm-up).

Requests come from --requests FILE, --prompt-ids FILE and the synthetic
workload (--num-requests/--input-len/--output-len/--shared-prefix), in that
order; with none of them, --batch prompts of --prompt-len random ids.
A --requests line is a JSON object: "prompt_ids" [int, ...] or "prompt_len"
int (random ids), and optionally "max_new_tokens" (default --max-new-tokens),
"stop_ids", "temperature", "top_k", "seed".
--prompt-ids lines are the same objects with "prompt_ids" required.
A request the plan or the kernels cannot serve (prompt + max_new_tokens over
max_context, more KV pages than the pool, an id outside the vocabulary, a seed
outside [0, 2**64), top_k over the vocabulary, a negative temperature) is
rejected in its own output line; the others still run. A line that is not a
request (not JSON, an unknown key, a wrong type) is exit 2 before any work.

--checkpoint DIR without --model plans the model of DIR/config.json.
--serving defaults to configs/serving/default.yaml, or to the tiny
configs/serving/sim.yaml when --hardware is cpu-sim.
Exit codes: 0 ok (rejected requests included); 2 a bad config, plan file,
checkpoint or request file; 3 the plan does not fit."""

RUN_EXAMPLE = """\
example (the Numba CUDA simulator, no GPU):
  memplan run --model tiny-qwen3 --hardware cpu-sim --device sim --random-weights \\
              --batch 2 --prompt-len 5 --max-new-tokens 3
  memplan run --model tiny-qwen3 --hardware cpu-sim --device sim --random-weights \\
              --num-requests 3 --input-len 6 --output-len 2 --shared-prefix 4"""


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``memplan run`` beside the shared config flags."""
    parser.description = RUN_DESCRIPTION
    parser.epilog = RUN_EXAMPLE
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    for action in parser._actions:  # the shared --serving help names plan's default only
        if action.dest == "serving":
            action.help = ("YAML file or shipped name (default: configs/serving/default.yaml; "
                           "sim.yaml when --hardware is cpu-sim)")
    parser.add_argument("--plan", help="a plan JSON file (instead of --model/--hardware/--serving); "
                                       "it must equal what this planner builds from its configs")
    parser.add_argument("--checkpoint", help="HF checkpoint directory (config.json + *.safetensors); "
                                             "implies --model DIR when --model is absent")
    parser.add_argument("--random-weights", action="store_true", help="fill the weight pool from --seed")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of --random-weights and synthetic prompts, in [0, 2**64)")
    parser.add_argument("--device", choices=("auto", "cuda", "sim"), default="auto",
                        help="cuda, or the Numba CUDA simulator (tiny configs); auto: cuda when present")
    parser.add_argument("--requests", metavar="FILE",
                        help="JSONL requests: {\"prompt_ids\": [...]} or {\"prompt_len\": N}, optional "
                             "max_new_tokens, stop_ids, temperature, top_k, seed")
    parser.add_argument("--prompt-ids", metavar="FILE",
                        help="JSONL file, one {\"prompt_ids\": [...]} per line (optionally the --requests keys)")
    parser.add_argument("--num-requests", type=int, metavar="N",
                        help="synthetic workload: N requests of --input-len random ids")
    parser.add_argument("--input-len", type=int, metavar="L", help="synthetic prompt length (default --prompt-len)")
    parser.add_argument("--output-len", type=int, metavar="O",
                        help="synthetic new tokens per request (default --max-new-tokens)")
    parser.add_argument("--shared-prefix", type=int, default=0, metavar="P",
                        help="synthetic: the first P ids are the same for every request (the others arrive "
                             "two steps after the first, so they can reuse its cached prefix)")
    parser.add_argument("--prompt-len", type=int, default=16, help="synthetic prompt length (random ids)")
    parser.add_argument("--batch", type=int, default=None,
                        help="synthetic prompts of --prompt-len ids (default 1 when no other request source)")
    parser.add_argument("--max-new-tokens", type=int, default=16,
                        help="tokens generated per request (unless a request sets max_new_tokens)")
    parser.add_argument("--no-prefix-caching", action="store_true", help="turn the engine's prefix cache off")
    parser.add_argument("--no-overlap", action="store_true",
                        help="wait for each step's sampled ids before scheduling the next (default: schedule and "
                             "launch the next step first, one step in flight)")
    parser.add_argument("--eager", action="store_true",
                        help="run decode steps eagerly instead of replaying the captured CUDA graphs")
    parser.add_argument("--out", help="write the per-request JSONL here instead of stdout (checked before the run, "
                                      "written atomically at its end; never one of the inputs)")


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line usage error (exit 2), like every other bad input."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_BAD_CONFIG, f"{self.prog}: error: {one_line(message)}; see {self.prog} --help\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="memplan", description="Plan and run LLM inference memory, byte for byte.")
    commands = parser.add_subparsers(dest="command", required=True)

    plan = commands.add_parser("plan", help="build a memory plan and print its budget")
    add_config_arguments(plan)
    plan.add_argument("--format", choices=("json", "table"), default="json")
    plan.add_argument("--out", help="write the plan JSON here (atomically; never one of the inputs)")
    plan.set_defaults(handler=_cmd_plan)

    validate = commands.add_parser("validate", help="check configs and plans against the schemas and the planner")
    validate.add_argument("paths", nargs="+", help="config files, plan JSON files, or directories of them")
    validate.set_defaults(handler=_cmd_validate)

    run = commands.add_parser("run", help="materialize a plan on the device and run the model")
    add_config_arguments(run, model_required=False)
    add_run_arguments(run)
    run.set_defaults(handler=_cmd_run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; every bad input ends here as exit 2 (or 3: does not fit) and one stderr line."""
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except (ConfigError, CheckedOverflowError) as error:
        print(f"memplan: config error: {one_line(str(error))}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    except PlanDoesNotFit as error:
        print(f"memplan: does not fit: {error}", file=sys.stderr)
        return EXIT_DOES_NOT_FIT


if __name__ == "__main__":
    sys.exit(main())
