"""``bench/serve.py`` on the GPU (H200 or H100), Qwen3-8B and Qwen3.5-9B with random weights: every workload kind
runs to completion through the served engine, allocates nothing and readies no kernel after warm-up, and takes no
less than the prefill part of its ideal time (its prefill FLOPs at the measured matmul rate, which no schedule
beats: an engine under it means the count of the work or the measured rate is wrong). Speed itself is
bench/serve.py's table, not a test."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.subprocess_env import python_path

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
#: Slack on "wall >= prefill FLOPs / matmul rate" for the spread of the measured rate between machine starts.
RATE_SPREAD = 1.05
WORKLOAD = ["--workloads", "fixed,random,shared-prefix,poisson", "--num-requests", "128", "--input-len", "512",
            "--output-len", "32", "--input-range", "64,1024", "--output-range", "16,64", "--shared-prefix", "256",
            "--max-batch", "64", "--max-prefill-tokens", "4096"]


@pytest.mark.parametrize("model", ["qwen3-8b", "qwen3.5-9b"])
def test_serve_runs_every_workload_within_the_physical_limit(model, tmp_path):
    out = tmp_path / "serve.md"
    command = [sys.executable, str(ROOT / "bench" / "serve.py"), "--models", model, *WORKLOAD, "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": python_path()}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    print(done.stdout)
    assert done.returncode == 0, done.stderr[-4000:]
    text = out.read_text()
    header = next(line for line in text.splitlines() if line.startswith("| engine |")).strip("| ").split(" | ")
    rows = [dict(zip(header, line.strip("| ").split(" | "))) for line in text.splitlines()
            if line.startswith("| memplan |")]
    assert [row["workload"].split()[0] for row in rows] == ["fixed", "random", "shared-prefix", "poisson"]
    # the ideal table (between its caption and the step groups' caption), by workload
    ideal_section = text.split("Ideal time of each workload")[1].split("memplan's steps against their own ideal")[0]
    ideal_lines = [line.strip("| ").split(" | ") for line in ideal_section.splitlines() if line.startswith("| ")]
    ideal_header, ideal_rows = ideal_lines[0], [dict(zip(ideal_lines[0], cells)) for cells in ideal_lines[2:]]
    assert "prefill s" in ideal_header, ideal_header
    prefill_s = {cells["workload"]: float(cells["prefill s"].replace(",", "")) for cells in ideal_rows}
    for row in rows:
        assert row["requests"] == "128", row  # every request ran (bench/serve.py also checks every token)
        wall_s = float(row["wall s"].replace(",", ""))
        assert wall_s * RATE_SPREAD >= prefill_s[row["workload"]] > 0, row
        if row["ideal / wall"] != "-":  # the throughput workloads: a share of the ideal
            assert float(row["ideal / wall"].rstrip("%")) > 0, row
    count = r"(\d+(?:,\d{3})*)"  # a count as the counters print it: 1,234 (a comma after it ends the field)
    allocations = re.findall(rf"allocations after warm-up {count}", text)
    assert allocations == ["0"] * 4, allocations
    readied = re.findall(rf"kernels readied after warm-up {count}", text)
    assert readied == ["0"] * 4, readied  # start-up readied every kernel the workloads launch
    hits = [float(rate) for rate in re.findall(r"prefix hits (\d+\.\d)%", text)]
    assert len(hits) == 4 and hits[2] > 0, hits  # the shared prefix is reused (Qwen3.5: from state snapshots)
