"""``bench/serve.py --smoke``: the serving benchmark end to end in the simulator (tiny random-weight Qwen3), a
throughput and an arrival workload, its markdown table written to ``--out``, with the host profile of the last."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_serve_smoke_writes_the_figures_beside_the_ideal_time(tmp_path):
    out = tmp_path / "serve.md"
    command = [sys.executable, str(ROOT / "bench" / "serve.py"), "--smoke", "--models", "qwen3-8b",
               "--workloads", "fixed,poisson", "--num-requests", "2", "--input-len", "3", "--output-len", "2",
               "--request-rate", "50", "--profile-host", "4", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NUMBA_ENABLE_CUDASIM": "1"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    text = out.read_text()
    assert "## Serving throughput against the ideal time (bench/serve.py)" in text
    assert "Numba CUDA simulator" in text and "torch " in text and "UTC" in text
    rows = {line.split(" | ")[3]: line.strip("| ").split(" | ") for line in text.splitlines()
            if line.startswith("| memplan |")}
    fixed, poisson = rows["fixed 2 x (3 -> 2)"], rows["poisson 2 x (3 -> 2), 50.00 req/s"]
    # requests, then ... the ideal share: a percentage for the throughput workload, none under arrivals
    assert fixed[2] == "batch 4, prefill 16"  # sim.yaml's
    assert fixed[4] == "2" and fixed[-2].endswith("%") and float(fixed[-3]) > 0
    assert poisson[4] == "2" and poisson[-2] == "-"
    # the ideal table: 2 x 3 prompt tokens computed; one decode row each (the first token is the prefill's), one step
    ideal = next(line for line in text.splitlines() if line.startswith("| tiny-qwen3 | batch 4, prefill 16 | fixed"))
    cells = ideal.strip("| ").split(" | ")
    assert (cells[3], cells[6]) == ("6", "1")
    # --profile-host 4: the arrival workload's four functions with the most host time of their own
    host = text.split("poisson 2 x (3 -> 2), 50.00 req/s: the 4 host functions with the most time of their own")[1]
    table = [line for line in host.split("\n\n")[1].splitlines() if line.startswith("| `")]
    assert len(table) == 4 and all(float(line.split(" | ")[2].replace(",", "")) >= 0 for line in table)
