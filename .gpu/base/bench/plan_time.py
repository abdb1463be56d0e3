"""Planning time of every shipped model x hardware pair (median of repeats, milliseconds).

    python3 bench/plan_time.py [--repeats 20]

Prints a markdown table; `memplan plan` must take under 100 ms for any shipped config.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo, without an install
from planner.errors import PlanDoesNotFit  # noqa: E402
from planner.loader import load_hardware, load_model, load_serving  # noqa: E402
from planner.plan import build_plan  # noqa: E402

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def time_plan(model_name: str, hardware_name: str, repeats: int) -> tuple[float, str]:
    """Median wall time of load + build_plan in ms, and whether the plan fits."""
    samples, outcome = [], "fits"
    for _ in range(repeats):
        start = time.perf_counter()
        model = load_model(model_name)
        hardware = load_hardware(hardware_name)
        serving = load_serving("sim" if hardware_name == "cpu-sim" else "default",
                               {"max_context": min(8192, model.max_position_embeddings)})
        try:
            build_plan(model, hardware, serving)
        except PlanDoesNotFit:
            outcome = "does not fit"
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples), outcome


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    models = sorted(p.stem for p in (CONFIGS / "models").glob("*.yaml"))
    hardware = sorted(p.stem for p in (CONFIGS / "hardware").glob("*.yaml"))
    print("| model | hardware | median ms | outcome |\n| --- | --- | ---: | --- |")
    worst = 0.0
    for model in models:
        for device in hardware:
            ms, outcome = time_plan(model, device, args.repeats)
            worst = max(worst, ms)
            print(f"| {model} | {device} | {ms:.1f} | {outcome} |")
    print(f"\nslowest pair: {worst:.1f} ms (includes reading the three YAML files)")


if __name__ == "__main__":
    main()
