"""A linear layer for one row: y = x W^T (+ b) with x (1, K), as the batch-1 decode step runs it.

At one row a linear layer is a pass over its weight, and the whole step is a pass over the model's
weights: this kernel reads each weight row once, in wide loads it does not keep in cache, and reduces
each output in one program, so there is no split-K partial sum to write and add up afterwards (the
reduce kernel cuBLAS adds on some shapes). Programs own BLOCK_N output rows; many small programs keep
enough loads in flight to stream the weight at memory speed, and tiny layers finish in one wave.

    W (N, K), row-major               program p: rows [p * BLOCK_N, (p + 1) * BLOCK_N)
    +-------------------------+       each walks K in BLOCK_K steps, accumulating
    | rows of program 0       |       (BLOCK_N, BLOCK_K) fp32 products, and sums
    | rows of program 1       |       them once at the end
    | ...                     |
    +-------------------------+

Only the row count 1 takes this path, and only for half-precision weights (`dense_linear`); everything
else is `F.linear`.

gate_up's matmul can end in SwiGLU's activation (`dense_swiglu`): W is (gate | up), each program reads the
gate rows and the up rows of its BLOCK_N outputs and writes silu(gate) * up, rounded as the two unfused
kernels round (kernels/silu_and_mul.py), so a batch-1 MLP is two kernels, not three.

A MoE layer's router can begin with the residual add and the RMSNorm before it (`add_norm_gemv`): every program
adds the sublayer's output to the stream and norms the whole row in its registers, rounded as
fused_add_rmsnorm rounds, then multiplies its router rows by it; program 0 also writes the new stream and the
normed row, which the experts take. One launch where the norm and the router took two.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import _backend
from kernels.fused_add_rmsnorm import fused_add_rmsnorm
from kernels.pdl import pdl, pdl_entry, pdl_launch
from kernels.silu_and_mul import silu_and_mul, silu_mul


@triton.jit
def _gemv_kernel(
    # pointers
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    # sizes
    N,
    K,
    # strides
    stride_w,
    # meta
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SWIGLU: tl.constexpr,  # W is (gate | up), N rows each: y = silu(gate) * up
    PDL: tl.constexpr,  # launched as a programmatic dependent (kernels/pdl.py)
):
    pdl_entry(PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    live = rows < N
    rows = tl.where(live, rows, 0)  # a tail program re-reads row 0 rather than masking every load
    cols = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_w + cols[None, :]  # (BLOCK_N, BLOCK_K)
    up_ptrs = w_ptr + (rows + N).to(tl.int64)[:, None] * stride_w + cols[None, :]  # SWIGLU: their up rows
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        in_k = k + cols < K
        if EVEN_K:
            w = tl.load(w_ptrs, eviction_policy="evict_first")
            x = tl.load(x_ptr + k + cols, eviction_policy="evict_last")
        else:
            w = tl.load(w_ptrs, mask=in_k[None, :], other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptr + k + cols, mask=in_k, other=0.0, eviction_policy="evict_last")
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        if SWIGLU:
            if EVEN_K:
                w_up = tl.load(up_ptrs, eviction_policy="evict_first")
            else:
                w_up = tl.load(up_ptrs, mask=in_k[None, :], other=0.0, eviction_policy="evict_first")
            acc_up += w_up.to(tl.float32) * x.to(tl.float32)[None, :]
            up_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    y = tl.sum(acc, axis=1)  # (BLOCK_N,)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows).to(tl.float32)
    if SWIGLU:  # gate and up rounded as the unfused GEMV writes them
        up = tl.sum(acc_up, axis=1)
        if HAS_BIAS:
            up += tl.load(b_ptr + N + rows).to(tl.float32)
        y = silu_mul(y.to(y_ptr.dtype.element_ty), up.to(y_ptr.dtype.element_ty))
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=live)


@triton.jit
def _add_norm_gemv_kernel(
    h_ptr,  # (1, K): the sublayer's output
    res_ptr,  # (1, K): the stream before it
    nw_ptr,  # (K,): the norm's weight
    w_ptr,  # (N, K): the router
    y_ptr,  # (1, N)
    x_out_ptr,  # (1, K): the normed row
    res_out_ptr,  # (1, K): the stream after the add
    N,
    K,
    eps,
    stride_w,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # the whole row
    PDL: tl.constexpr,
):
    pdl_entry(PDL)
    cols = tl.arange(0, BLOCK_K)
    in_k = cols < K
    h = tl.load(h_ptr + cols, mask=in_k, other=0.0)
    r = tl.load(res_ptr + cols, mask=in_k, other=0.0)
    s = (h.to(tl.float32) + r.to(tl.float32)).to(h.dtype)  # the add rounds as the unfused one does
    s32 = s.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(s32 * s32, axis=0) / K + eps)
    nw = tl.load(nw_ptr + cols, mask=in_k, other=0.0).to(tl.float32)
    x = ((s32 * rstd).to(h.dtype).to(tl.float32) * nw).to(h.dtype)  # rounded before the weight, then after
    if tl.program_id(0) == 0:
        tl.store(res_out_ptr + cols, s, mask=in_k)
        tl.store(x_out_ptr + cols, x, mask=in_k)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    live = rows < N
    rows = tl.where(live, rows, 0)
    w = tl.load(
        w_ptr + rows.to(tl.int64)[:, None] * stride_w + cols[None, :], mask=in_k[None, :], other=0.0,
        eviction_policy="evict_first",
    )  # fmt: skip
    y = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=live)


# (N, K) -> (BLOCK_N, BLOCK_K, num_warps), the fastest tiles of a sweep on the H200 (bench.decode_ops --sweep)
# at the layer shapes of Llama-3-8B and SmolLM2; None: cuBLAS is faster there
TUNED: dict[tuple[int, int], tuple[int, int, int] | None] = {
    (6144, 4096): (4, 1024, 4),
    (4096, 4096): (4, 512, 4),
    (28672, 4096): (1, 1024, 4),
    (4096, 14336): (1, 512, 4),
    (128256, 4096): (4, 1024, 4),
    (960, 576): (2, 1024, 4),
    (576, 576): (2, 1024, 4),
    (3072, 576): (4, 1024, 4),
    (576, 1536): (1, 1024, 8),
    (49152, 576): None,
}


def gemv_config(n: int, k: int) -> tuple[int, int, int] | None:
    """(BLOCK_N, BLOCK_K, num_warps) for an (n, k) weight, None where cuBLAS wins: a measured tile, else
    whole 1024-wide (512 on a very long K) rows of K and rows per program few enough for several waves."""
    if (n, k) in TUNED:
        return TUNED[n, k]
    block_k = min(1024 if k <= 4096 else 512, triton.next_power_of_2(k))
    return (4 if n >= 4096 else 2), block_k, 4


def swiglu_config(n: int, k: int) -> tuple[int, int, int]:
    """The fused gate_up + SwiGLU tile for n outputs: gate_up's own (2n rows), half its rows per half."""
    block_n, block_k, num_warps = gemv_config(2 * n, k) or (4, 512, 4)
    return max(1, block_n // 2), block_k, num_warps


def gemv_triton(
    x: torch.Tensor,  # (1, K)
    weight: torch.Tensor,  # (N, K), rows contiguous; (2 * N, K) = (gate | up) with swiglu
    bias: torch.Tensor | None = None,  # (N,); (2 * N,) with swiglu
    config: tuple[int, int, int] | None = None,
    swiglu: bool = False,
) -> torch.Tensor:  # (1, N): x W^T, or silu(gate) * up of it
    assert x.dim() == 2 and x.shape[0] == 1, f"x must be one row (1, K), got {tuple(x.shape)}"
    rows, k = weight.shape
    assert x.shape[1] == k, f"x has {x.shape[1]} features, the weight {k}"
    assert weight.stride(1) == 1 and x.stride(1) == 1, "weight rows and x must be contiguous"
    assert bias is None or bias.shape == (rows,), f"bias must be ({rows},)"
    assert not swiglu or rows % 2 == 0, f"swiglu takes (gate | up) rows, got {rows}"
    n = rows // 2 if swiglu else rows
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    if config is None:
        config = swiglu_config(n, k) if swiglu else gemv_config(n, k) or (4, 512, 4)
    block_n, block_k, num_warps = config
    on = pdl(x)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, y,
        n, k,
        weight.stride(0),
        HAS_BIAS=bias is not None, EVEN_K=k % block_k == 0, BLOCK_N=block_n, BLOCK_K=block_k, SWIGLU=swiglu,
        PDL=on, num_warps=num_warps, **pdl_launch(on),
    )  # fmt: skip
    return y


