"""Causal prefill attention of one layer: memplan's tensor-core flash kernel vs torch SDPA.

    python3 bench/attention.py [--models qwen3-8b,qwen3.5-9b] [--prompts 4096,16384] [--out FILE]
                               [--block-shapes default,warpgroup,4:32:2:shared:2,warpgroup:64:overlap:swizzle]
    python3 bench/attention.py --smoke     # a tiny shape in the Numba CUDA simulator (checks the script)

For each model's attention heads (Qwen3-8B: 32 q / 8 kv heads of 128; Qwen3.5-9B: 16 / 4 of 256
with the gated, strided q) and each prompt length, one request's whole prompt attends causally
to itself, bf16. The script reports:

- memplan: ``executor.kernels.attention.flash.FlashAttention``, which never writes scores.
- SDPA: ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)`` on the same q as
  [1, heads, tokens, D] and K/V repeated to the q heads beforehand (untimed), as HF's sdpa attention
  calls it after ``repeat_kv``. (Unbatched [heads, tokens, D] inputs with ``enable_gqa=True`` ran at
  10-15 TFLOP/s on the H200 with torch 2.11: not its flash kernel.)

``--block-shapes`` times the mma.sync kernel at block shapes (executor.kernels.attention.flash.BlockShape,
``warps:keys:m-tiles:registers|shared[:blocks an SM]``; ``default``: the one ``block_shape`` picks) and
the warpgroup kernel (executor.kernels.attention.flash_wgmma, sm_90a: ``warpgroup`` at
``warpgroup_shape``'s choice, which executor/routing.py sends Hopper prefill to, or
``warpgroup:keys[:overlap][:swizzle]``; overlap runs a key block's P V on into the next Q K^T, swizzle
stages 128-byte swizzled tiles), SDPA once for them all; each row names its shape and the
registers and spilled (local) bytes a thread of that kernel holds. Time is the median of
``--repeats`` launches between CUDA events. TFLOP/s counts the causal
half of 4 x T^2 x Hq x D (QK^T and PV). The memplan kernel's largest difference from float64
attention over the first and last 64 query rows is printed too.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    emit, event_median_us, fmt, int_list, log, markdown_table, open_bench_device, run_info, str_list)


@dataclass(frozen=True)
class Heads:
    q_heads: int
    kv_heads: int
    head_dim: int
    strided_q: bool  # Qwen3.5: q heads sit 2 x head_dim apart ([q | gate])


#: ``--block-shapes`` item for the warpgroup kernel at ``warpgroup_shape``'s choice (what sm_90 runs).
WARPGROUP_DEFAULT = "warpgroup"
HEADS = {"qwen3-8b": Heads(32, 8, 128, False), "qwen3.5-9b": Heads(16, 4, 256, True)}
SMOKE_HEADS = Heads(2, 1, 32, True)


def parse_shapes(text: str) -> list[Any]:
    """``default,4:64:1:registers,4:32:2:shared`` -> [None, BlockShape(4, 64, 1, False), ...] (None:
    block_shape's choice)."""
    from executor.kernels.attention.flash import BlockShape
    from executor.kernels.attention.flash_wgmma import WarpgroupShape

    shapes = []
    for item in str_list(text):
        if item == "default":
            shapes.append(None)
            continue
        if item == WARPGROUP_DEFAULT:
            shapes.append(item)
            continue
        if item.startswith("warpgroup:"):
            try:
                _, keys, *flags = item.split(":")
                if not set(flags) <= {"overlap", "swizzle"}:
                    raise ValueError(":".join(flags))
                shapes.append(WarpgroupShape(keys=int(keys), overlap="overlap" in flags, swizzle="swizzle" in flags))
            except ValueError as error:
                raise argparse.ArgumentTypeError(
                    f"block shape {item!r}: expected warpgroup:KEYS[:overlap][:swizzle] ({error})") from None
            continue
        try:
            warps, keys, m_tiles, query, *bound = item.split(":")
            if query not in ("registers", "shared") or len(bound) > 1:
                raise ValueError(query)
            blocks_per_sm = int(bound[0]) if bound else None
            shapes.append(BlockShape(int(warps), int(keys), int(m_tiles), query == "shared", blocks_per_sm))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"block shape {item!r}: expected warps:keys:m-tiles:registers|shared[:blocks an SM] (where Q's "
                "fragments live; the launch bound), or default") from None
    return shapes


def shape_name(shape: Any) -> str:
    if not hasattr(shape, "warps"):
        return f"warpgroup:{shape.keys}" + (":overlap" if shape.overlap else "") + (":swizzle" if shape.swizzle else "")
    bound = f":{shape.blocks_per_sm}" if shape.blocks_per_sm else ""
    return f"{shape.warps}:{shape.keys}:{shape.m_tiles}:{'shared' if shape.query_in_shared else 'registers'}{bound}"


