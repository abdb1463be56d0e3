"""Arguments of ``memplan run`` (parsed here so ``memplan --help`` needs no torch)."""

from __future__ import annotations

import argparse


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--plan", help="a plan JSON file (instead of --model/--hardware/--serving)")
    parser.add_argument("--checkpoint", help="HF checkpoint directory (config.json + *.safetensors)")
    parser.add_argument("--random-weights", action="store_true", help="fill the weight pool from --seed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=("auto", "cuda", "sim"), default="auto",
                        help="cuda, or the Numba CUDA simulator (tiny configs); auto: cuda when present")
    parser.add_argument("--prompt-ids", help="JSONL file, one {\"prompt_ids\": [...]} per line")
    parser.add_argument("--prompt-len", type=int, default=16, help="synthetic prompt length (random ids)")
    parser.add_argument("--batch", type=int, default=1, help="synthetic prompts")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--out", help="write generated ids (JSONL) here instead of stdout")
