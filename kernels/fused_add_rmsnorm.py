"""RMSNorm, optionally fused with the residual add before it: one pass over each row.

    fused_add_rmsnorm(x, residual, w):   residual <- x + residual      (rounded to the stream's dtype)
                                         x        <- rms_norm(residual) * w
                                         x (T, K, H): a MoE layer's K weighted expert outputs, summed in fp32
                                         in choice order and rounded once first (sum_choices_reference); the
                                         normed rows go to a new (T, H) tensor
    rms_norm(x, w):                      out      <- x * rsqrt(mean(x^2) + eps) * w
    norm_input(h, w):                    w * h, and sums of squares of each 16 columns (the int4 GEMMs' norm)

Statistics in fp32; the normalised row is rounded to the input dtype before the weight scales it,
the rounding of transformers' LlamaRMSNorm. fused_add_rmsnorm works in place (vLLM's
fused_add_rms_norm): the caller's x and residual are overwritten and returned.

`order` (a fragment chunk, 64 or 128; 0 for none) writes the normed row in the int4 fragment layout's K order
(kernels/int4_dequant.py: layout_column), as the wgmma GEMM after it reads x, so that it need not gather x; the
residual stays in column order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import _backend
from kernels.int4_dequant import layout_column, layout_order
from kernels.pdl import pdl, pdl_entry, pdl_launch

MAX_HIDDEN = 65536  # one row lives in one program's registers


@triton.jit
def _rmsnorm_kernel(
    # pointers
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    # sizes
    hidden,
    eps,
    # strides
    stride_x,
    stride_xk,  # CHOICES > 1: between a token's choices
    stride_r,
    stride_o,
    stride_ro,
    # meta
    CHOICES: tl.constexpr,  # x's rows per token, summed first (a MoE layer's choices); 1: x is the row
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    ORDER: tl.constexpr,  # 0, or the fragment chunk whose K order out takes
    PDL: tl.constexpr,  # launched as a programmatic dependent (kernels/pdl.py)
):
    pdl_entry(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    if CHOICES > 1:  # the choices summed in fp32, choice 0 first, rounded once
        total = tl.zeros((BLOCK,), dtype=tl.float32)
        for k in tl.static_range(CHOICES):
            total += tl.load(x_ptr + row * stride_x + k * stride_xk + cols, mask=mask, other=0.0).to(
                tl.float32
            )
        x = total.to(x_ptr.dtype.element_ty)
    else:
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if ORDER:  # out[p] is the normed column layout_column(p)
        src = layout_column(cols, ORDER)
        if not HAS_RESIDUAL:  # read x there before any store (out may be x)
            x_src = tl.load(x_ptr + row * stride_x + src, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # the add rounds as the unfused one does
        tl.store(
            residual_out_ptr + row * stride_ro + cols, x.to(residual_out_ptr.dtype.element_ty), mask=mask
        )
    x32 = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x32 * x32, axis=0) / hidden + eps)  # summed in column order, as without ORDER
    if ORDER:
        if HAS_RESIDUAL:  # x + residual at the columns out takes: the stream just written, by other threads
            tl.debug_barrier()
            x_src = tl.load(residual_out_ptr + row * stride_ro + src, mask=mask, other=0.0)
        x32 = x_src.to(tl.float32)
        w = tl.load(weight_ptr + src, mask=mask, other=0.0).to(tl.float32)
    else:
        w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    normed = (x32 * rstd).to(x.dtype).to(tl.float32)  # (BLOCK,) rounded before the scale
    tl.store(out_ptr + row * stride_o + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _norm_input_kernel(
    h_ptr, weight_ptr, x_ptr, sumsq_ptr, hidden, stride_h, stride_x,
    NB: tl.constexpr,  # blocks of 16 columns, a power of two
    PDL: tl.constexpr,
):  # fmt: skip
    pdl_entry(PDL)
    row = tl.program_id(0).to(tl.int64)
    blk = tl.arange(0, NB)[:, None]
    cols = blk * 16 + tl.arange(0, 16)[None, :]  # (NB, 16)
    mask = cols < hidden
    h = tl.load(h_ptr + row * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(x_ptr + row * stride_x + cols, (w * h).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(
        sumsq_ptr + row * (hidden // 16) + tl.arange(0, NB),
        tl.sum(h * h, axis=1),
        mask=tl.arange(0, NB) < hidden // 16,
    )


def norm_input_triton(h: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _check(h, weight, "h")
    assert h.shape[1] % 16 == 0, f"hidden {h.shape[1]} is not a multiple of 16"
    x = torch.empty_like(h, memory_format=torch.contiguous_format)
    sumsq = torch.empty(h.shape[0], h.shape[1] // 16, device=h.device, dtype=torch.float32)
    if h.shape[0]:
        nb = triton.next_power_of_2(h.shape[1] // 16)
        on = pdl(h)
        _norm_input_kernel[(h.shape[0],)](
            h, weight, x, sumsq, h.shape[1], h.stride(0), x.stride(0),
            NB=nb, PDL=on, num_warps=_num_warps(nb * 16), **pdl_launch(on),
        )  # fmt: skip
    return x, sumsq


def norm_input_reference(h: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = (weight.float() * h.float()).to(h.dtype)
    return x, h.float().square().view(h.shape[0], -1, 16).sum(-1)


def norm_input(h: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An RMSNorm's input as the int4 GEMMs take it (kernels/w4a16_mma.py: NormedInput): weight * h, each product
    rounded once to h's dtype, and (num_tokens, hidden / 16) fp32 sums of squares of each 16 of h's columns. The
    rest of the norm, 1 / sqrt(mean + eps), goes on the GEMM's sums."""
    if _backend.use_triton(h):
        return norm_input_triton(h, weight)
    return norm_input_reference(h, weight)


