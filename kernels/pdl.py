"""Programmatic dependent launch (PDL, Hopper and later): the decode step's kernels overlap their neighbours.

A kernel launched as a programmatic dependent (`launch_pdl`) may start before the kernel ahead of it in the stream
has finished: as soon as every program of that kernel has called `griddepcontrol.launch_dependents`. It must
then call `griddepcontrol.wait` before it touches anything the kernel ahead writes or reads; the wait returns
once that kernel has finished and its writes are visible (and so, in turn, everything before it). A kernel
launched after something else (a torch op, a copy) waits for nothing.

Every kernel of a decode step's chain (RMSNorm, the GEMV and the int4 GEMM, rotary with the KV write, the
split decode and its merge, SiLU-and-mul) is launched this way, and on entry lets the next kernel start, then
waits (`pdl_entry`). The next kernel's launch, and its programs' set-up, then overlap this one's run and tail;
the int4 GEMM (kernels/w4a16_mma.py) also asks for its first weights before it waits. Inside a CUDA graph the
launches become programmatic edges. `PDSERVE_PDL=0` (kernels/_backend.py) launches them all plainly.

Correctness rests on one rule: a kernel launched with PDL reads and writes nothing but constants (weights)
before its wait. A kernel can become a dependent only when every program of the kernel ahead is running, so
programs that wait never keep that kernel's own programs off the GPU.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from kernels import _backend


def pdl(t: torch.Tensor) -> bool:
    """Whether a kernel on t's device is launched as a programmatic dependent: on a GPU, unless PDSERVE_PDL=0
    (the interpreter has no such launch)."""
    return _backend.PDL and t.is_cuda


def pdl_launch(on: bool) -> dict[str, Any]:
    """The launch keyword of a programmatic dependent launch, or none."""
    return {"launch_pdl": True} if on else {}


@triton.jit
def pdl_entry(PDL: tl.constexpr):
    """A PDL kernel's first statement: the next kernel may start now, and this one waits for the one before."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