def kernel_registers(flash: Any, heads: Heads) -> str:
    """``registers / local bytes`` a thread of the compiled kernel holds (n/a in the simulator)."""
    *_, kernel = flash.launch_shape(heads.head_dim, heads.q_heads // heads.kv_heads)
    if kernel.simulated:
        return "n/a"
    # The cuda.core kernel the fast launch path holds (compiled here or loaded from the kernel cache).
    launched = next(entry[0] for entry in kernel._launches.values() if entry is not None)
    return f"{launched.attributes.num_regs} / {launched.attributes.local_size_bytes}"


def measure(torch, device, runtime, heads: Heads, tokens: int, repeats: int, shapes: list[Any],
            smoke: bool) -> list[list[str]]:
    """One row per block shape: [shape, prompt tokens, heads, registers, ours us, TFLOP/s, SDPA us, TFLOP/s,
    SDPA / ours, error]."""
    from executor.kernels.attention.flash import FlashAttention, block_shape, single_request
    from executor.kernels.attention.flash_wgmma import WarpgroupFlashAttention, WarpgroupShape, warpgroup_shape
    from tests.kernels.attention_reference import causal_attention

    width = 2 * heads.head_dim if heads.strided_q else heads.head_dim
    q = torch.randn(tokens, heads.q_heads, width, device=device).bfloat16()[..., :heads.head_dim]
    k = torch.randn(heads.kv_heads, tokens, heads.head_dim, device=device).bfloat16()  # GatherKv's layout
    v = torch.randn(heads.kv_heads, tokens, heads.head_dim, device=device).bfloat16()
    out = torch.empty(tokens, heads.q_heads, heads.head_dim, device=device).bfloat16()
    bits = [t.view(torch.int16) for t in (q, k, v, out)]  # the simulator, too, takes torch tensors as they are
    q_indptr, positions = (torch.as_tensor(a, device=device) for a in single_request(tokens, tokens))
    qt = q.transpose(0, 1)[None]  # [1, Hq, T, D], batched like HF's call
    group = heads.q_heads // heads.kv_heads
    k_repeated, v_repeated = (t.repeat_interleave(group, dim=0)[None] for t in (k, v))

    def sdpa() -> None:
        torch.nn.functional.scaled_dot_product_attention(qt, k_repeated, v_repeated, is_causal=True)

    flops = 4 * tokens * tokens * heads.q_heads * heads.head_dim / 2
    sdpa_us = None
    if not smoke:
        sdpa()  # warm-up
        sdpa_us = event_median_us(sdpa, repeats)
    # float64 check on the first and last query rows (all T x T scores would not fit at 16384 tokens).
    rows = torch.cat([torch.arange(min(64, tokens)), torch.arange(max(0, tokens - 64), tokens)]).unique().to(device)
    expected = causal_attention(q, k, v, tokens, rows)
    table = []
    for shape in shapes:
        if shape == WARPGROUP_DEFAULT:
            flash, used, note = WarpgroupFlashAttention(), warpgroup_shape(heads.head_dim), " (sm_90 default)"
        elif isinstance(shape, WarpgroupShape):
            flash, used, note = WarpgroupFlashAttention(shape), shape, ""
        else:
            flash, used = FlashAttention(shape), shape or block_shape(heads.head_dim)
            note = " (mma.sync default)" if shape is None else ""
        name = shape_name(used) + note

        def ours() -> None:
            flash(*bits, q_indptr, positions, 0, 1, tokens, tokens, stream=runtime.current_stream())

        out.fill_(float("nan"))
        ours()
        error = (out[rows].double() - expected).abs().max().item()
        cells = [name, f"{tokens:,}", f"{heads.q_heads}/{heads.kv_heads} x {heads.head_dim}", kernel_registers(flash, heads)]
        if smoke:
            table.append([*cells, "n/a", "n/a", "n/a", "n/a", "n/a", f"{error:.4f}"])
            continue
        ours_us = event_median_us(ours, repeats)
        log(f"{tokens} tokens, block {name}: ours {ours_us:.1f} us, SDPA {sdpa_us:.1f} us")
        table.append([*cells, fmt(ours_us, 1), fmt(flops / ours_us / 1e6, 0), fmt(sdpa_us, 1),
                      fmt(flops / sdpa_us / 1e6, 0), fmt(sdpa_us / ours_us), f"{error:.4f}"])
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=str_list, default=list(HEADS), help="comma-separated: " + ", ".join(HEADS))
    parser.add_argument("--prompts", type=int_list, default=[4096, 16384], help="prompt tokens (default 4096,16384)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--block-shapes", type=parse_shapes, default=[None, WARPGROUP_DEFAULT],
                        help="comma-separated warps:keys:m-tiles:registers|shared[:blocks an SM] (Q fragments' place; "
                             "the launch bound), default (block_shape's choice), warpgroup (warpgroup_shape's) or "
                             "warpgroup:KEYS[:overlap][:swizzle]; default: default,warpgroup")
    parser.add_argument("--smoke", action="store_true", help="a 70-token prompt of tiny heads in the simulator")
    parser.add_argument("--out", default=None, help="append the result as a markdown section to this file")
    args = parser.parse_args()
    unknown = set(args.models) - set(HEADS)
    if unknown:
        parser.error(f"unknown models {sorted(unknown)}; choose from {list(HEADS)}")
    runtime = open_bench_device(args.smoke)
    import torch

    torch.manual_seed(0)
    device = runtime.torch_device
    rows = []
    for model in args.models:
        for tokens in [70] if args.smoke else args.prompts:
            heads = SMOKE_HEADS if args.smoke else HEADS[model]
            for row in measure(torch, device, runtime, heads, tokens, args.repeats, args.block_shapes, args.smoke):
                rows.append(["tiny (smoke)" if args.smoke else model, *row])
            if args.smoke:
                break
        if args.smoke:
            break
    table = markdown_table(["model", "block (warps:keys:m-tiles:Q)", "prompt tokens", "q/kv heads x D",
                            "registers / local bytes", "memplan us", "memplan TFLOP/s", "SDPA us", "SDPA TFLOP/s",
                            "SDPA / memplan", "max abs err vs float64"],
                           rows, [False, False, True, False, False, True, True, True, True, True, True])
    emit("Causal prefill attention of one layer (bench/attention.py)", run_info(device), table, args.out)


if __name__ == "__main__":
    main()
