"""Arguments of ``memplan run`` (parsed here so ``memplan --help`` needs no torch)."""

from __future__ import annotations

import argparse

DESCRIPTION = """\
Build the plan (from --model/--hardware/--serving and the serving flags, or load
it with --plan), materialize it on the device once, load the weights, greedily
generate --max-new-tokens ids per prompt, print one JSONL line per request and a
report on stderr (planned vs allocated bytes, allocations after warm-up, prefill
tokens/s, decode TPOT).

--checkpoint DIR without --model plans the model of DIR/config.json.
--serving defaults to configs/serving/default.yaml, or to the tiny
configs/serving/sim.yaml when --hardware is cpu-sim.
Exit codes: 0 ok; 2 a bad config, plan file, checkpoint or prompt, or a request
over a planned capacity; 3 the plan does not fit."""

EXAMPLE = """\
example (the Numba CUDA simulator, no GPU):
  memplan run --model tiny-qwen3 --hardware cpu-sim --device sim --random-weights \\
              --batch 2 --prompt-len 5 --max-new-tokens 3"""


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
    parser.add_argument("--prompt-ids", help="JSONL file, one {\"prompt_ids\": [...]} per line")
    parser.add_argument("--prompt-len", type=int, default=16, help="synthetic prompt length (random ids)")
    parser.add_argument("--batch", type=int, default=1, help="synthetic prompts (more than max_batch run in waves)")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="greedy tokens generated per prompt")
    parser.add_argument("--out", help="write generated ids (JSONL) here instead of stdout")