def gemv_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 accumulation, rounded once to x's dtype, as the kernel does."""
    y = x.float() @ weight.float().T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def _takes_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """One half-precision row on the Triton path, at a shape where the kernel beats cuBLAS."""
    return (
        x.dim() == 2
        and x.shape[0] == 1
        and weight.dtype in (torch.bfloat16, torch.float16)
        and weight.stride(1) == 1
        and x.stride(1) == 1
        and _backend.use_triton(x)
        and gemv_config(*weight.shape) is not None
    )


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, with one half-precision row on the Triton path taking the GEMV kernel."""
    if _takes_gemv(x, weight):
        return gemv_triton(x, weight, bias)
    return F.linear(x, weight, bias)


def dense_swiglu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up of x (gate | up)^T: one kernel where dense_linear takes the GEMV, else the two ops."""
    if _takes_gemv(x, weight):
        return gemv_triton(x, weight, bias, swiglu=True)
    return silu_and_mul(F.linear(x, weight, bias))


ADD_NORM_MAX_K = 8192  # add_norm_gemv holds a whole row in each program's registers


def takes_add_norm_gemv(h: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether add_norm_gemv runs as one kernel: one half-precision row on the Triton path, a row of at most
    ADD_NORM_MAX_K features."""
    return (
        h.dim() == 2 and h.shape[0] == 1 and h.shape[1] <= ADD_NORM_MAX_K and h.stride(1) == 1
        and weight.dtype == h.dtype and h.dtype in (torch.bfloat16, torch.float16) and weight.stride(1) == 1
        and _backend.use_triton(h)
    )  # fmt: skip


def add_norm_gemv(
    h: torch.Tensor,  # (1, K): the sublayer's output
    residual: torch.Tensor,  # (1, K): the stream before it
    norm_weight: torch.Tensor,  # (K,)
    eps: float,
    weight: torch.Tensor,  # (N, K): a router's, no bias
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, stream, y): stream = h + residual, x = rms_norm(stream) * norm_weight and y = x W^T, each rounded as
    fused_add_rmsnorm and the GEMV round them; one kernel where takes_add_norm_gemv(h, weight). New tensors:
    h and residual are left as they are."""
    k = h.shape[1]
    assert residual.shape == h.shape and norm_weight.shape == (k,) and weight.shape[1] == k, (
        f"h {tuple(h.shape)}, residual {tuple(residual.shape)}, norm weight {tuple(norm_weight.shape)}, "
        f"weight {tuple(weight.shape)}"
    )
    if not takes_add_norm_gemv(h, weight):
        return add_norm_gemv_reference(h, residual, norm_weight, eps, weight)
    n = weight.shape[0]
    x, stream = torch.empty_like(h), torch.empty_like(h)
    y = torch.empty(1, n, dtype=h.dtype, device=h.device)
    block_k = triton.next_power_of_2(k)
    block_n = max(1, min(4, 4096 // block_k))  # a program's rows x the row: at most 4096 weights in registers
    on = pdl(h)
    _add_norm_gemv_kernel[(triton.cdiv(n, block_n),)](
        h, residual.contiguous(), norm_weight, weight, y, x, stream, n, k, eps, weight.stride(0),
        BLOCK_N=block_n, BLOCK_K=block_k, PDL=on, num_warps=16 if block_k >= 8192 else 8 if block_k >= 2048 else 4,
        **pdl_launch(on),
    )  # fmt: skip
    return x, stream, y


def add_norm_gemv_reference(
    h: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The unfused ops: the residual add and RMSNorm (kernels/fused_add_rmsnorm.py), then x W^T, on copies."""
    x, stream = fused_add_rmsnorm(h.clone(), residual.clone(), norm_weight, eps)
    return x, stream, dense_linear(x, weight)
