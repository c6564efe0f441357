"""Int8 weights with one fp16 scale per group of input features (GGUF Q8_0: groups of 32), dequantized to a
dense weight for the dense GEMM:

    qweight (N, K) int8, scales (N, K/G) fp16:   w[n, k] = q[n, k] * s[n, k // G]

Q8_0 layers run as this dequantization plus F.linear: the weight takes half the memory of bf16, the
GEMM the dense one's time plus one pass over the int8 bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import _backend


@dataclass(frozen=True)
class Int8Weight:
    qweight: torch.Tensor  # (N, K) int8
    scales: torch.Tensor  # (N, K/G) fp16
    group_size: int

    def __post_init__(self) -> None:
        n, k = self.qweight.shape
        if self.qweight.dtype != torch.int8 or self.scales.dtype != torch.float16:
            raise ValueError(
                f"qweight must be int8 and scales fp16, got {self.qweight.dtype}, {self.scales.dtype}"
            )
        if (
            self.group_size <= 0
            or k % self.group_size
            or tuple(self.scales.shape) != (n, k // self.group_size)
        ):
            raise ValueError(
                f"scales {tuple(self.scales.shape)} do not fit qweight {(n, k)} in groups of {self.group_size}"
            )


@triton.jit
def _int8_dequant_kernel(
    # pointers
    q_ptr,
    s_ptr,
    out_ptr,
    # sizes
    N,
    K,
    # meta
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows < N)[:, None] & (cols < K)[None, :]
    q = tl.load(q_ptr + rows[:, None] * K + cols[None, :], mask=mask, other=0).to(tl.float32)
    s = tl.load(s_ptr + rows[:, None] * (K // GROUP) + (cols // GROUP)[None, :], mask=mask, other=0.0)
    tl.store(
        out_ptr + rows[:, None] * K + cols[None, :],
        (q * s.to(tl.float32)).to(out_ptr.dtype.element_ty),
        mask=mask,
    )


def int8_dequant_triton(w: Int8Weight, dtype: torch.dtype) -> torch.Tensor:  # (N, K)
    n, k = w.qweight.shape
    assert w.qweight.is_contiguous() and w.scales.is_contiguous(), "int8 weight and scales must be contiguous"
    out = torch.empty(n, k, dtype=dtype, device=w.qweight.device)
    block_n, block_k = 16, 256
    _int8_dequant_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        w.qweight, w.scales, out, n, k, GROUP=w.group_size, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4
    )
    return out


def int8_dequant_reference(w: Int8Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:  # (N, K)
    scales = w.scales.float().repeat_interleave(w.group_size, dim=1)
    return (w.qweight.float() * scales).to(dtype)  # exact in fp32: GGUF's own dequantization


def int8_dequant(w: Int8Weight, dtype: torch.dtype) -> torch.Tensor:
    if _backend.use_triton(w.qweight):
        return int8_dequant_triton(w, dtype)
    return int8_dequant_reference(w, dtype)
