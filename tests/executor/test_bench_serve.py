"""``bench/serve.py --smoke``: the serving benchmark end to end in the simulator (tiny random-weight Qwen3), a
throughput and an arrival workload, its markdown table written to ``--out``, with its steps against their ideal,
the host profile of the last workload and the host stack runs of the first; and the stack sampler alone."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

from bench.stack_sampler import StackSampler
from tests.subprocess_env import python_path

ROOT = Path(__file__).resolve().parents[2]


def test_serve_smoke_writes_the_figures_beside_the_ideal_time(tmp_path):
    out = tmp_path / "serve.md"
    command = [sys.executable, str(ROOT / "bench" / "serve.py"), "--smoke", "--models", "qwen3-8b",
               "--workloads", "fixed,poisson", "--num-requests", "2", "--input-len", "3", "--output-len", "2",
               "--request-rate", "50", "--profile-host", "4", "--sample-stacks", "1", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": python_path(), "NUMBA_ENABLE_CUDASIM": "1"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    text = out.read_text()
    assert "## Serving throughput against the ideal time (bench/serve.py)" in text
    assert "Numba CUDA simulator" in text and "torch " in text and "UTC" in text
    header = next(line for line in text.splitlines() if line.startswith("| engine |")).strip("| ").split(" | ")
    rows = {line.split(" | ")[3]: dict(zip(header, line.strip("| ").split(" | "))) for line in text.splitlines()
            if line.startswith("| memplan |")}
    fixed, poisson = rows["fixed 2 x (3 -> 2)"], rows["poisson 2 x (3 -> 2), 50.00 req/s"]
    # the ideal's shares, at the burst and at the sustained matmul rate: percentages for the throughput
    # workload, none under arrivals
    assert fixed["serving"] == "batch 4, prefill 16"  # sim.yaml's
    sustained = "at the sustained matmul rate"
    assert fixed["requests"] == "2" and float(fixed["ideal s"]) > 0
    assert fixed["ideal / wall"].endswith("%") and fixed[sustained].endswith("%")
    assert poisson["requests"] == "2" and poisson["ideal / wall"] == poisson[sustained] == "-"
    held = re.search(r"float32 matmul 64\^3 [0-9.,]+ TFLOP/s \(([0-9.,]+) held over 0.05 s\)", text)
    assert held, text[:2000]
    # the ideal table: 2 x 3 prompt tokens computed; one decode row each (the first token is the prefill's), one step
    ideal = next(line for line in text.splitlines() if line.startswith("| tiny-qwen3 | batch 4, prefill 16 | fixed"))
    cells = ideal.strip("| ").split(" | ")
    assert (cells[3], cells[6]) == ("6", "1")
    # --profile-host 4: the arrival workload's four functions with the most host time of their own
    host = text.split("poisson 2 x (3 -> 2), 50.00 req/s: the 4 host functions with the most time of their own")[1]
    table = [line for line in host.split("\n\n")[1].splitlines() if line.startswith("| `")]
    assert len(table) == 4 and all(float(line.split(" | ")[2].replace(",", "")) >= 0 for line in table)
    # every step of each run in one of its step groups, the groups summed in its "all steps" row
    for label in ("fixed 2 x (3 -> 2)", "poisson 2 x (3 -> 2), 50.00 req/s"):
        prefix = f"- tiny-qwen3 (batch 4, prefill 16), {label}: "
        counters = next(line for line in text.splitlines() if line.startswith(prefix))
        steps = int(counters.removeprefix(prefix).split(" steps")[0])
        step_table = text.split("memplan's steps against their own ideal")[1]
        groups = [line.strip("| ").split(" | ") for line in step_table.splitlines()
                  if line.startswith(f"| tiny-qwen3 | batch 4, prefill 16 | {label} | ")]
        *parts, total = groups
        assert total[3] == "all steps" and int(total[4]) == steps == sum(int(g[4]) for g in parts)
        assert all(float(g[7]) > 0 for g in groups)  # every group did work the ideal prices
    # --sample-stacks 1: the first workload's runs of one host stack, each with its frames
    stalls = text.split("fixed 2 x (3 -> 2): where the host stalled (--sample-stacks 1)")[1]
    assert "samples every 2 ms" in stalls and "run_memplan" in stalls


def _stall_in_a_known_place() -> None:
    time.sleep(0.15)


def test_the_stack_sampler_finds_where_the_thread_stalled():
    with StackSampler() as sampler:
        for _ in range(20):
            sum(range(1000))
        _stall_in_a_known_place()
    (longest, *_) = sampler.runs()
    assert longest.seconds >= 0.1
    assert any("_stall_in_a_known_place" in frame for frame in longest.stack[:3])
    assert "_stall_in_a_known_place" in sampler.report(min_ms=100)
    assert sampler.report(min_ms=10_000).startswith("no run of one stack lasted")
