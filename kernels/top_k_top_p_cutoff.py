"""Each row's top-k / top-p cutoff: the smallest logit the two filters keep, without sorting the row.

Top-k, then top-p over the top-k renormalized (vLLM's order): the cutoff is the largest value c of the row
with count(x >= c) >= k, then the largest c' >= c with sum(exp(x) for x >= c') >= top_p * sum(exp(x) for
x >= c). Both are searches over the 32-bit patterns of float32, which order like the values once negative
ones are flipped, so 32 halvings find the exact value (always one of the row's). One program per row;
each halving is one pass over the row, which stays in L2 (64 rows of 128k float32 are 32 MiB).

    key(x) = bits(x) ^ ((bits(x) >> 31) & 0x7FFFFFFF)        signed int32, ordered like x

The torch reference sorts the row. Both keep every token tied with the cutoff.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import _backend

BLOCK_V = 2048


@triton.jit
def _key(x):
    bits = x.to(tl.int32, bitcast=True)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)


@triton.jit
def _value(key):
    bits = key.to(tl.int32)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _count_at_least(row_ptr, vocab, key_min, BLOCK: tl.constexpr):
    count = 0
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        live = offs < vocab
        x = tl.load(row_ptr + offs, mask=live, other=float("-inf"))
        count += tl.sum((live & (_key(x) >= key_min)).to(tl.int32), axis=0)
    return count


@triton.jit
def _mass_at_least(row_ptr, vocab, key_min, top, BLOCK: tl.constexpr):
    mass = 0.0
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        live = offs < vocab
        x = tl.load(row_ptr + offs, mask=live, other=float("-inf"))
        mass += tl.sum(tl.where(live & (_key(x) >= key_min), tl.exp(x - top), 0.0), axis=0)
    return mass


@triton.jit
def _cutoff_kernel(
    # pointers
    scaled_ptr,
    top_k_ptr,
    top_p_ptr,
    skip_ptr,
    out_ptr,
    # sizes
    vocab,
    # strides
    stride_row,
    # meta
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    row_ptr = scaled_ptr + row.to(tl.int64) * stride_row
    k = tl.load(top_k_ptr + row).to(tl.int32)
    p = tl.load(top_p_ptr + row)
    cutoff = tl.full((), float("-inf"), tl.float32)
    if tl.load(skip_ptr + row) == 0:
        top = tl.full((), float("-inf"), tl.float32)
        for start in range(0, vocab, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            top = tl.maximum(top, tl.max(tl.load(row_ptr + offs, mask=offs < vocab, other=float("-inf"))))
        lo = _key(cutoff)  # invariant: lo's condition holds; the answer lies in [lo, hi]
        hi = _key(top)
        if k < vocab:
            for _ in range(32):
                mid = lo + (hi - lo + 1) // 2
                ok = _count_at_least(row_ptr, vocab, mid, BLOCK) >= k
                lo, hi = tl.where(ok, mid, lo), tl.where(ok, hi, mid - 1)
        if p < 1.0:
            target = p * _mass_at_least(row_ptr, vocab, lo, top, BLOCK)
            hi = _key(top)
            for _ in range(32):
                mid = lo + (hi - lo + 1) // 2
                ok = _mass_at_least(row_ptr, vocab, mid, top, BLOCK) >= target
                lo, hi = tl.where(ok, mid, lo), tl.where(ok, hi, mid - 1)
        cutoff = _value(lo)
    tl.store(out_ptr + row, cutoff)


def _check(scaled: torch.Tensor, *per_row: torch.Tensor) -> None:
    assert scaled.dim() == 2 and scaled.dtype == torch.float32, f"scaled {tuple(scaled.shape)} {scaled.dtype}"
    assert scaled.stride(1) == 1, "rows not contiguous"
    for t in per_row:
        assert t.numel() == scaled.shape[0] and t.device == scaled.device, "one value per row, same device"


def top_k_top_p_cutoff_triton(
    scaled: torch.Tensor,  # (rows, vocab) float32: logits / temperature
    top_k: torch.Tensor,  # (rows,) or (rows, 1) float32; >= vocab: off
    top_p: torch.Tensor,  # (rows,) or (rows, 1) float32; 1: off
    skip: torch.Tensor | None = None,  # (rows,) bool: rows whose cutoff is not needed (-inf)
) -> torch.Tensor:  # (rows, 1) float32
    if skip is None:
        skip = torch.zeros(scaled.shape[0], dtype=torch.bool, device=scaled.device)
    _check(scaled, top_k, top_p, skip)
    rows, vocab = scaled.shape
    out = torch.empty(rows, 1, dtype=torch.float32, device=scaled.device)
    if rows == 0:
        return out
    _cutoff_kernel[(rows,)](
        scaled, top_k.contiguous(), top_p.contiguous(), skip.contiguous().to(torch.int8), out,
        vocab,
        scaled.stride(0),
        BLOCK=BLOCK_V,
        num_warps=8,
    )  # fmt: skip
    return out


def _cumsum(x: torch.Tensor, block: int = 128) -> torch.Tensor:
    """Cumulative sum along the last dim in blocks: many short scans and one over the block totals run far
    faster on a GPU than one scan per long row."""
    rows, n = x.shape
    pad = -n % block
    blocks = torch.nn.functional.pad(x, (0, pad)).view(rows, -1, block).cumsum(dim=-1)  # (rows, nb, block)
    totals = blocks[..., -1]  # (rows, nb)
    offsets = totals.cumsum(dim=-1) - totals  # exclusive
    return (blocks + offsets.unsqueeze(-1)).view(rows, -1)[:, :n]


def top_k_top_p_cutoff_reference(
    scaled: torch.Tensor,  # (rows, vocab) float32
    top_k: torch.Tensor,  # (rows, 1)
    top_p: torch.Tensor,  # (rows, 1)
    skip: torch.Tensor | None = None,  # (rows,) bool
) -> torch.Tensor:  # (rows, 1)
    """One sort of the rows: keep the fewest top tokens whose probability reaches top_p."""
    _check(scaled, top_k, top_p)
    top_k, top_p = top_k.reshape(-1, 1), top_p.reshape(-1, 1)
    vocab = scaled.shape[1]
    ordered = scaled.sort(dim=-1, descending=True).values  # (rows, vocab)
    in_k = torch.arange(vocab, device=scaled.device) < top_k  # (rows, vocab)
    probs = ordered.masked_fill(~in_k, float("-inf")).softmax(dim=-1)
    before = _cumsum(probs) - probs  # mass of the tokens ranked above each one
    in_p = (before < top_p) | (top_p >= 1.0)  # the top token always stays
    num_kept = (in_k & in_p).sum(dim=-1, keepdim=True)  # (rows, 1), at least 1
    cutoff = ordered.gather(1, num_kept - 1)
    off = (top_k >= vocab) & (top_p >= 1.0)
    if skip is not None:
        off |= skip.reshape(-1, 1)
    return cutoff.masked_fill(off, float("-inf"))


def top_k_top_p_cutoff(
    scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, skip: torch.Tensor | None = None
) -> torch.Tensor:
    if _backend.use_triton(scaled):
        return top_k_top_p_cutoff_triton(scaled, top_k, top_p, skip)
    return top_k_top_p_cutoff_reference(scaled, top_k, top_p, skip)
