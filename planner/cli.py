"""``memplan``: the one command-line module (plan, validate, run, compile, cache); ``memplan --help``
needs no torch.

Exit codes: 0 the plan fits (or validates); 2 a bad config, plan file or flag, or a
missing executor package (one line naming the file, field, value and rule, or
what to install; no traceback); 3 the plan does not fit (one request of
max_context does not fit the KV pool: the largest max_context and the
gpu_memory_utilization that would fit, the biggest consumers, other knobs). ``memplan compile``:
1 when a kernel failed to compile.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from planner import __version__
from planner.checked import CheckedOverflowError
from planner.config import VLLM_STEP_TOKENS, parse_token_count
from planner.errors import ConfigError, PlanDoesNotFit, one_line

EXIT_OK, EXIT_BAD_CONFIG, EXIT_DOES_NOT_FIT = 0, 2, 3

#: Top-level modules of the executor's packages (pyproject's executor extra, and torch): a missing one
#: is an install step, not a bug.
EXECUTOR_MODULES = ("torch", "numpy", "numba", "numba_cuda", "llvmlite", "safetensors", "cuda")
EXECUTOR_INSTALL = ("install torch first (pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu, "
                    "or the CUDA build for a GPU), then, in the memplan checkout, pip install '.[executor]' (on a GPU "
                    "add 'numba-cuda[cu13]'); README: the executor's install")


def context_length(text: str) -> int | str:
    """--max-model-len: an integer, 32k (32,000), 32K (32,768), or auto (or -1: the largest that fits)."""
    if text in ("auto", "-1"):
        return "auto"
    try:
        return parse_token_count(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def token_count(text: str) -> int:
    """A token-count flag: an integer, 32k (32,000) or 32K (32,768)."""
    try:
        return parse_token_count(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None

#: flag -> ServingConfig field; flags are named like vLLM's where they mean the same.
SERVING_FLAGS = {
    "max_batch": ("--max-batch", "--max-num-seqs", int),
    "max_context": ("--max-context", "--max-model-len", context_length),
    "page_size": ("--page-size", "--block-size", int),
    "gpu_memory_utilization": ("--gpu-memory-utilization", None, float),
    "max_prefill_tokens": ("--max-prefill-tokens", None, token_count),
    "max_prefill_tokens_beside_decode": ("--max-prefill-tokens-beside-decode", None, token_count),
    "max_step_tokens": ("--max-step-tokens", None, token_count),
    "max_num_batched_tokens": ("--max-num-batched-tokens", None, token_count),  # vLLM's: sets the two above
    "tensor_parallel_size": ("--tensor-parallel-size", "-tp", int),
    "kv_cache_dtype": ("--kv-cache-dtype", None, str),
    "dtype": ("--dtype", None, str),
    "gemm_attention_min_tokens": ("--gemm-attention-min-tokens", None, int),
    "prefill_attention": ("--prefill-attention", None, str),
    "decode_gemv_max_batch": ("--decode-gemv-max-batch", None, int),
    "prefix_state_slots": ("--prefix-state-slots", None, int),
}


def add_config_arguments(parser: argparse.ArgumentParser, *, model_required: bool = True) -> None:
    """--model/--hardware/--serving and the serving override flags (shared by plan and run)."""
    parser.add_argument("--model", required=model_required,
                        help="YAML file, shipped name (qwen3-8b), HF config.json or checkpoint directory "
                             "(run: its safetensors are the weights)")
    parser.add_argument("--hardware", default="h200", help="YAML file or shipped name (default: h200)")
    parser.add_argument("--serving", default=None, help="YAML file or shipped name (default: the hardware's "
                        "default_serving: configs/serving/h200.yaml on h200 and h100-sxm, sim.yaml on cpu-sim, "
                        "default.yaml elsewhere)")
    for field, (flag, alias, kind) in SERVING_FLAGS.items():
        names = [flag] + ([alias] if alias else [])
        extra = (" (32k = 32,000, 32K = 32,768; auto: the largest that fits)" if field == "max_context"
                 else " (32k = 32,000, 32K = 32,768)" if kind is token_count else "")
        what = ("vLLM's tokens a step holds, decode rows included: set serving.max_prefill_tokens and "
                "serving.max_step_tokens" if field == VLLM_STEP_TOKENS else f"override serving.{field}")
        parser.add_argument(*names, dest=field, type=kind, default=None, help=f"{what}{extra}")


def serving_overrides(args: argparse.Namespace) -> dict[str, object]:
    """The serving flags as ServingConfig fields (None: the flag was not given)."""
    return {field: getattr(args, field) for field in SERVING_FLAGS}


def _cmd_plan(args: argparse.Namespace) -> int:
    from planner.loader import plan_from_configs
    from planner.output_file import check_out_path, config_inputs, write_atomically
    from planner.report import floor_hundredths, format_table

    if args.format:
        shown = args.format
    elif args.out:
        shown = None  # the JSON goes to the file
    else:
        shown = "table" if sys.stdout.isatty() else "json"
    out = check_out_path(args.out, config_inputs(args.model, args.hardware, args.serving or "default")) if args.out \
        else None
    try:
        plan = plan_from_configs(args.model, args.hardware, args.serving, serving_overrides(args))
    except PlanDoesNotFit as error:
        if shown == "json":  # the verdict for a script reading stdout; the line on stderr as always
            print(json.dumps({"fits": False, "reason": str(error), "required_bytes": error.required_bytes,
                              "usable_bytes": error.usable_bytes, "advice": error.advice}, indent=1))
        raise
    if out is not None:
        write_atomically(out, plan.model_dump_json(indent=1) + "\n")
    if shown == "table":
        print(format_table(plan))
    elif shown == "json":
        print(plan.model_dump_json(indent=1))
    else:
        capacity = plan.capacity
        print(f"memplan: wrote {args.out} ({plan.model.name} on {plan.hardware.name}: fits, max concurrency "
              f"{floor_hundredths(capacity.max_concurrency):.2f} at max_context {capacity.max_context:,})",
              file=sys.stderr)
    return EXIT_OK


def _cmd_validate(args: argparse.Namespace) -> int:
    from planner.validate import validate_paths

    problems, checked_count = validate_paths([Path(p) for p in args.paths])
    for problem in problems:
        print(one_line(problem), file=sys.stderr)
    print(f"validated {checked_count} file(s): {len(problems)} problem(s)")
    return EXIT_BAD_CONFIG if problems else EXIT_OK


def _cmd_run(args: argparse.Namespace) -> int:
    try:
        from executor.runner import run  # torch and numba load only for `memplan run`

        return run(args, serving_overrides(args))
    except ModuleNotFoundError as error:
        if (error.name or "").split(".")[0] not in EXECUTOR_MODULES:
            raise
        print(f"memplan: run needs the executor's packages; {error.name} is missing: {EXECUTOR_INSTALL}",
              file=sys.stderr)
        return EXIT_BAD_CONFIG


def _cmd_compile(args: argparse.Namespace) -> int:
    from executor.compile import CompileError, compile_command  # numba loads only for `memplan compile`

    try:
        return compile_command(args, serving_overrides(args))
    except CompileError as error:
        print(f"memplan: compile error: {error}", file=sys.stderr)
        return EXIT_BAD_CONFIG


def _cmd_cache(args: argparse.Namespace) -> int:
    from executor.compile import cache_command

    return cache_command(args)


COMPILE_DESCRIPTION = """\
Fill the persistent kernel cache with the kernels a plan's start-up needs
(warm-up and every decode-graph bucket), compiled for the hardware's compute
capability: no GPU needed (NVVM and nvJitLink run on the host), one process
per core. A later `memplan run` of the same plan on that GPU loads them instead
of compiling; a second `memplan compile` compiles nothing.

