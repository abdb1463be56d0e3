"""One layer's gated delta rule over a prefill step: memplan's chunked kernel vs its recurrent kernel
vs flash-linear-attention's chunk_gated_delta_rule.

    python3 bench/delta_rule.py [--models qwen3.5-9b,qwen3.5-27b] [--batches 1x4096,1x16384,8x2048,64x512]
                                [--shapes default,64:32:8:16] [--repeats 20] [--out FILE]
    python3 bench/delta_rule.py --smoke     # tiny heads in the Numba CUDA simulator (checks the script)

Each batch ``RxN`` is R requests of N tokens in one launch, bf16 q/k/v (the conv1d output's
layout, [T, 2 Hk dk + Hv dv]), float32 g and beta, every request continuing a random float32
state. The script reports, per model's linear heads (Qwen3.5-9B: Hk 16, Hv 32; 27B: Hv 48; dk = dv
= 128) and batch:

- chunked: ``executor.kernels.linear_attention.chunked_delta_rule.ChunkedGatedDeltaRule``, once per
  ``--shapes`` entry (chunk:dv_tile:warps:solve_block[:buffers]; ``default`` is the launcher's routed shapes:
  GPU_SHAPE, its scan at GPU_NARROW_SHAPE where GPU_SHAPE's scan grid leaves SMs idle; the row names the scan
  shape it ran), with the registers and local (spilled) bytes a thread of each of its launches holds
  and each launch's time alone (prepare + scan);
- recurrent: ``executor.kernels.linear_attention.delta_rule.GatedDeltaRule`` (the default prefill route);
- fla: ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` when importable (q and k repeated to the
  value heads beforehand, untimed, as HF's layer calls it; ``cu_seqlens`` for several requests).

Time is the median of ``--repeats`` calls between CUDA events on the current stream (a call's host
launch cost counts where it exceeds the GPU's). The relative error columns are max |a - b| / max |b|
of the outputs against the recurrent kernel and against fla.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    emit, event_median_us, fmt, log, markdown_table, open_bench_device, run_info, str_list)


@dataclass(frozen=True)
class Heads:
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int


HEADS = {"qwen3.5-9b": Heads(16, 32, 128, 128), "qwen3.5-27b": Heads(16, 48, 128, 128)}
SMOKE_HEADS = Heads(1, 2, 16, 16)
DEFAULT_BATCHES = "1x4096,1x16384,8x2048,64x512"


def parse_batches(text: str) -> list[tuple[int, int]]:
    """``1x4096,8x2048`` -> [(1, 4096), (8, 2048)]."""
    batches = []
    for item in str_list(text):
        try:
            requests, tokens = (int(part) for part in item.split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"batch {item!r}: expected REQUESTSxTOKENS, e.g. 8x2048") from None
        if requests < 1 or tokens < 1:
            raise argparse.ArgumentTypeError(f"batch {item!r}: requests and tokens must be >= 1")
        batches.append((requests, tokens))
    return batches


def parse_shapes(text: str) -> list[Any]:
    """``default,64:32:8:16:1`` -> [None, ChunkShape(64, 32, 8, 16, 1)] (None: the launcher's default; the
    scan's buffers may be left out, 2)."""
    from executor.kernels.linear_attention.chunked_delta_rule import ChunkShape

    shapes = []
    for item in str_list(text):
        if item == "default":
            shapes.append(None)
            continue
        try:
            shapes.append(ChunkShape(*(int(part) for part in item.split(":"))))
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"shape {item!r}: expected chunk:dv_tile:warps:solve_block[:buffers] or "
                                             "default") \
                from None
    return shapes


def shape_name(shape: Any) -> str:
    return f"{shape.chunk}:{shape.dv_tile}:{shape.warps}:{shape.solve_block}:{shape.buffers}"


def kernel_registers(kernel: Any) -> str:
    """``registers / local bytes`` a thread of the compiled kernel holds (n/a in the simulator)."""
    if kernel.simulated:
        return "n/a"
    overloads = list(kernel.dispatcher.overloads.values())
    if not overloads:  # loaded from the kernel cache: no Numba overload holds its attributes
        return "n/a (cached)"
    attributes = overloads[0]._codelibrary.get_cufunc().attrs
    return f"{attributes.regs} / {attributes.local}"


