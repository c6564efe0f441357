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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import _backend
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