The cache is $MEMPLAN_CACHE_DIR, else ${XDG_CACHE_HOME:-~/.cache}/memplan;
MEMPLAN_KERNEL_CACHE=0 turns it off. Exit codes: 0 ok; 1 a kernel failed to
compile; 2 a bad config (or the cache is off, or the simulator is on)."""


def add_compile_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``memplan compile`` beside the shared config flags."""
    parser.description = COMPILE_DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--jobs", type=int, default=None, metavar="N",
                        help="compile processes (default: one per available core; 1 compiles in this process)")
    parser.add_argument("--kernels", default=None, metavar="TEXT",
                        help="compile only the kernels whose module.qualname contains TEXT")
    parser.add_argument("--list", action="store_true",
                        help="list the kernels start-up needs (key, first pass, compile seconds or cached, name)")


RUN_DESCRIPTION = """\
Build the plan (from --model/--hardware/--serving and the serving flags, or load
it with --plan), materialize it on the device once, load the weights, run the
requests through the engine (continuous batching, chunked prefill, on-demand KV
pages, preemption, prefix caching), print one JSONL line per request and a
report on stderr (planned vs allocated bytes, tokens/s, TTFT and TPOT p50/p99,
prefix-cache hit rate, peak KV pages and recurrent slots, preemptions,
allocations after warm-up).

Weights: --model DIR serves DIR's safetensors (one file, or shards and their
model.safetensors.index.json) when it holds them; --checkpoint DIR says the
same (and gives a --plan its weights); --random-weights fills the planned
shapes from --seed. Text: the checkpoint's tokenizer.json (or --tokenizer DIR)
and chat template; without them requests are ids only.

Requests come from --prompt TEXT (repeatable), --requests FILE, --prompt-ids
FILE and the synthetic workload (--num-requests/--input-len/--output-len/
--shared-prefix), in that order; with none of them, --batch prompts of
--prompt-len random ids. A --requests line is a JSON object with one of
"prompt_ids" [int, ...], "prompt_len" int (random ids), "prompt" text or
"messages" [{"role": ..., "content": ...}, ...] (rendered by the chat template
with the generation prompt), and optionally "max_new_tokens" (default
--max-new-tokens), "stop_ids", "stop" (strings), "temperature", "top_p",
"top_k", "seed", "ignore_eos".
A request stops at the checkpoint's EOS ids (generation_config.json, then
config.json; finish_reason "stop") unless --ignore-eos. Sampling fields a
request leaves out come from --temperature/--top-p/--top-k, then from the
checkpoint's generation_config.json (with do_sample), else greedy; the report
says which applied.
Output lines (JSONL, stdout or --out) are written as requests finish, each
naming its input index ("request"), with "text" beside "output_ids" when there
is a tokenizer. A single --prompt streams its text to stdout instead.
--prompt-ids lines are the same objects with "prompt_ids" required.
A request the plan or the kernels cannot serve (prompt + max_new_tokens over
max_context, more KV pages than the pool, an id outside the vocabulary, a seed
outside [0, 2**64), top_k over the vocabulary, a negative temperature) is
rejected in its own output line; the others still run. A line that is not a
request (not JSON, an unknown key, a wrong type) is exit 2 before any work.

--checkpoint DIR without --model plans the model of DIR/config.json.
--serving defaults to the hardware's default_serving, as for memplan plan:
configs/serving/h200.yaml (256 sequences, 8,192 batched tokens) on h200 and
h100-sxm, the tiny configs/serving/sim.yaml on cpu-sim, configs/serving/default.yaml
elsewhere.
Exit codes: 0 ok (rejected requests included); 2 a bad config, plan file,
checkpoint or request file; 3 the plan does not fit."""

