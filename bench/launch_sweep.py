"""Launch-configuration sweeps of the decode kernels whose defaults came from measurement (issue 6).

    python3 bench/launch_sweep.py [--attention mma:auto,mma:2:3,128:4:4,...] [--shapes 1:512:64,64:4096,...]
                                  [--gemv 4x4,16x1,...] [--out FILE]
    python3 bench/launch_sweep.py --smoke     # tiny shapes in the Numba CUDA simulator (checks the script)

- Decode attention (executor/kernels/attention/decode.py) at Qwen3-8B's heads (32 q / 8 kv heads of
  128, bf16, pages of 16). Configurations: ``mma:W:S[:B]``, the tensor-core kernel
  (decode_attention_mma.py) with W warps a block, S ring slots a warp and optionally B, its launch
  bound's blocks an SM; ``mma:auto``, the launcher's own pick (four warps of two slots up to two
  (row, kv head) pairs an SM, two warps of three slots past that); ``NT:U:B``, the CUDA-core kernel
  with NT threads a block, U keys a lane group loads before using any, B the launch bound's blocks
  an SM ("none": no bound, "auto": the kernel's rule). Shapes (requests x cached tokens, ``--shapes``
  B:C[:K], kv chunks of K keys): unsplit ones, as bench/kernels.py times, get their K/V bytes over the
  time as a share of the copy bandwidth; split ones (by default batch 1 in chunks of 64 or 128 keys, as
  a decode step plans them) include the merge launch. K and V are separate caches with shuffled
  pages, or with ``--kv-layers N`` the engine's pool, where a page holds N layers' K and V and each
  request's pages come in order (as in bench/decode.py).
- The fused GEMVs (executor/kernels/gemv.py) at batch 1 on Qwen3-8B's projections: qkv and gate_up
  with their RMSNorm prologue (gate_up with SwiGLU), o_proj and down with the residual add.
  Configuration ``WxB``: W warps a block, B blocks an SM. Each graph cycles over distinct weight
  copies, so a launch never finds its weights in L2.

Timing as bench/kernels.py: launches captured in one CUDA graph, the median over replays between
CUDA events, per launch. Prints markdown tables; ``--out FILE`` appends them with the command, the
GPU and the date.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python3 bench/launch_sweep.py` puts bench/ first on the path, not the repo
    sys.path.insert(0, str(ROOT))

from bench.common import emit, fmt, markdown_table, run_info  # noqa: E402
from bench.kernels import Env, copy_bandwidth, time_us  # noqa: E402

BF16_BYTES = 2
GEMV_WEIGHT_COPIES = 6  # distinct copies a graph cycles over: more than L2 holds of the largest shape


@dataclass(frozen=True)
class AttentionShape:
    batch: int
    context: int
    kv_chunk: int | None  # None: one tile per (request, kv head), as bench/kernels.py


@dataclass(frozen=True)
class Heads:
    q: int
    kv: int
    dim: int
    page_size: int


REAL_HEADS = Heads(32, 8, 128, 16)  # Qwen3-8B
SMOKE_HEADS = Heads(4, 2, 32, 4)  # the smallest head the tensor-core kernel takes
REAL_ATTENTION = "64:4096,32:4096,1:512:64,1:4096:128"  # --shapes' default (parse_shapes)
SMOKE_ATTENTION = (AttentionShape(2, 12, None), AttentionShape(1, 12, 8))
#: (name, out rows N, in features K, kernel): Qwen3-8B's projections.
REAL_GEMVS = (("qkv", 6144, 4096, "norm_project"), ("gate_up", 24576, 4096, "norm_swiglu"),
              ("o_proj", 4096, 4096, "project_add"), ("down", 4096, 12288, "project_add"))
SMOKE_GEMVS = (("qkv", 24, 64, "norm_project"), ("gate_up", 32, 64, "norm_swiglu"), ("down", 16, 32, "project_add"))


def parse_attention(text: str) -> list[dict[str, Any]]:
    """``NT:U:B,...`` -> DecodeAttention keywords of the CUDA-core kernel (threads, unroll_keys,
    blocks_per_sm: an int, None ("none") or "auto"); ``mma:W:S[:B]`` -> the tensor-core kernel's (warps,
    slots, blocks_per_sm; default none)."""
    configs: list[dict[str, Any]] = []
    for item in text.split(","):
        if item == "mma:auto":
            configs.append({"num_sms": "device"})
            continue
        first, second, third, *rest = item.split(":")
        if first == "mma":
            from executor.kernels.attention.decode_mma import MmaShape

            bound = rest[0] if rest else "none"
            configs.append({"mma_shape": MmaShape(int(second), int(third)),
                            "blocks_per_sm": None if bound == "none" else int(bound)})
            continue
        blocks = None if third == "none" else third if third == "auto" else int(third)
        configs.append({"tensor_cores": False, "threads": int(first), "unroll_keys": int(second),
                        "blocks_per_sm": blocks})
    return configs


def config_name(config: dict[str, Any]) -> str:
    if "num_sms" in config:
        return "mma:auto"
    if config.get("tensor_cores", True):
        shape, bound = config["mma_shape"], config["blocks_per_sm"]
        return f"mma:{shape.warps}:{shape.slots}:{'none' if bound is None else bound}"
    bound = config["blocks_per_sm"]
    return f"{config['threads']}:{config['unroll_keys']}:{'none' if bound is None else bound}"


def parse_shapes(text: str) -> tuple[AttentionShape, ...]:
    """``B:C[:K],...`` -> attention shapes: B requests of C cached tokens, in kv chunks of K keys (none:
    one tile per (request, kv head))."""
    shapes = []
    for item in text.split(","):
        batch, context, *chunk = (int(n) for n in item.split(":"))
        shapes.append(AttentionShape(batch, context, chunk[0] if chunk else None))
    return tuple(shapes)


def parse_gemv(text: str) -> list[tuple[int, int]]:
    """``WxB,...`` -> [(warps, blocks_per_sm)]."""
    return [tuple(int(n) for n in item.split("x")) for item in text.split(",")]  # type: ignore[misc]


def attention_call(env: Env, heads: Heads, shape: AttentionShape, general: Any,
                   kv_layers: int = 0, grid_tiles: int = 0) -> tuple[Callable[..., None], int]:
    """(call(launcher, stream), K/V bytes read): one decode-attention call's arguments at ``shape``.

    ``kv_layers`` 0: K and V caches of their own, [pages, S, Hkv, D], pages shuffled. Otherwise the
    engine's layout: one pool [pages, kv_layers, 2, S, Hkv, D] (a page holds every layer's K and V,
    executor/models/blocks.py), the middle layer's K and V, each request's pages in order as
    bench/decode.py gives them; only that layer's bytes are filled. ``grid_tiles`` > 0: the tile list
    padded with empty tiles to ``grid_tiles`` x batch entries, as a decode graph's grid of that many
    tiles a request (the kernels' padding blocks exit at once)."""
    from executor.tiles import plan_tiles

    torch = env.torch
    b, c, page = shape.batch, shape.context, heads.page_size
    pages_per_request = -(-c // page)
    num_pages = 1 + b * pages_per_request
    if kv_layers:
        pool = torch.empty(num_pages, kv_layers, 2, page, heads.kv, heads.dim, dtype=torch.bfloat16,
                           device=env.device)
        pool[:, kv_layers // 2].copy_(env.randn(num_pages, 2, page, heads.kv, heads.dim))
        k_cache, v_cache = pool[:, kv_layers // 2, 0], pool[:, kv_layers // 2, 1]
        order = torch.arange(1, num_pages)
    else:
        k_cache, v_cache = (env.randn(num_pages, page, heads.kv, heads.dim) for _ in range(2))
        order = torch.randperm(num_pages - 1, generator=torch.Generator().manual_seed(0)) + 1  # page 0 is padding
    q, out = env.randn(b, heads.q, heads.dim), env.randn(b, heads.q, heads.dim)
    as_int32 = lambda values: torch.as_tensor(values, dtype=torch.int32, device=env.device)  # noqa: E731
    q_indptr, kv_lens = list(range(b + 1)), [c] * b
    max_splits = -(-c // shape.kv_chunk) if shape.kv_chunk else 1
    split = {"kv_chunk": shape.kv_chunk, "max_splits": max_splits} if shape.kv_chunk else {}
    if grid_tiles:  # plan_tiles fills the capacity-sized buffers and marks the tail tiles padding (-1)
        tiles = (*(np.zeros(grid_tiles * b, np.int32) for _ in range(3)), np.zeros(b, np.int32))
        plan_tiles(q_indptr, kv_lens, out=tiles, **split)
    else:
        tiles = plan_tiles(q_indptr, kv_lens, **split)
    tiles = [as_int32(a) for a in tiles]
    meta = (as_int32(order), as_int32([r * pages_per_request for r in range(b + 1)]),
            as_int32([c - (pages_per_request - 1) * page] * b), as_int32(q_indptr), as_int32(range(b)),
            as_int32([c - 1] * b), *tiles, torch.tensor([b], dtype=torch.uint32, device=env.device))
    scratch = {}
    if shape.kv_chunk:
        scratch = {"partial_out": torch.empty(b, max_splits, heads.q, heads.dim, device=env.device),
                   "partial_lse": torch.empty(b, max_splits, heads.q, device=env.device)}
    bits = lambda x: x.view(torch.int16)  # noqa: E731
    args = (bits(q), bits(k_cache), bits(v_cache), *meta, bits(out), heads.dim ** -0.5)

    def call(launcher: Any, stream: Any) -> None:
        launcher(*args, **scratch, stream=stream)

    return call, 2 * b * c * heads.kv * heads.dim * BF16_BYTES


def sweep_attention(env: Env, args: argparse.Namespace, copy_bytes_per_s: float) -> str:
    from executor.kernels.attention.paged import PagedAttention
    from executor.kernels.primitives.codec import build_codec
    from executor.kernels.attention.decode import DecodeAttention

    heads = SMOKE_HEADS if args.smoke else REAL_HEADS
    shapes = SMOKE_ATTENTION if args.smoke else args.shapes
    codec = build_codec("bfloat16")
    group = heads.q // heads.kv
    general = PagedAttention(codec, heads.dim, group, **({"threads": 32} if args.smoke else {}))
    calls = [attention_call(env, heads, shape, general, args.kv_layers, args.grid_tiles) for shape in shapes]
    rows = []
    num_sms = None if args.smoke else env.torch.cuda.get_device_properties(0).multi_processor_count
    for config in args.attention:
        launcher = DecodeAttention(codec, heads.dim, group, general,
                                   **{**config, **({"num_sms": num_sms} if "num_sms" in config else {})})
        cells = []
        for shape, (call, kv_bytes) in zip(shapes, calls):
            us = time_us(env, lambda stream, call=call: call(launcher, stream), args.inner, args.repeats, True)
            share = "" if shape.kv_chunk else f" ({kv_bytes / (us * 1e-6) / copy_bytes_per_s:.0%})"
            cells.append(f"{fmt(us, 1)}{share}")
        rows.append([config_name(config), *cells])
        print(f"attention {rows[-1]}", file=sys.stderr)
    headers = ["configuration", *(f"{s.batch} x {s.context}" + (f", chunks of {s.kv_chunk}" if s.kv_chunk else "")
                           for s in shapes)]
    return markdown_table(headers, rows, [False, *(True for _ in shapes)])


def sweep_gemv(env: Env, args: argparse.Namespace) -> str:
    from executor.kernels.primitives.codec import build_codec
    from executor.kernels.gemv import Gemv

    torch, bits = env.torch, (lambda x: x.view(env.torch.int16))
    gemvs = SMOKE_GEMVS if args.smoke else REAL_GEMVS
    copies = 1 if args.smoke else GEMV_WEIGHT_COPIES
    rows = []
    for name, out_rows, in_features, kernel in gemvs:
        gated = kernel == "norm_swiglu"
        weights = [env.randn(out_rows, in_features, scale=in_features ** -0.5) for _ in range(copies)]
        x, norm_weight = env.randn(1, in_features), env.randn(in_features)
        out = torch.empty(1, out_rows // 2 if gated else out_rows, dtype=torch.bfloat16, device=env.device)
        cells = []
        for warps, blocks in args.gemv:
            gemv = Gemv(build_codec("bfloat16"), True, blocks_per_sm=blocks, warps=warps)
            turn = iter(range(10**9))

            def launch(stream: Any, gemv: Gemv = gemv) -> None:
                weight = bits(weights[next(turn) % copies])
                if kernel == "project_add":
                    gemv.project_add(bits(x), weight, bits(out), stream=stream)
                else:
                    getattr(gemv, kernel)(bits(x), bits(norm_weight), 1e-6, 0.0, weight, bits(out), stream=stream)

            us = time_us(env, launch, max(args.inner, copies), args.repeats, True)
            cells.append(f"{fmt(us, 1)} ({out_rows * in_features * BF16_BYTES / (us * 1e-6) / 1e9:,.0f} GB/s)")
        rows.append([f"{name} {out_rows} x {in_features}", *cells])
        print(f"gemv {rows[-1]}", file=sys.stderr)
        del weights
    return markdown_table(["projection", *(f"{w} x {b}" for w, b in args.gemv)], rows,
                          [False, *(True for _ in args.gemv)])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--attention", type=parse_attention, default=parse_attention(
        "mma:auto,mma:4:2,mma:2:3,mma:2:4,128:4:auto"),
        help="NT:U:B, mma:W:S[:B] or mma:auto configurations (module docstring)")
    parser.add_argument("--shapes", type=parse_shapes, default=parse_shapes(REAL_ATTENTION),
                        help="decode attention shapes B:C[:K] (B requests of C tokens, kv chunks of K keys; "
                             f"default: {REAL_ATTENTION})")
    parser.add_argument("--gemv", type=parse_gemv, default=parse_gemv("4x4,8x2,16x1,2x8,4x3,8x3"),
                        help="WxB configurations (module docstring)")
    parser.add_argument("--kv-layers", type=int, default=0,
                        help="decode attention over the engine's KV layout with this many layers a page "
                             "(36: Qwen3-8B; 0: separate shuffled K/V caches)")
    parser.add_argument("--grid-tiles", type=int, default=0,
                        help="pad each attention call's grid to this many tiles a request with empty tiles, as a "
                             "decode graph sized for that many kv chunks a row (0: the call's tiles only)")
    parser.add_argument("--no-attention", action="store_true")
    parser.add_argument("--no-gemv", action="store_true")
    parser.add_argument("--repeats", type=int, default=30, help="timed graph replays (median)")
    parser.add_argument("--inner", type=int, default=10, help="launches per graph replay")
    parser.add_argument("--copy-gib", type=float, default=2.0, help="size of the copy-bandwidth buffer, GiB")
    parser.add_argument("--out", default=None, help="append the tables to this file")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes in the Numba CUDA simulator (CPU)")
    args = parser.parse_args(argv)
    if args.smoke:  # the simulator runs a thread per Python thread: one-warp blocks, few configs, one launch
        args.attention = [args.attention[0], {**args.attention[-1], "threads": 32}]
        args.gemv = args.gemv[:1]
        args.repeats, args.inner = 1, 1
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    env = Env(args.smoke)
    env.torch.manual_seed(0)
    copy_bytes_per_s, copy_bytes = copy_bandwidth(env, args.copy_gib, args.inner, args.repeats, not args.smoke)
    sections = [f"Copy bandwidth {copy_bytes_per_s / 1e9:,.0f} GB/s (dst.copy_(src) of {copy_bytes / 2**30:.2f} GiB). "
                + ("Simulator: wall time of one launch (checks the script, measures nothing)." if args.smoke else
                   f"CUDA-graph timing, median of {args.repeats} replays, per launch; us.")]
    if not args.no_attention:
        sections.append("Decode attention (mma:W:S: tensor cores, W warps a block, S ring slots a warp; NT:U:B: "
                        "CUDA cores, NT threads, U keys in flight a lane group, B blocks an SM; unsplit shapes: "
                        "K/V bytes over time as a share of the copy bandwidth; "
                        + (f"the engine's KV layout, {args.kv_layers} layers a page" if args.kv_layers else
                           "separate K/V caches, pages shuffled")
                        + (f"; grids padded to {args.grid_tiles} tiles a request" if args.grid_tiles else "")
                        + "):\n\n"
                        + sweep_attention(env, args, copy_bytes_per_s))
    if not args.no_gemv:
        sections.append("Fused GEMVs at batch 1 (W warps a block x B blocks an SM; weight bytes over time):\n\n"
                        + sweep_gemv(env, args))
    emit("Decode kernel launch configurations (bench/launch_sweep.py)", run_info(env.device),
         "\n\n".join(sections), args.out)


if __name__ == "__main__":
    main()
