"""Start-up of ``memplan run``: cold (an empty kernel cache) and warm (the cache the cold run filled).

    python3 bench/startup.py [--models qwen3-8b,qwen3.5-9b] [--no-cache-baseline] [--out FILE]
    python3 bench/startup.py --smoke      # tiny configs in the simulator: the script's own check

Each start is a fresh ``memplan run --random-weights`` process (batch 1, a 512-token prompt, 16 new
tokens by default) with ``MEMPLAN_CACHE_DIR`` set to a new directory for the cold start and kept for
the warm one; ``--no-cache-baseline`` adds a start with ``--no-kernel-cache`` (every kernel compiled
in the process at its first launch). The script reads the run's ``start-up:`` report (stderr): the
phases from process start (interpreter, plan (with the start-up manifest check and, on a cold start,
starting the compile process), imports, requests, kernel cache (the check of that compile against
the GPU), materialize, weights, kernels: the wait for the compile, warm-up, graph capture), the kernel counts (compiled in processes, in the
cache, loaded, compiled in the run's process) and the first token, and measures the process's wall
time from launch to exit. Prints a markdown table (and writes it to --out).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODELS = ("qwen3-8b", "qwen3.5-9b")
SMOKE_MODELS = ("tiny-qwen3",)
PHASES = ("interpreter", "plan", "imports", "requests", "kernel cache", "materialize", "weights", "kernels", "warm-up",
          "graph capture")


def run_once(model: str, cache_dir: Path, args: argparse.Namespace, *, no_cache: bool) -> dict[str, str]:
    """One ``memplan run`` process; its phases, kernel lines, first token and wall time."""
    command = [sys.executable, "-m", "planner.cli", "run", "--model", model, "--random-weights",
               "--batch", str(args.batch), "--prompt-len", str(args.prompt_len),
               "--max-new-tokens", str(args.max_new_tokens)]
    command += ["--hardware", "cpu-sim", "--device", "sim"] if args.smoke else ["--hardware", args.hardware]
    if no_cache:
        command.append("--no-kernel-cache")
    env = dict(os.environ, MEMPLAN_CACHE_DIR=str(cache_dir))
    env.pop("MEMPLAN_KERNEL_CACHE", None)
    if args.smoke:
        env["NUMBA_ENABLE_CUDASIM"] = "1"
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return parse_startup(proc.stderr) | {"process wall": f"{wall:.1f}"}


def parse_startup(stderr: str) -> dict[str, str]:
    """The ``start-up:`` line's phases and first token, and the phase detail lines under it."""
    line = next((text for text in stderr.splitlines() if text.startswith("start-up: ")), None)
    if line is None:
        raise SystemExit(f"no start-up line in the run's report:\n{stderr[-4000:]}")
    result = {name: seconds for name, seconds in re.findall(r"([a-z -]+?) ([0-9.]+) s(?:,|;|$)",
                                                              line.removeprefix("start-up: "))}
    first = re.search(r"first token ([0-9.]+) s after", line)
    result["first token"] = first[1] if first else "n/a"
    for name in ("kernels", "warm-up", "graph capture"):
        detail = re.search(rf"^  {name}: (.*)$", stderr, re.MULTILINE)
        if detail:
            result[f"{name} detail"] = detail[1]
    return {key.strip(): value for key, value in result.items()}


def table(rows: list[tuple[str, str, dict[str, str]]]) -> str:
    header = ["model", "start", "process wall s", "first token s", *(f"{phase} s" for phase in PHASES),
              "kernels (start-up compile)", "warm-up kernels", "capture kernels"]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(["---"] * 2 + ["---:"] * (len(header) - 5)
                                                                  + ["---"] * 3) + " |"]
    for model, start, result in rows:
        cells = [model, start, result["process wall"], result["first token"],
                 *(result.get(phase, "-") for phase in PHASES),
                 result.get("kernels detail", "-"), result.get("warm-up detail", "-"),
                 result.get("graph capture detail", "-")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=None, help="comma-separated (default: qwen3-8b,qwen3.5-9b)")
    parser.add_argument("--hardware", default="h200")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--no-cache-baseline", action="store_true",
                        help="also start once with --no-kernel-cache (every kernel compiled at first launch)")
    parser.add_argument("--smoke", action="store_true", help="tiny configs in the simulator (nothing is cached)")
    parser.add_argument("--out", help="also write the table here")
    args = parser.parse_args()
    if args.smoke:
        args.prompt_len, args.max_new_tokens = min(args.prompt_len, 4), min(args.max_new_tokens, 2)
    models = args.models.split(",") if args.models else list(SMOKE_MODELS if args.smoke else DEFAULT_MODELS)
    rows = []
    for model in models:
        with tempfile.TemporaryDirectory(prefix="memplan-startup-") as cache_dir:
            starts = [("cold (empty cache)", False), ("warm (cache filled)", False)]
            if args.no_cache_baseline:
                starts.append(("no cache (--no-kernel-cache)", True))
            for start, no_cache in starts:
                print(f"[startup] {model}: {start}", file=sys.stderr, flush=True)
                rows.append((model, start, run_once(model, Path(cache_dir), args, no_cache=no_cache)))
    text = table(rows)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