RUN_EXAMPLE = """\
examples:
  memplan run --model path/to/Qwen3-8B --prompt "The capital of France is" --max-new-tokens 32
  memplan run --model path/to/Qwen3-8B --requests chat.jsonl --out answers.jsonl
  memplan run --model path/to/Qwen3.5-9B --prompt "..." --temperature 0.7 --top-p 0.8 --seed 1
the Numba CUDA simulator (no GPU):
  memplan run --model tiny-qwen3 --hardware cpu-sim --device sim --random-weights \\
              --batch 2 --prompt-len 5 --max-new-tokens 3
  memplan run --model tiny-qwen3 --hardware cpu-sim --device sim --random-weights \\
              --num-requests 3 --input-len 6 --output-len 2 --shared-prefix 4"""


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``memplan run`` beside the shared config flags."""
    parser.description = RUN_DESCRIPTION
    parser.epilog = RUN_EXAMPLE
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--plan", help="a plan JSON file (instead of --model/--hardware/--serving); "
                                       "it must equal what this planner builds from its configs")
    parser.add_argument("--checkpoint", help="HF checkpoint directory (config.json + *.safetensors); "
                                             "implies --model DIR when --model is absent (--model DIR with "
                                             "safetensors means the same)")
    parser.add_argument("--tokenizer", metavar="DIR",
                        help="directory of tokenizer.json (default: the checkpoint's, or --model DIR's)")
    parser.add_argument("--random-weights", action="store_true", help="fill the weight pool from --seed")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of --random-weights, of synthetic prompts and the sampling seed of requests "
                             "that set none, in [0, 2**64)")
    parser.add_argument("--prompt", action="append", metavar="TEXT",
                        help="a text prompt (repeatable); a single one streams its text to stdout")
    parser.add_argument("--temperature", type=float, default=None,
                        help="sampling temperature of requests that set none (0: greedy; default: the "
                             "checkpoint's generation_config.json, else greedy)")
    parser.add_argument("--top-p", type=float, default=None, help="nucleus mass in (0, 1] of requests that set none")
    parser.add_argument("--top-k", type=int, default=None, help="top-k of requests that set none (0: no limit)")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="generate past the checkpoint's EOS ids, to max_new_tokens (stop ids still stop)")
    parser.add_argument("--device", choices=("auto", "cuda", "sim"), default="auto",
                        help="cuda, or the Numba CUDA simulator (tiny configs); auto: cuda when present")
    parser.add_argument("--requests", metavar="FILE",
                        help="JSONL requests: {\"prompt_ids\": [...]}, {\"prompt_len\": N}, {\"prompt\": text} or "
                             "{\"messages\": [...]}, optional max_new_tokens, stop_ids, stop, temperature, top_p, "
                             "top_k, seed, ignore_eos")
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
                        help="run every step eagerly: no decode CUDA graphs and no prefill graph pieces")
    parser.add_argument("--no-kernel-cache", action="store_true",
                        help="neither load compiled kernels from the persistent cache nor store them (the same as "
                             "MEMPLAN_KERNEL_CACHE=0)")
    parser.add_argument("--out", help="write the per-request JSONL here instead of stdout (checked before the run; "
                                      "lines flushed to OUT.partial as requests finish, renamed to OUT at the end; "
                                      "never one of the inputs)")


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line usage error (exit 2), like every other bad input."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_BAD_CONFIG, f"{self.prog}: error: {one_line(message)}; see {self.prog} --help\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="memplan", description="Plan and run LLM inference memory, byte for byte.")
    parser.add_argument("--version", action="version", version=f"memplan {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    plan = commands.add_parser("plan", help="build a memory plan and print its budget")
    add_config_arguments(plan)
    plan.add_argument("--format", choices=("json", "table"), default=None,
                      help="stdout: the budget table or the plan JSON (default: the table on a terminal, JSON when "
                           "stdout is piped, nothing beside --out)")
    plan.add_argument("--out", help="write the plan JSON here (atomically; never one of the inputs)")
    plan.set_defaults(handler=_cmd_plan)

    validate = commands.add_parser("validate", help="check configs and plans against the schemas and the planner")
    validate.add_argument("paths", nargs="+", help="config files, plan JSON files, or directories of them")
    validate.set_defaults(handler=_cmd_validate)

    run = commands.add_parser("run", help="materialize a plan on the device and run the model")
    add_config_arguments(run, model_required=False)
    add_run_arguments(run)
    run.set_defaults(handler=_cmd_run)

    compile_ = commands.add_parser("compile", help="fill the kernel cache for a plan's GPU, no GPU needed")
    add_config_arguments(compile_)
    add_compile_arguments(compile_)
    compile_.set_defaults(handler=_cmd_compile)

    cache = commands.add_parser("cache", help="show or empty the persistent kernel cache")
    cache.add_argument("action", choices=("info", "clear"))
    cache.set_defaults(handler=_cmd_cache)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; every bad input ends here as exit 2 (or 3: does not fit) and one stderr line."""
    args = build_parser().parse_args(argv)
    try:
        code = _dispatch(args)
        sys.stdout.flush()
        return code
    except BrokenPipeError:  # the reader closed stdout (memplan plan ... | head): it has what it wanted
        _silence_stdout()
        return EXIT_OK


def _dispatch(args: argparse.Namespace) -> int:
    try:
        return args.handler(args)
    except (ConfigError, CheckedOverflowError) as error:
        print(f"memplan: config error: {one_line(str(error))}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    except PlanDoesNotFit as error:
        print(f"memplan: does not fit: {error}", file=sys.stderr)
        return EXIT_DOES_NOT_FIT


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's last flush at exit finds no closed pipe."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout without a file descriptor (a test's capture)
        pass


if __name__ == "__main__":
    sys.exit(main())
