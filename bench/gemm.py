"""The projection GEMMs a step runs, through cuBLAS, at the row counts serving steps take.

    python3 bench/gemm.py [--models qwen3-8b,qwen3.5-9b] [--rows 64,128,256,8192,8448] [--split-k 1,2,4]
                          [--swapped] [--repeats 20] [--out FILE]

GPU only. For each model, the GEMMs of one layer of each kind (planner/geometry.py: the fused QKV and
o_proj of a full-attention layer, the fused in_proj and out_proj of a linear-attention layer, the MLP's
fused gate_up and down_proj), ``out[rows, N] = x[rows, K] @ W[N, K]^T`` in the weights' dtype into a
preallocated output, as executor/models/projections.py calls ``torch.matmul``. Each row gives the
median time of ``--repeats`` calls between CUDA events, the rate in TFLOP/s and its share of the
reference rate (``torch.matmul`` of two 8,192^2 matrices, measured in the same run: what
bench/serve.py's ideal time divides FLOPs by), and the time over the GEMM's bound: the larger of its
FLOPs at the reference rate and its bytes (x, W and out once) at the copy bandwidth measured in the
same run.

Decode steps of 64-256 rows sit near the ridge of both, where a GEMM of few output tiles leaves SMs
idle; prefill steps of 8,192 rows and more are compute-bound, and the row count a step takes
(``max_prefill_tokens`` plus its decode rows, or serving ``max_step_tokens``) picks cuBLAS's kernel.

``--split-k S`` (S > 1) also times the GEMM split along K into S slices: one strided-batched
``torch.bmm`` of the slices into float32 partials ``[S, rows, N]`` (S times the output tiles for the
SMs to share), then ``torch.sum`` of the partials into the bf16 output. Its bytes add the partials'
write and read; the row shows the whole (bmm and sum) and the bmm alone, to tell whether a reduction
fused into the next kernel would pay.

``--swapped`` also times the same product with the operands swapped, ``out^T[N, rows] = W[N, K] @
x[rows, K]^T``: cuBLAS sees the problem's m and n exchanged and chooses its kernel for that shape. The
row shows it alone and with the transpose back into ``out`` (one copy of the output), to tell whether
a decode GEMM would gain from asking for the transposed product.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python3 bench/x.py` puts bench/ first on the path, not the repo
    sys.path.insert(0, str(ROOT))

from bench.common import (  # noqa: E402
    copy_bandwidth_bytes_per_s, emit, fmt, int_list, log, markdown_table, matmul_flops_per_s, median, run_info,
    sample_ms, str_list,
)

REFERENCE_SIZE = 8192
COPY_BYTES = 1 << 30


@dataclass(frozen=True)
class Projection:
    """One GEMM of a layer: ``rows`` x ``k`` activations times an ``n`` x ``k`` weight."""

    name: str
    k: int
    n: int


def projections(model_name: str) -> list[Projection]:
    """The projection GEMMs of a layer of each kind the model has, from its planned geometry."""
    from planner.geometry import build_geometry
    from planner.loader import load_model, load_serving

    g = build_geometry(load_model(model_name), load_serving("default"))
    found = []
    if g.num_full_layers:
        found += [Projection("attention qkv", g.hidden_size, g.qkv_rows),
                  Projection("attention o_proj", g.attn_out_width, g.hidden_size)]
    if g.num_linear_layers:
        found += [Projection("linear in_proj", g.hidden_size, g.linear_in_proj_rows),
                  Projection("linear out_proj", g.linear_value_width, g.hidden_size)]
    return found + [Projection("mlp gate_up", g.hidden_size, g.gate_up_rows),
                    Projection("mlp down_proj", g.intermediate_size, g.hidden_size)]


def time_gemm(x, weight, out, split: int, device, repeats: int) -> tuple[float, float | None]:
    """Median ms of ``out = x @ weight^T``, whole and (split > 1) its batched GEMM alone.

    split 1 is ``torch.matmul`` into ``out``. split S views x ``[rows, K]`` as ``[S, rows, K/S]`` and the
    weight ``[N, K]`` as ``[S, K/S, N]`` (strided views, no copies), multiplies the slices into float32
    partials in one batched GEMM and sums them into ``out``.
    """
    import torch

    if split == 1:
        return median(sample_ms(lambda: torch.matmul(x, weight.t(), out=out), device, warmup=3,
                                repeats=repeats)), None
    rows, k = x.shape
    n = weight.shape[0]
    xs = x.view(rows, split, k // split).transpose(0, 1)
    ws = weight.view(n, split, k // split).permute(1, 2, 0)
    partials = torch.empty(split, rows, n, device=device, dtype=torch.float32)

    def batched() -> None:
        torch.ops.aten.bmm.dtype_out(xs, ws, torch.float32, out=partials)

    def whole() -> None:
        batched()
        torch.sum(partials, 0, out=out)

    whole()
    expected = torch.matmul(x.float(), weight.float().t())
    assert torch.allclose(out.float(), expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item()), \
        "split-K result differs from the float32 product"
    whole_ms = median(sample_ms(whole, device, warmup=3, repeats=repeats))
    bmm_ms = median(sample_ms(batched, device, warmup=3, repeats=repeats))
    return whole_ms, bmm_ms


def time_swapped(x, weight, out, device, repeats: int) -> tuple[float, float]:
    """Median ms of ``out^T = weight @ x^T`` into a ``[N, rows]`` buffer, with and without the copy back."""
    import torch

    out_t = torch.empty(weight.shape[0], x.shape[0], device=device, dtype=out.dtype)

    def swapped() -> None:
        torch.matmul(weight, x.t(), out=out_t)

    def with_copy() -> None:
        swapped()
        out.copy_(out_t.t())

    with_copy()
    expected = torch.matmul(x.float(), weight.float().t())
    assert torch.allclose(out.float(), expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item()), \
        "swapped result differs from the float32 product"
    return (median(sample_ms(with_copy, device, warmup=3, repeats=repeats)),
            median(sample_ms(swapped, device, warmup=3, repeats=repeats)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=str_list, default=["qwen3-8b", "qwen3.5-9b"])
    parser.add_argument("--rows", type=int_list, default=[64, 128, 256, 8192, 8448])
    parser.add_argument("--split-k", type=int_list, default=[1],
                        help="K slices; 1 is torch.matmul, S > 1 a batched GEMM of S slices and a sum")
    parser.add_argument("--swapped", action="store_true",
                        help="also time out^T = W @ x^T, with and without the transpose back")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=None, help="also append the result to FILE")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench/gemm.py times cuBLAS on a GPU; none is visible")
    device = torch.device("cuda")
    dtype = torch.bfloat16
    reference = matmul_flops_per_s(device, REFERENCE_SIZE, "bfloat16", repeats=args.repeats)
    copy = copy_bandwidth_bytes_per_s(device, COPY_BYTES, repeats=args.repeats)
    log(f"reference {reference / 1e12:,.1f} TFLOP/s, copy {copy / 1e9:,.0f} GB/s")
    rows_out = []
    for model_name in args.models:
        for projection in projections(model_name):
            weight = torch.randn(projection.n, projection.k, device=device).to(dtype)
            x_all = torch.randn(max(args.rows), projection.k, device=device).to(dtype)
            out_all = torch.empty(max(args.rows), projection.n, device=device, dtype=dtype)
            for rows in args.rows:
                x, out = x_all[:rows], out_all[:rows]
                flops = 2 * rows * projection.k * projection.n
                moved = 2 * (rows * projection.k + projection.n * projection.k + rows * projection.n)
                bound_s = max(flops / reference, moved / copy)
                timings = [(str(split), *time_gemm(x, weight, out, split, device, args.repeats))
                           for split in args.split_k if projection.k % split == 0]
                if args.swapped:
                    timings.append(("swapped", *time_swapped(x, weight, out, device, args.repeats)))
                for variant, ms, part_ms in timings:
                    rate = flops / (ms * 1e-3)
                    rows_out.append([model_name, projection.name, f"{projection.k:,} -> {projection.n:,}",
                                     f"{rows:,}", variant, fmt(ms * 1e3, 1),
                                     "-" if part_ms is None else fmt(part_ms * 1e3, 1), fmt(rate / 1e12, 1),
                                     f"{rate / reference:.2f}", f"{ms * 1e-3 / bound_s:.2f}"])
            del weight, x_all, out_all
    table = markdown_table(["model", "GEMM", "K -> N", "rows", "variant", "us", "GEMM alone us", "TFLOP/s",
                            "of the reference", "time / bound"],
                           rows_out, [False, False, False, True, True, True, True, True, True, True])
    body = (f"Reference: bf16 `torch.matmul` of two {REFERENCE_SIZE:,}^2 matrices, {reference / 1e12:,.1f} TFLOP/s; "
            f"copy {copy / 1e9:,.0f} GB/s (both measured in this run).\n\n{table}")
    emit("Projection GEMMs by step rows (bench/gemm.py)", run_info(device), body, args.out)


if __name__ == "__main__":
    main()
