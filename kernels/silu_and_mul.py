"""SwiGLU's activation: (gate | up) -> silu(gate) * up, one read of each half, one write.

silu(gate) is rounded to the input dtype before the product, the rounding of the unfused
F.silu(gate) * up. `order` (a fragment chunk, 64 or 128; 0 for none) writes the output in the int4 fragment
layout's K order (kernels/int4_dequant.py: layout_column), as the wgmma GEMM after it reads x.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import _backend
from kernels.int4_dequant import layout_column, layout_order
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
    ORDER: tl.constexpr,  # 0, or the fragment chunk whose K order out takes
    PDL: tl.constexpr,  # launched as a programmatic dependent (kernels/pdl.py)
):
    pdl_entry(PDL)
    row = tl.program_id(0).to(tl.int64)
    pos = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # where each value is written
    mask = pos < d
    cols = layout_column(pos, ORDER) if ORDER else pos
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + pos, silu_mul(gate, up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(
    x: torch.Tensor,  # (num_tokens, 2 * d): gate | up
    out: torch.Tensor | None = None,  # (num_tokens, d)
    order: int = 0,
) -> torch.Tensor:  # (num_tokens, d)
    assert x.dim() == 2 and x.shape[1] % 2 == 0, f"x must be (num_tokens, 2 * d), got {tuple(x.shape)}"
    assert order in (0, 64, 128) and x.shape[1] // 2 % max(order, 1) == 0, (
        f"order {order} for {tuple(x.shape)}"
    )
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
        x, out, d, x.stride(0), out.stride(0), BLOCK_D=block, ORDER=order, PDL=on,
        num_warps=4 if block >= 512 else 1, **pdl_launch(on),
    )  # fmt: skip
    return out


def silu_and_mul_reference(x: torch.Tensor, order: int = 0) -> torch.Tensor:  # (n, 2 * d) -> (n, d)
    gate, up = x.chunk(2, dim=-1)
    out = F.silu(gate) * up
    return out.index_select(1, layout_order(out.shape[1], order, x.device)) if order else out


def silu_and_mul(x: torch.Tensor, order: int = 0) -> torch.Tensor:
    if _backend.use_triton(x):
        return silu_and_mul_triton(x, order=order)
    return silu_and_mul_reference(x, order)