def relative_error(torch: Any, got: Any, want: Any) -> float:
    return float((got.double() - want.double()).abs().max() / want.double().abs().max())


def measure(torch: Any, runtime: Any, heads: Heads, requests: int, tokens: int, shapes: list[Any], repeats: int,
            smoke: bool) -> list[list[str]]:
    """Rows [kernel, registers, us, prepare + scan us (each launch alone), recurrent / it, fla / it, rel. err
    vs recurrent, rel. err vs fla]."""
    import torch.nn.functional as F

    from executor.kernels.linear_attention.chunked_delta_rule import ChunkedGatedDeltaRule, ChunkScratch
    from executor.kernels.linear_attention.delta_rule import GatedDeltaRule
    from planner.kernel_limits import DELTA_RULE_CHUNK, DELTA_RULE_ROW_SCALARS
    from executor.kernels.primitives.codec import build_codec

    device = runtime.torch_device
    hk, hv, dk, dv = heads.key_heads, heads.value_heads, heads.key_dim, heads.value_dim
    rows = requests * tokens
    qkv = F.silu(torch.randn(rows, 2 * hk * dk + hv * dv, device=device) * 2).bfloat16()
    g = -torch.rand(rows, hv, device=device) * 1.5
    beta = torch.rand(rows, hv, device=device)
    initial = torch.randn(requests, hv, dk, dv, device=device) * 0.5
    q_indptr = torch.arange(0, rows + 1, tokens, dtype=torch.int32, device=device)
    slot_ids = torch.arange(requests, dtype=torch.int32, device=device)
    codec = build_codec("bfloat16")
    stream = runtime.current_stream()

    # The chunked kernel's scratch, as the plan lays it out (planner/kernel_limits.py).
    scratch = ChunkScratch(torch.empty(rows, hv, DELTA_RULE_CHUNK, dtype=torch.bfloat16, device=device),
                           torch.empty(rows, hv, DELTA_RULE_CHUNK, dtype=torch.bfloat16, device=device),
                           torch.empty(rows, hv, DELTA_RULE_ROW_SCALARS, device=device))

    def runner(rule: Any) -> tuple[Any, Any, tuple]:
        state = initial.clone()
        out = torch.empty(rows, hv, dv, device=device).bfloat16()
        bits = (qkv.view(torch.int16), g, beta, state, q_indptr, slot_ids, out.view(torch.int16))
        extra = {"scratch": scratch} if isinstance(rule, ChunkedGatedDeltaRule) else {}
        return (lambda: rule(*bits, **extra, stream=stream)), (out, state), bits

    recurrent_rule = GatedDeltaRule(codec, dk, **({"dk_split": 1} if smoke else {}))
    candidates = [("recurrent", recurrent_rule, "n/a")]
    for shape in shapes:
        rule = ChunkedGatedDeltaRule(codec, dk, recurrent_rule, shape)
        used = rule.scan(dv, rule.scan_shape(dv, hv, requests))[0]
        candidates.append((f"chunked {shape_name(used)}" + (" (default)" if shape is None else ""), rule, None))
    outputs: dict[str, Any] = {}
    times: dict[str, float | None] = {}
    registers: dict[str, str] = {}
    parts: dict[str, str] = {}
    for name, rule, regs in candidates:
        call, (out, _), bits = runner(rule)
        call()  # compiles; the first output is the one compared (every call starts from its own state copy)
        outputs[name] = out.clone()
        parts[name] = "n/a"
        if regs is None:  # the launches that ran: the prepare pass, the routed scan
            prepare, scan = rule.kernel(dv)[1][0][0], rule.scan(dv, rule.scan_shape(dv, hv, requests))[1]
            regs = f"{kernel_registers(prepare)} + {kernel_registers(scan)}"
            if not smoke:  # each launch alone (the scan reruns on the state the last call left: the same work)
                launches = rule.launches(*bits, scratch=scratch, stream=stream)
                parts[name] = " + ".join(fmt(event_median_us(launch, repeats), 1) for _, launch in launches)
        registers[name] = regs
        times[name] = None if smoke else event_median_us(call, repeats)
        log(f"{requests}x{tokens} {name}: {fmt(times[name], 1)} us ({parts[name]})")
    fla_out, fla_us = None, None
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        chunk_gated_delta_rule = None
    if chunk_gated_delta_rule is not None and not smoke:
        q, k, v = torch.split(qkv, [hk * dk, hk * dk, hv * dv], dim=-1)
        q = q.reshape(rows, hk, dk).repeat_interleave(hv // hk, dim=1)[None].contiguous()
        k = k.reshape(rows, hk, dk).repeat_interleave(hv // hk, dim=1)[None].contiguous()
        v = v.reshape(rows, hv, dv)[None].contiguous()
        cu_seqlens = q_indptr.long() if requests > 1 else None
        fla_g, fla_beta = g[None].contiguous(), beta[None].bfloat16()

        def fla_call() -> Any:
            return chunk_gated_delta_rule(q, k, v, g=fla_g, beta=fla_beta, initial_state=initial,
                                          output_final_state=True, cu_seqlens=cu_seqlens,
                                          use_qk_l2norm_in_kernel=True)

        fla_out = fla_call()[0][0]
        fla_us = event_median_us(fla_call, repeats)
        log(f"{requests}x{tokens} fla: {fmt(fla_us, 1)} us")
    table = []
    recurrent_us = times["recurrent"]
    for name, _, _ in candidates:
        us = times[name]
        table.append([name, registers[name], fmt(us, 1), parts[name],
                      fmt(recurrent_us / us) if us and recurrent_us else "n/a",
                      fmt(fla_us / us) if us and fla_us else "n/a",
                      f"{relative_error(torch, outputs[name], outputs['recurrent']):.2e}",
                      f"{relative_error(torch, outputs[name], fla_out):.2e}" if fla_out is not None else "n/a"])
    if fla_us is not None:
        table.append(["fla chunk_gated_delta_rule", "n/a", fmt(fla_us, 1), "n/a", fmt(recurrent_us / fla_us), "1.00",
                      f"{relative_error(torch, fla_out, outputs['recurrent']):.2e}", "0"])
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=str_list, default=["qwen3.5-9b"], help="comma-separated: " + ", ".join(HEADS))
    parser.add_argument("--batches", type=parse_batches, default=parse_batches(DEFAULT_BATCHES),
                        help=f"comma-separated REQUESTSxTOKENS (default {DEFAULT_BATCHES})")
    parser.add_argument("--shapes", default="default",
                        help="comma-separated chunk:dv_tile:warps:solve_block[:buffers] of the chunked kernel, "
                             "or default")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="one tiny batch in the simulator")
    parser.add_argument("--out", default=None, help="append the result as a markdown section to this file")
    args = parser.parse_args()
    unknown = set(args.models) - set(HEADS)
    if unknown:
        parser.error(f"unknown models {sorted(unknown)}; choose from {list(HEADS)}")
    runtime = open_bench_device(args.smoke)  # before anything imports numba.cuda
    try:
        shapes = parse_shapes(args.shapes)
    except argparse.ArgumentTypeError as error:
        parser.error(str(error))
    import torch

    torch.manual_seed(0)
    rows = []
    models = ["tiny (smoke)"] if args.smoke else args.models
    for model in models:
        heads = SMOKE_HEADS if args.smoke else HEADS[model]
        for requests, tokens in [(2, 40)] if args.smoke else args.batches:
            for row in measure(torch, runtime, heads, requests, tokens, shapes, args.repeats, args.smoke):
                rows.append([model, f"{requests} x {tokens:,}", *row])
    table = markdown_table(["model", "requests x tokens", "kernel (chunk:dv_tile:warps:solve_block:buffers)",
                            "registers / local bytes", "us", "prepare + scan us", "recurrent / it", "fla / it",
                            "rel. err vs recurrent", "rel. err vs fla"],
                           rows, [False, False, False, False, True, True, True, True, True, True])
    emit("Gated delta rule of one layer (bench/delta_rule.py)", run_info(runtime.torch_device), table, args.out)


if __name__ == "__main__":
    main()
