"""Latencies a small decode kernel is made of, per launch inside a CUDA graph.

    python3 bench/latency.py [--launches 36] [--rounds 30] [--out FILE]

GPU only. A batch-1 decode step runs kernels of a few warps each, a warp to an SM scheduler, so
each takes about as long as its chain of dependent instructions and loads. Each row here is a graph
of ``--launches`` launches of one kernel (one block) and gives the median replay time over the
launches: an empty kernel, then chains of n dependent loads (a random cycle over 4 MiB of int32,
in L2 after the first replays, and a 4-entry cycle, in L1), n float64 powers as rope_inv_freq
takes them, and n float32 sincos pairs. The difference between n and 0 over n is one link's cost.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python3 bench/x.py` puts bench/ first on the path, not the repo
    sys.path.insert(0, str(ROOT))

from bench.common import (  # noqa: E402
    emit, fmt, interleaved_replay_us, launch_graph, markdown_table, open_bench_device, run_info,
)

CHAIN_ENTRIES = 1 << 20  # 4 MiB of int32: more than L1, well within L2
LINKS = (0, 1, 4, 16)
MATH_LINKS = (0, 1, 4)


def build_kernels() -> tuple[Any, Any, Any]:
    from numba import float32, int32

    from executor.kernels.rope.layout import rope_inv_freq
    from executor.numba_cuda import load_cuda

    cuda = load_cuda()

    @cuda.jit
    def chase(next_index, links, out):
        i = int32(0)
        for _ in range(links):
            i = next_index[i]
        if cuda.threadIdx.x == 0:
            out[0] = i

    @cuda.jit
    def powers(out, links):
        acc = float32(0.0)
        for r in range(links):
            acc += rope_inv_freq(cuda.threadIdx.x + r, 128, float32(1e6))
        out[cuda.threadIdx.x] = acc

    @cuda.jit
    def sincos(out, positions, links):
        acc = float32(0.0)
        for r in range(links):
            angle = float32(positions[0] + r) * float32(0.01 * cuda.threadIdx.x)
            acc += float32(math.cos(angle)) + float32(math.sin(angle))
        out[cuda.threadIdx.x] = acc

    return chase, powers, sincos


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--launches", type=int, default=36, help="launches a graph (one a layer)")
    parser.add_argument("--rounds", type=int, default=30, help="replays of each graph (median)")
    parser.add_argument("--out", help="append the result section to this markdown file")
    args = parser.parse_args()
    from executor.device import DeviceError

    try:
        open_bench_device(False)  # before numba.cuda loads
    except DeviceError as error:
        sys.exit(f"{error} (this benchmark needs a GPU: it replays CUDA graphs)")
    import numpy as np
    import torch

    chase, powers, sincos = build_kernels()
    order = np.random.default_rng(0).permutation(CHAIN_ENTRIES).astype(np.int32)
    cycle = np.empty(CHAIN_ENTRIES, np.int32)
    cycle[order] = np.roll(order, -1)  # one cycle through every entry, in random order
    wide = torch.from_numpy(cycle).cuda()
    narrow = torch.tensor([1, 2, 3, 0], dtype=torch.int32, device="cuda")
    out_int = torch.zeros(1, dtype=torch.int32, device="cuda")
    out = torch.zeros(64, dtype=torch.float32, device="cuda")
    positions = torch.tensor([500], dtype=torch.int32, device="cuda")
    graphs = {}
    for n in LINKS:
        graphs[f"{n} dependent loads, 4 MiB cycle (L2)"] = launch_graph(
            lambda s, n=n: chase[1, 32, s](wide, n, out_int), args.launches)
        graphs[f"{n} dependent loads, 4-entry cycle (L1)"] = launch_graph(
            lambda s, n=n: chase[1, 32, s](narrow, n, out_int), args.launches)
    for n in MATH_LINKS:
        graphs[f"{n} float64 powers (64 threads)"] = launch_graph(lambda s, n=n: powers[1, 64, s](out, n), args.launches)
        graphs[f"{n} float32 sincos (64 threads)"] = launch_graph(
            lambda s, n=n: sincos[1, 64, s](out, positions, n), args.launches)

    samples = interleaved_replay_us(graphs, args.rounds)
    rows = [[name, fmt(statistics.median(values) / args.launches, 2)] for name, values in samples.items()]
    emit("Latency of a small kernel's pieces, per launch in a CUDA graph", run_info(torch.device("cuda")),
         markdown_table(["kernel", "us a launch"], rows, [False, True]), args.out)


if __name__ == "__main__":
    main()
