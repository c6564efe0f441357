"""Int4 weights in the kernels' layout, and their dequantization to a dense weight.

AWQ, GPTQ and GGUF Q4_0 / Q4_1 checkpoints are re-laid at load time (engine/layers/quant/) into one
layout that the W4A16 GEMM (kernels/w4a16_gemm.py) and this dequantizer read:

    qweight (K/8, N) int32   packed along K: bits 4j..4j+3 of qweight[r, n] hold q[8r + j, n], 0..15;
                             any strides: loaded layers hold it K-contiguous, stride (1, K/8), which
                             the small-batch GEMM reads fastest
    scales  (K/G, N) fp16    one scale per group of G input rows and output column
    zeros   (K/G, N) uint8   integer zero points:   w[k, n] = (q[k, n] - z[g, n]) * s[g, n]   (AWQ, GPTQ, Q4_0)
            (K/G, N) fp16    or float offsets:      w[k, n] = q[k, n] * s[g, n] + m[g, n]     (GGUF Q4_1)
    perm    (K,) int32       optional: row r of the layout is input feature perm[r] (GPTQ act order;
                             the rows are sorted so that every group is G consecutive rows)

with g = r // G. Products are exact in fp32 (a 4-bit integer times an fp16 scale), so the dense weight in
fp32 is bit for bit the one each format's own reference dequantization gives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import _backend

PACK = 8  # int4 values per int32


@dataclass(frozen=True)
class Int4Weight:
    qweight: torch.Tensor  # (K/8, N) int32
    scales: torch.Tensor  # (K/G, N) fp16
    zeros: torch.Tensor  # (K/G, N) uint8 zero points, or fp16 offsets
    group_size: int
    perm: torch.Tensor | None = None  # (K,) int32

    def __post_init__(self) -> None:
        k8, n = self.qweight.shape
        k = k8 * PACK
        if self.qweight.dtype != torch.int32:
            raise ValueError(f"qweight must be int32, got {self.qweight.dtype}")
        if self.group_size <= 0 or self.group_size % PACK or k % self.group_size:
            raise ValueError(f"group size {self.group_size} must be a multiple of 8 dividing K={k}")
        groups = (k // self.group_size, n)
        if tuple(self.scales.shape) != groups or tuple(self.zeros.shape) != groups:
            raise ValueError(
                f"scales {tuple(self.scales.shape)} and zeros {tuple(self.zeros.shape)} must be {groups} "
                f"for qweight {tuple(self.qweight.shape)} in groups of {self.group_size}"
            )
        if self.zeros.dtype not in (torch.uint8, torch.float16) or self.scales.dtype != torch.float16:
            raise ValueError(
                f"scales must be fp16 and zeros uint8 or fp16, got {self.scales.dtype}, {self.zeros.dtype}"
            )
        if self.perm is not None and tuple(self.perm.shape) != (k,):
            raise ValueError(f"perm must be ({k},), got {tuple(self.perm.shape)}")

    @property
    def in_features(self) -> int:
        return self.qweight.shape[0] * PACK

    @property
    def out_features(self) -> int:
        return self.qweight.shape[1]

    @property
    def zero_is_offset(self) -> bool:
        return self.zeros.dtype == torch.float16


@triton.jit
def int4_values(packed, j: tl.constexpr):
    """Nibble j of every int32 as fp32 (0..15): the exponent trick (2^23 + q, minus 2^23), no int->float
    conversion instruction."""
    q = (packed >> (4 * j)) & 0xF
    return (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _int4_dequant_kernel(
    # pointers
    qw_ptr,
    s_ptr,
    z_ptr,
    perm_ptr,
    out_ptr,
    # sizes
    N,
    K,
    # strides
    stride_o,
    stride_qk,
    stride_qn,
    # meta
    GROUP: tl.constexpr,
    ZERO_IS_OFFSET: tl.constexpr,
    HAS_PERM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # (BLOCK_R,) packed rows
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < K // 8)[:, None] & (cols < N)[None, :]
    # (BLOCK_R, BLOCK_N)
    packed = tl.load(qw_ptr + rows[:, None] * stride_qk + cols[None, :] * stride_qn, mask=mask, other=0)
    groups = (rows * 8) // GROUP
    s = tl.load(s_ptr + groups[:, None] * N + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + groups[:, None] * N + cols[None, :], mask=mask, other=0).to(tl.float32)
    for j in tl.static_range(8):
        q = int4_values(packed, j)
        if ZERO_IS_OFFSET:
            w = q * s + z
        else:
            w = q * s - z * s
        k = rows * 8 + j
        if HAS_PERM:
            k = tl.load(perm_ptr + k, mask=rows < K // 8, other=0)
        tl.store(out_ptr + k[:, None] * stride_o + cols[None, :], w.to(out_ptr.dtype.element_ty), mask=mask)


def int4_dequant_triton(w: Int4Weight, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """The dense (K, N) weight in the checkpoint's input order (perm undone)."""
    k, n = w.in_features, w.out_features
    if out is None:
        out = torch.empty(k, n, dtype=dtype, device=w.qweight.device)
    assert out.shape == (k, n) and out.stride(1) == 1, f"out {tuple(out.shape)} for a ({k}, {n}) weight"
    block_r, block_n = 16, 128
    grid = (triton.cdiv(k // 8, block_r), triton.cdiv(n, block_n))
    perm = w.perm if w.perm is not None else w.qweight
    _int4_dequant_kernel[grid](
        w.qweight, w.scales, w.zeros, perm, out,
        n, k,
        out.stride(0), w.qweight.stride(0), w.qweight.stride(1),
        GROUP=w.group_size, ZERO_IS_OFFSET=w.zero_is_offset, HAS_PERM=w.perm is not None,
        BLOCK_R=block_r, BLOCK_N=block_n, num_warps=4,
    )  # fmt: skip
    return out


def unpack_rows(qweight: torch.Tensor) -> torch.Tensor:  # (K/8, N) int32 -> (K, N) uint8
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qweight.device)
    q = (qweight.unsqueeze(1) >> shifts[None, :, None]) & 0xF  # (K/8, 8, N)
    return q.reshape(-1, qweight.shape[1]).to(torch.uint8)


def int4_dequant_reference(w: Int4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(N, K) contiguous, in the checkpoint's input order: the layout a dense layer's weight has, so that
    F.linear over it computes what the dense model computes."""
    k, n, g = w.in_features, w.out_features, w.group_size
    words = w.qweight.t().contiguous().view(torch.uint8)  # (N, K/2): byte b of a word = rows 2b, 2b + 1
    q = torch.empty(n, k // 2, 2, dtype=torch.uint8, device=words.device)
    torch.bitwise_and(words, 0xF, out=q[..., 0])
    torch.bitwise_right_shift(words, 4, out=q[..., 1])
    dense = q.view(n, k // g, g).float()  # (N, K/G, G)
    s = w.scales.t().float().unsqueeze(2)  # (N, K/G, 1)
    if w.zero_is_offset:
        dense.mul_(s).add_(w.zeros.t().float().unsqueeze(2))
    else:
        dense.mul_(s).sub_(w.zeros.t().float().unsqueeze(2) * s)  # exact products in fp32
    dense = dense.view(n, k)
    if w.perm is not None:
        dense = torch.empty_like(dense).index_copy_(1, w.perm.long(), dense)
    return dense.to(dtype)


def int4_dequant(w: Int4Weight, dtype: torch.dtype) -> torch.Tensor:
    """The dense weight (N, K), as a dense layer holds it: contiguous from the reference, a transposed view
    of the kernel's (K, N) output on the Triton path (F.linear takes either)."""
    if _backend.use_triton(w.qweight):
        return int4_dequant_triton(w, dtype).t()
    return int4_dequant_reference(w, dtype)
