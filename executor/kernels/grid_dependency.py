"""Programmatic dependent launch (PDL, sm_90+): a kernel starts while the one before it finishes.

A decode step is a chain of a few hundred short kernels, each of which reads what the one before
wrote. Launched plainly, kernel N+1 cannot start until kernel N has fully ended: every boundary
pays the launch of N+1's blocks and the first memory round trip of its prologue, with the SMs
idle. With PDL the two overlap:

    launch_dependents()
        this block allows the next kernel in the stream to launch; once every block of this
        grid has said so (or ended), the next kernel's blocks are scheduled as SMs free up.
    wait_for_prerequisites()
        blocks until the kernel before this one has ended and its memory writes are visible.
        Before it, a kernel may only read what no kernel in the step writes (weights).

The next kernel opts in by its launch (``Kernel(..., dependent_launch=True)`` sets CUDA's
programmatic stream serialization attribute; graph capture records it as a programmatic edge).
A kernel launched that way must call ``wait_for_prerequisites`` in every block before it touches
anything another kernel writes, and before it ends: ordering stays transitive only because each
kernel's completion implies its predecessor's. Kernels launched plainly, torch's included,
keep full stream order, so a PDL kernel may follow or precede any other.

On the GPU both are ``griddepcontrol`` PTX through llvmlite inline asm (no-ops when the launch
did not opt in). Before sm_90, and in the simulator, they are no-ops and ``Kernel`` launches
plainly (``dependent_launch_supported``).
"""

from __future__ import annotations

from typing import Any, Callable

from executor.numba_cuda import load_cuda, simulator_enabled

cuda = load_cuda()
from numba import types  # noqa: E402  (after load_cuda's numpy fix)

#: The first compute capability with griddepcontrol.
MIN_COMPUTE_CAPABILITY = (9, 0)


def dependent_launch_supported() -> bool:
    """Whether the current device runs PDL (not the simulator; compute capability 9.0 or later)."""
    if simulator_enabled():
        return False
    return tuple(cuda.get_current_device().compute_capability) >= MIN_COMPUTE_CAPABILITY


def build_grid_dependency() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """``(wait_for_prerequisites, launch_dependents)`` device functions of no arguments (module docstring)."""
    if not dependent_launch_supported():
        @cuda.jit(device=True, inline=True)
        def no_wait():
            pass

        @cuda.jit(device=True, inline=True)
        def no_launch():
            pass

        return no_wait, no_launch
    return _griddepcontrol("wait"), _griddepcontrol("launch_dependents")


def _griddepcontrol(action: str) -> Callable[..., Any]:
    from llvmlite import ir
    from numba.cuda.extending import intrinsic

    @intrinsic
    def griddepcontrol(typingctx):
        def codegen(context, builder, signature, args):
            # The memory clobber keeps the compiler from moving loads or stores across the wait.
            builder.asm(ir.FunctionType(ir.VoidType(), []), f"griddepcontrol.{action};", "~{memory}", [],
                        side_effect=True)
            return context.get_dummy_value()

        return types.void(), codegen

    return griddepcontrol
