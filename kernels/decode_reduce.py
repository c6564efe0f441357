"""Merge split-KV (flash-decoding) partial attention states into the final decode output.

The split decode kernel leaves, per (sequence, query head, split), the unnormalised output of
its key range, the running max of its scores (log2 units, already scaled) and the sum of their
exp2. One flat fp32 workspace holds them, acc first so its rows stay 16-byte aligned:

    workspace = | acc (num_seqs, num_heads, num_splits, head_dim) | m (...splits) | l (...splits) |
                                                                   <--- ml[0] ---> <--- ml[1] --->

A buffer shared by calls of different shapes must be sized by decode_workspace_size(largest
num_seqs, num_heads, largest num_splits, head_dim).

Split s of a sequence covers keys [s * partition_size, (s + 1) * partition_size); splits that
start at or past the sequence's length were never written and are not read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_entry, pdl_launch


def carve_workspace(
    workspace: torch.Tensor, num_seqs: int, num_heads: int, num_splits: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a flat fp32 workspace: acc (num_seqs, num_heads, num_splits, head_dim) and
    ml (2, num_seqs, num_heads, num_splits)."""
    n = num_seqs * num_heads * num_splits
    assert workspace.dtype == torch.float32 and workspace.numel() >= n * (head_dim + 2), "workspace too small"
    acc = workspace[: n * head_dim].view(num_seqs, num_heads, num_splits, head_dim)
    return acc, workspace[n * head_dim : n * (head_dim + 2)].view(2, num_seqs, num_heads, num_splits)


def decode_workspace_size(num_seqs: int, num_heads: int, num_splits: int, head_dim: int) -> int:
    """fp32 elements a split decode call needs for its partial states."""
    return num_seqs * num_heads * num_splits * (head_dim + 2)


@triton.jit(
    do_not_specialize=["stride_a_seq", "stride_a_head", "stride_ml_kind", "stride_ml_seq", "stride_ml_head"]
)
def _decode_reduce_kernel(
    # pointers
    out_ptr,
    acc_ptr,
    ml_ptr,
    seq_lens_ptr,
    # sizes
    partition_size,
    # strides
    stride_o_seq,
    stride_o_head,
    stride_a_seq,
    stride_a_head,
    stride_a_split,
    stride_ml_kind,
    stride_ml_seq,
    stride_ml_head,
    # meta
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PDL: tl.constexpr,  # launched as a programmatic dependent (kernels/pdl.py)
):
    pdl_entry(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    num_valid = tl.cdiv(seq_len, partition_size)
    dims = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)  # this program's slice of head_dim
    acc_base = acc_ptr + seq.to(tl.int64) * stride_a_seq + head * stride_a_head
    m_base = ml_ptr + seq.to(tl.int64) * stride_ml_seq + head * stride_ml_head
    m_run = tl.full((), float("-inf"), tl.float32)
    l_run = tl.zeros((), tl.float32)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for s0 in range(0, num_valid, BLOCK_S):
        splits = s0 + tl.arange(0, BLOCK_S)
        valid = splits < num_valid
        m = tl.load(m_base + splits, mask=valid, other=float("-inf"))  # (BLOCK_S,)
        l_part = tl.load(m_base + stride_ml_kind + splits, mask=valid, other=0.0)
        rows = acc_base + splits[:, None] * stride_a_split + dims[None, :]
        part = tl.load(
            rows, mask=valid[:, None] & (dims[None, :] < HEAD_DIM), other=0.0
        )  # (BLOCK_S, BLOCK_D)
        m_new = tl.maximum(m_run, tl.max(m, axis=0))
        alpha = tl.exp2(m_run - m_new)
        w = tl.exp2(m - m_new)  # (BLOCK_S,), 0 for unused splits
        l_run = l_run * alpha + tl.sum(w * l_part, axis=0)
        acc = acc * alpha + tl.sum(w[:, None] * part, axis=0)
        m_run = m_new
    l_run = tl.where(l_run == 0.0, 1.0, l_run)  # a sequence of length 0 gets zeros, not NaN
    out = out_ptr + seq.to(tl.int64) * stride_o_seq + head * stride_o_head + dims
    tl.store(out, (acc / l_run).to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def decode_reduce_triton(
    out: torch.Tensor,  # (num_seqs, num_heads, head_dim), written
    acc: torch.Tensor,  # (num_seqs, num_heads, num_splits, head_dim) fp32
    ml: torch.Tensor,  # (2, num_seqs, num_heads, num_splits) fp32: running max, sum of exp2
    seq_lens: torch.Tensor,  # (num_seqs,) int32
    partition_size: int,
    pdl: bool = False,  # launched as a programmatic dependent (kernels/pdl.py)
    num_warps: int = 4,
    block_d: int | None = None,  # head_dim elements per program (a power of 2); None: all of them
) -> torch.Tensor:
    num_seqs, num_heads, head_dim = out.shape
    num_splits = acc.shape[2]
    assert acc.dtype == torch.float32 and acc.shape == (num_seqs, num_heads, num_splits, head_dim)
    assert ml.dtype == torch.float32 and ml.shape == (2, num_seqs, num_heads, num_splits)
    assert acc.stride(3) == 1 and ml.stride(3) == 1 and out.stride(2) == 1
    if num_seqs == 0:
        return out
    block_d = min(block_d or head_dim, triton.next_power_of_2(head_dim))
    assert block_d & (block_d - 1) == 0, f"block_d must be a power of 2, got {block_d}"
    _decode_reduce_kernel[(num_seqs, num_heads, triton.cdiv(head_dim, block_d))](
        out, acc, ml, seq_lens,
        partition_size,
        out.stride(0), out.stride(1), acc.stride(0), acc.stride(1), acc.stride(2),
        ml.stride(0), ml.stride(1), ml.stride(2),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_S=16 if num_splits <= 16 else 64,  # two variants whatever the split count; one round trip
        PDL=pdl,
        num_warps=num_warps,
        **pdl_launch(pdl),
    )  # fmt: skip
    return out


def decode_reduce_reference(
    acc: torch.Tensor,  # (num_seqs, num_heads, num_splits, head_dim) fp32
    ml: torch.Tensor,  # (2, num_seqs, num_heads, num_splits) fp32
    seq_lens: torch.Tensor,  # (num_seqs,) int32
    partition_size: int,
    dtype: torch.dtype,
) -> torch.Tensor:  # (num_seqs, num_heads, head_dim)
    num_seqs, num_heads, _, head_dim = acc.shape
    out = torch.zeros(num_seqs, num_heads, head_dim, dtype=dtype, device=acc.device)
    for i, seq_len in enumerate(seq_lens.tolist()):
        n = -(-seq_len // partition_size)
        if n == 0:
            continue
        m, l_sum = ml[0, i, :, :n], ml[1, i, :, :n]  # (num_heads, n)
        w = torch.exp2(m - m.max(dim=1, keepdim=True).values)
        out[i] = ((w[..., None] * acc[i, :, :n]).sum(1) / (w * l_sum).sum(1)[:, None]).to(dtype)
    return out
