"""``memplan run`` on the GPU (H200): a synthetic shared-prefix workload through the engine with
decode CUDA graphs; the report's allocations, graph and device-memory lines hold what they claim."""

from __future__ import annotations

import re

import pytest

from planner.cli import main

pytestmark = pytest.mark.gpu


def test_memplan_run_with_graphs_allocates_nothing_after_warm_up(capsys):
    code = main(["run", "--model", "qwen3-0.6b", "--hardware", "h200", "--random-weights",
                 "--max-batch", "16", "--max-context", "1024", "--gpu-memory-utilization", "0.3",
                 "--num-requests", "64", "--input-len", "200", "--output-len", "32", "--shared-prefix", "128"])
    out, err = capsys.readouterr()
    print(err)
    assert code == 0, err
    assert len([line for line in out.splitlines() if line.strip()]) == 64
    assert "allocations after warm-up: 0 " in err
    assert "warm-up: scratch prefill and decode steps before the clock started" in err
    graphs = re.search(r"decode graphs: buckets \[1, 2, 4, 8, 16\] captured in [0-9.]+ s; their pool reserved "
                       r"([0-9,]+) bytes vs ([0-9,]+) planned", err)
    assert graphs, err
    assert re.search(r"prefill graphs: 29 pieces a step at rows \[16, 32, .*, 2048\] captured in [0-9.]+ s", err), err
    used = re.search(r"device memory in use: ([0-9,]+) bytes .* vs plan usable ([0-9,]+) bytes", err)
    assert used and int(used[1].replace(",", "")) <= int(used[2].replace(",", "")), err
    assert float(err.split("prefix cache: hit rate ")[1].split("%")[0]) > 0
