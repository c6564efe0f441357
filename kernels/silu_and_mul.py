"""SwiGLU's activation: (gate | up) -> silu(gate) * up, one read of each half, one write.

silu(gate) is rounded to the input dtype before the product, the rounding of the unfused
F.silu(gate) * up.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import _backend
from kernels.pdl import pdl, pdl_entry, pdl_launch

BLOCK = 1024  # output columns per program


@triton.jit
def silu_mul(gate, up):
    """silu(gate) * up in fp32, silu rounded to gate's dtype first (the unfused ops' rounding). Shared with the
    GEMV kernels that fuse the activation into gate_up's matmul (kernels/gemv.py, kernels/w4a16_gemm.py)."""
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    return act * up.to(tl.float32)


@triton.jit
def _silu_and_mul_kernel(
    # pointers
    x_ptr,
    out_ptr,
    # sizes
    d,
    # strides
    stride_x,
    stride_o,
    # meta
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,  # launched as a programmatic dependent (kernels/pdl.py)
):
    pdl_entry(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, silu_mul(gate, up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(
    x: torch.Tensor,  # (num_tokens, 2 * d): gate | up
    out: torch.Tensor | None = None,  # (num_tokens, d)
) -> torch.Tensor:  # (num_tokens, d)
    assert x.dim() == 2 and x.shape[1] % 2 == 0, f"x must be (num_tokens, 2 * d), got {tuple(x.shape)}"
    assert x.stride(1) == 1, "x's last dim not contiguous"
    num_tokens, d = x.shape[0], x.shape[1] // 2
    if out is None:
        out = torch.empty(num_tokens, d, dtype=x.dtype, device=x.device)
    assert out.shape == (num_tokens, d) and out.stride(1) == 1, f"out {tuple(out.shape)} for x {x.shape}"
    if num_tokens == 0:
        return out
    block = min(BLOCK, triton.next_power_of_2(d))
    on = pdl(x)
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(d, block))](
        x, out, d, x.stride(0), out.stride(0), BLOCK_D=block, PDL=on,
        num_warps=4 if block >= 512 else 1, **pdl_launch(on),
    )  # fmt: skip
    return out


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:  # (n, 2 * d) -> (n, d)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if _backend.use_triton(x):
        return silu_and_mul_triton(x)
    return silu_and_mul_reference(x)