def _num_warps(block: int) -> int:
    return 16 if block >= 8192 else 8 if block >= 2048 else 4 if block >= 512 else 1


def _check(x: torch.Tensor, weight: torch.Tensor, name: str = "x") -> None:
    assert x.dim() == 2, f"{name} must be (num_tokens, hidden), got {tuple(x.shape)}"
    assert weight.shape == (x.shape[1],), f"weight {tuple(weight.shape)} vs hidden {x.shape[1]}"
    assert x.stride(1) == 1 and weight.stride(0) == 1, f"{name}'s hidden dim not contiguous"
    assert x.shape[1] <= MAX_HIDDEN, f"hidden {x.shape[1]} over {MAX_HIDDEN}"


def _launch(x, residual, weight, out, residual_out, eps: float, order: int) -> None:
    hidden = x.shape[-1]
    assert order in (0, 64, 128) and hidden % max(order, 1) == 0, f"order {order} for hidden {hidden}"
    if x.shape[0] == 0:
        return
    block = triton.next_power_of_2(hidden)
    has_residual = residual is not None
    choices, stride_xk = (x.shape[1], x.stride(1)) if x.dim() == 3 else (1, 0)
    assert choices == 1 or has_residual, "choices are summed into a residual"
    on = pdl(x)
    r, ro = (residual, residual_out) if has_residual else (x, out)  # unused pointers without a residual
    _rmsnorm_kernel[(x.shape[0],)](
        x, r, weight, out, ro,
        hidden, eps,
        x.stride(0), stride_xk, r.stride(0), out.stride(0), ro.stride(0),
        CHOICES=choices, HAS_RESIDUAL=has_residual, BLOCK=block, ORDER=order, PDL=on,
        num_warps=_num_warps(block), **pdl_launch(on),
    )  # fmt: skip


def rms_norm_triton(
    x: torch.Tensor,  # (num_tokens, hidden)
    weight: torch.Tensor,  # (hidden,)
    eps: float,
    out: torch.Tensor | None = None,  # (num_tokens, hidden); may be x itself
    order: int = 0,
) -> torch.Tensor:  # (num_tokens, hidden), x's dtype
    _check(x, weight)
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    assert out.shape == x.shape and out.stride(1) == 1, f"out {tuple(out.shape)} vs x {tuple(x.shape)}"
    _launch(x, None, weight, out, None, eps, order)
    return out


def fused_add_rmsnorm_triton(
    x: torch.Tensor,  # (num_tokens, hidden): the sublayer's output, overwritten with the normed row; or (num_tokens,
    # k, hidden), a MoE layer's weighted choices, summed first
    residual: torch.Tensor,  # (num_tokens, hidden): the stream; overwritten with x + residual
    weight: torch.Tensor,  # (hidden,)
    eps: float,
    order: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:  # (x, residual), both updated in place; choices: a new normed tensor
    _check(residual, weight, "residual")
    if x.dim() == 3:
        assert x.stride(2) == 1, "choices' hidden dim not contiguous"
        out = torch.empty_like(residual, memory_format=torch.contiguous_format)
    else:
        _check(x, weight)
        out = x
    assert (x.shape[0], x.shape[-1]) == residual.shape and residual.dtype == x.dtype, (
        f"x {tuple(x.shape)} {x.dtype} and residual {tuple(residual.shape)} {residual.dtype} differ"
    )
    _launch(x, residual, weight, out, residual, eps, order)
    return out, residual


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None, order: int = 0
) -> torch.Tensor:
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    normed = torch.mul(weight, x32.to(x.dtype))
    if order:
        normed = normed.index_select(1, layout_order(x.shape[1], order, x.device))
    return normed if out is None else out.copy_(normed)


def sum_choices_reference(per_choice: torch.Tensor) -> torch.Tensor:  # (T, K, H) -> (T, H)
    """A token's K weighted expert outputs summed in fp32, choice 0 first, rounded once."""
    total = per_choice[:, 0].float()
    for k in range(1, per_choice.shape[1]):
        total = total + per_choice[:, k].float()
    return total.to(per_choice.dtype)


def fused_add_rmsnorm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, order: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dim() == 3:
        x = sum_choices_reference(x)
    residual.add_(x)
    return rms_norm_reference(residual, weight, eps, out=x, order=order), residual


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, order: int = 0) -> torch.Tensor:
    if _backend.use_triton(x):
        return rms_norm_triton(x, weight, eps, order=order)
    return rms_norm_reference(x, weight, eps, order=order)


def fused_add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, order: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    if _backend.use_triton(x):
        return fused_add_rmsnorm_triton(x, residual, weight, eps, order)
    return fused_add_rmsnorm_reference(x, residual, weight, eps, order)
