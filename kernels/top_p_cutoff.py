"""Top-k, then top-p over the top-k renormalized (vLLM's order), as one cutoff value per row, without
sorting the vocabulary.

The cutoff is the smallest logit the two filters keep. Sorting each row finds it in one pass of a
segmented sort, which at 128k logits a row costs more than the rest of a batched decode step's
sampling together. The kernel instead finds it by searching on the logits' values: one program per row
makes passes over its row, each narrowing an interval of candidate values 8-fold by counting (top-k) or
summing probability mass (top-p) above 7 candidates at once. Values are searched as int32 keys that order
like the floats, so eleven passes pin down one exact value of the row; each lane sums its own elements
through a pass and the lanes are added once at its end.

With m the row's largest logit, kth its top_k-th largest, c the count of logits above kth, and
S(v) = sum of exp(x - m) over the logits x > v:

    Z      = S(kth) + (top_k - c) * exp(kth - m)       the mass of the top_k logits (ties at kth cut)
    cutoff = the smallest logit v >= kth with S(v) < top_p * Z

which is the value at the last rank the sort-based form keeps (`top_k_top_p_cutoff_reference`): a rank is
kept when the mass ranked above it is under top_p, and the mass above the first of a run of equal logits
is S of their value. Sums run in another order than the reference's, so a row whose mass lands within
rounding of top_p can keep one token more or fewer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import _backend

WAYS = 8  # candidates per pass, the interval's start among them: each pass narrows the interval 8-fold
ROUNDS = 11  # 8**11 > 2**32: enough passes to pin one int32 key
BLOCK = 1024


@triton.jit
def _key(x):
    """float32 -> int32 that orders as the floats do."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _value(key):
    """The float whose key `key` is (int32 scalars or tensors between the keys of -inf and inf)."""
    bits = tl.where(key >= 0, key, key ^ 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _candidates(lo, hi, WAYS: tl.constexpr):
    """WAYS keys from lo, evenly spaced over [lo, hi) (int64 scalars), as int64 and as their floats."""
    step = (hi - lo + WAYS - 1) // WAYS
    cand = lo + tl.arange(0, WAYS).to(tl.int64) * step  # (WAYS,)
    clipped = tl.minimum(tl.maximum(cand, -2147483648), 2147483647).to(tl.int32)
    return cand, _value(clipped)


@triton.jit
def _narrow(lo, hi, cand, ok):
    """The interval after a pass: lo the largest qualifying candidate, hi the smallest failing one."""
    ok = ok & (cand < hi)
    lo = tl.max(tl.where(ok, cand, lo), 0)
    hi = tl.min(tl.where(ok | (cand <= lo), hi, cand), 0)
    return lo, hi


@triton.jit
def _row_extremes(row_ptr, vocab, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    hi = tl.full((BLOCK,), float("-inf"), tl.float32)
    lo = tl.full((BLOCK,), float("inf"), tl.float32)
    for start in range(0, vocab, BLOCK):
        live = start + offs < vocab
        x = tl.load(row_ptr + start + offs, mask=live, other=float("-inf"))
        hi = tl.maximum(hi, x)
        lo = tl.minimum(lo, tl.where(live, x, float("inf")))
    return tl.max(hi, 0), tl.min(lo, 0)


@triton.jit
def _kth_key(row_ptr, vocab, k, lo, hi, BLOCK: tl.constexpr, WAYS: tl.constexpr, ROUNDS: tl.constexpr):
    """The largest key K in [lo, hi) with count(logits >= value(K)) >= k, given that lo qualifies and hi
    does not: the key of the k-th largest logit."""
    offs = tl.arange(0, BLOCK)
    for _ in range(ROUNDS):
        cand, at = _candidates(lo, hi, WAYS)
        count = tl.zeros((BLOCK, WAYS), tl.int32)  # per lane, summed once after the pass
        for start in range(0, vocab, BLOCK):
            x = tl.load(row_ptr + start + offs, mask=start + offs < vocab, other=float("-inf"))
            count += (x[:, None] >= at[None, :]).to(tl.int32)
        lo, hi = _narrow(lo, hi, cand, tl.sum(count, 0) >= k)
    return lo


@triton.jit
def _mass_above(row_ptr, vocab, m, floor, BLOCK: tl.constexpr):
    """(S(floor), count of logits above floor), S as in the module docstring."""
    offs = tl.arange(0, BLOCK)
    mass = tl.zeros((BLOCK,), tl.float32)
    count = tl.zeros((BLOCK,), tl.int32)
    for start in range(0, vocab, BLOCK):
        x = tl.load(row_ptr + start + offs, mask=start + offs < vocab, other=float("-inf"))
        above = x > floor
        mass += tl.where(above, tl.exp(x - m), 0.0)
        count += above.to(tl.int32)
    return tl.sum(mass, 0), tl.sum(count, 0)


@triton.jit
def _key_below(v):
    """The key of the largest float under v, as int64; -inf's own key for -inf (no float lies under it, and
    -inf logits carry no mass). Under 0.0 as under -0.0, which compare equal."""
    key = _key(v).to(tl.int64) - 1
    key = tl.where(v == 0.0, -2, key)
    return tl.where(v == float("-inf"), key + 1, key)


@triton.jit
def _mass_cut_key(
    row_ptr, vocab, m, target, lo, hi, BLOCK: tl.constexpr, WAYS: tl.constexpr, ROUNDS: tl.constexpr
):
    """The largest key L in [lo, hi) with S(value(L)) >= target, given that lo qualifies and hi does not."""
    offs = tl.arange(0, BLOCK)
    for _ in range(ROUNDS):
        cand, at = _candidates(lo, hi, WAYS)
        mass = tl.zeros((BLOCK, WAYS), tl.float32)  # per lane, summed once after the pass
        for start in range(0, vocab, BLOCK):
            x = tl.load(row_ptr + start + offs, mask=start + offs < vocab, other=float("-inf"))
            w = tl.exp(x - m)  # (BLOCK,); 0 past the row's end
            mass += tl.where(x[:, None] > at[None, :], w[:, None], 0.0)
        first = tl.arange(0, WAYS) == 0  # lo qualifies by the caller's word
        lo, hi = _narrow(lo, hi, cand, (tl.sum(mass, 0) >= target) | first)
    return lo


@triton.jit
def _smallest_above(row_ptr, vocab, floor, BLOCK: tl.constexpr):
    """The smallest logit above `floor`."""
    offs = tl.arange(0, BLOCK)
    best = tl.full((BLOCK,), float("inf"), tl.float32)
    for start in range(0, vocab, BLOCK):
        live = start + offs < vocab
        x = tl.load(row_ptr + start + offs, mask=live, other=float("-inf"))
        best = tl.minimum(best, tl.where(live & (x > floor), x, float("inf")))
    return tl.min(best, 0)


# per-row knobs: slices of a packed upload, aligned or not with the batch's rows (kernels/_backend.py)
@triton.jit(do_not_specialize_on_alignment=["top_k_ptr", "top_p_ptr", "out_ptr"])
def _top_k_top_p_cutoff_kernel(
    # pointers
    scaled_ptr,
    top_k_ptr,
    top_p_ptr,
    out_ptr,
    # sizes
    vocab,
    # strides
    stride_row,
    # meta
    BLOCK: tl.constexpr,
    WAYS: tl.constexpr,
    ROUNDS: tl.constexpr,
):
    row = tl.program_id(0)
    row_ptr = scaled_ptr + row.to(tl.int64) * stride_row
    top_k = tl.load(top_k_ptr + row).to(tl.int32)
    top_p = tl.load(top_p_ptr + row)
    m, least = _row_extremes(row_ptr, vocab, BLOCK)
    top = _key(m).to(tl.int64)
    kth_value = least
    if top_k < vocab:
        kth = _kth_key(row_ptr, vocab, top_k, _key(least).to(tl.int64), top + 1, BLOCK, WAYS, ROUNDS)
        kth_value = _value(kth.to(tl.int32))
    cutoff = kth_value
    if top_p < 1.0:
        above, count = _mass_above(row_ptr, vocab, m, kth_value, BLOCK)
        z = above + (tl.minimum(top_k, vocab) - count).to(tl.float32) * tl.exp(kth_value - m)
        floor = _mass_cut_key(row_ptr, vocab, m, top_p * z, _key_below(kth_value), top, BLOCK, WAYS, ROUNDS)
        cutoff = _smallest_above(row_ptr, vocab, _value(floor.to(tl.int32)), BLOCK)
    tl.store(out_ptr + row, cutoff)


def top_k_top_p_cutoff_triton(
    scaled: torch.Tensor,  # (rows, vocab) float32: logits / temperature
    top_k: torch.Tensor,  # (rows, 1) float32; the vocabulary size when off
    top_p: torch.Tensor,  # (rows, 1) float32; 1: off
) -> torch.Tensor:  # (rows, 1) float32
    assert scaled.dim() == 2 and scaled.dtype == torch.float32, f"scaled {scaled.dtype} {tuple(scaled.shape)}"
    assert scaled.stride(1) == 1, "rows must be contiguous"
    rows, vocab = scaled.shape
    assert top_k.numel() == rows and top_p.numel() == rows, "one top_k and one top_p per row"
    out = torch.empty(rows, 1, dtype=torch.float32, device=scaled.device)
    if rows == 0:
        return out
    _top_k_top_p_cutoff_kernel[(rows,)](
        scaled, top_k.reshape(-1).float().contiguous(), top_p.reshape(-1).float().contiguous(), out,
        vocab,
        scaled.stride(0),
        BLOCK=BLOCK, WAYS=WAYS, ROUNDS=ROUNDS,
        num_warps=8,
    )  # fmt: skip
    return out


def top_k_top_p_cutoff_reference(
    scaled: torch.Tensor,  # (rows, vocab) float32: logits / temperature
    top_k: torch.Tensor,  # (rows, 1)
    top_p: torch.Tensor,  # (rows, 1); 1: off
) -> torch.Tensor:  # (rows, 1): the smallest logit the filters keep
    """Keep the fewest top tokens whose probability reaches top_p, by one sort of the rows; the cutoff is a
    value, so tokens tied with the last kept one are kept too."""
    vocab = scaled.shape[1]
    ordered = scaled.sort(dim=-1, descending=True).values  # (rows, vocab)
    in_k = torch.arange(vocab, device=scaled.device) < top_k  # (rows, vocab)
    probs = ordered.masked_fill(~in_k, float("-inf")).softmax(dim=-1)
    before = _cumsum(probs) - probs  # mass of the tokens ranked above each one
    in_p = (before < top_p) | (top_p >= 1.0)  # the top token always stays
    num_kept = (in_k & in_p).sum(dim=-1, keepdim=True)  # (rows, 1), at least 1
    return ordered.gather(1, num_kept - 1)


def _cumsum(x: torch.Tensor, block: int = 128) -> torch.Tensor:
    """Cumulative sum along the last dim in blocks: many short scans and one over the block totals run far
    faster on a GPU than one scan per long row."""
    rows, n = x.shape
    pad = -n % block
    blocks = torch.nn.functional.pad(x, (0, pad)).view(rows, -1, block).cumsum(dim=-1)  # (rows, nb, block)
    totals = blocks[..., -1]  # (rows, nb)
    offsets = totals.cumsum(dim=-1) - totals  # exclusive
    return (blocks + offsets.unsqueeze(-1)).view(rows, -1)[:, :n]


# fewer rows than this take the sort: a program per row leaves most of the device idle and walks its row
# latency-bound (H200, 128k logits: 0.77 ms at 1 to 64 rows, 1.38 ms at 256, against the sort's 0.15, 0.97
# and 4.86 ms)
MIN_ROWS = 64


def top_k_top_p_cutoff(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """(rows, 1): the smallest of each row's logits / temperature that top-k then top-p keep."""
    if _backend.use_triton(scaled) and scaled.shape[0] >= MIN_ROWS:
        return top_k_top_p_cutoff_triton(scaled, top_k, top_p)
    return top_k_top_p_cutoff_reference(scaled, top_k, top_p)
