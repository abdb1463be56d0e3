"""Arguments of ``memplan run`` (parsed here so ``memplan --help`` needs no torch)."""

from __future__ import annotations

import argparse

DESCRIPTION = """\
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
A request the plan can never hold (prompt + max_new_tokens over max_context,
more KV pages than the pool) or with an id outside the vocabulary is rejected
in its own output line; the others still run.

--checkpoint DIR without --model plans the model of DIR/config.json.
--serving defaults to configs/serving/default.yaml, or to the tiny
configs/serving/sim.yaml when --hardware is cpu-sim.
Exit codes: 0 ok (rejected requests included); 2 a bad config, plan file,
checkpoint or request file; 3 the plan does not fit."""

EXAMPLE = """\
example (the Numba CUDA simulator, no GPU):
  memplan run --model tiny-qwen3 --hardware cpu-sim --device sim --random-weights \\
              --batch 2 --prompt-len 5 --max-new-tokens 3
  memplan run --model tiny-qwen3 --hardware cpu-sim --device sim --random-weights \\
              --num-requests 3 --input-len 6 --output-len 2 --shared-prefix 4"""


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTION
    parser.epilog = EXAMPLE
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
    parser.add_argument("--seed", type=int, default=0, help="seed of --random-weights and synthetic prompts")
    parser.add_argument("--device", choices=("auto", "cuda", "sim"), default="auto",
                        help="cuda, or the Numba CUDA simulator (tiny configs); auto: cuda when present")
    parser.add_argument("--requests", metavar="FILE",
                        help="JSONL requests: {\"prompt_ids\": [...]} or {\"prompt_len\": N}, optional "
                             "max_new_tokens, stop_ids, temperature, top_k, seed")
    parser.add_argument("--prompt-ids", metavar="FILE", help="JSONL file, one {\"prompt_ids\": [...]} per line")
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
    parser.add_argument("--out", help="write the per-request JSONL here instead of stdout")
