"""Top-k, then top-p over the top-k renormalized (vLLM's order), as one cutoff value per row, without
sorting the vocabulary.

The cutoff is the smallest logit the two filters keep. Sorting each row finds it in one pass of a
segmented sort, which at 128k logits a row costs more than the rest of a batched decode step's
sampling together. The kernel instead searches on the logits' values, one program per row. Values are
searched as int32 keys that order like the floats (-0.0 counts as 0.0 throughout: comparisons are on the
floats). With m the row's largest logit, for a key K:

    C(K) = count of logits x >= value(K)          M(K) = sum of exp(x - m) over those logits

Both only fall as K rises, so "the largest K with C(K) >= k" (the key of the k-th largest logit) and "the
largest K with M(K) >= target" are searches on one predicate. A search keeps an interval [lo, hi) with
lo qualifying and hi not, and each pass over the row computes C and M at 8 candidates in it, the
interval's start among them, which narrows it 8-fold. Candidates are spaced evenly in value while the
interval spans many keys, so the logits inside fall about as fast as the interval does; once at most CAP
logits lie inside, one more pass copies them to a scratch row and the search ends on those copies in
registers, in key steps, with C and M at hi carried from the passes.

With kth the top_k-th largest logit, c = C(key(kth) + 1) (the logits above kth) and
S = M(key(kth) + 1), the top_k logits' mass is Z = S + (top_k - c) * exp(kth - m) (ties at kth cut), and

    cutoff = value(the largest key K >= key(kth) with M(K) >= top_p * Z)

which is the logit at the last rank the sort-based form keeps (`top_k_top_p_cutoff_reference`): a rank is
kept when the mass ranked above it is under top_p, and the mass above the first of a run of equal logits
is that of the logits above their value. M steps only at a logit's key, so the cutoff is a logit of the
row; where the copies' sums round below a pass's, the search can end on a candidate key between logits,
and the cutoff is the smallest logit at or above it. With top-k off, Z is M at the row's least logit,
which the top-p search's first pass sums anyway. On 128k flat logits (top-p 0.95) a search takes two or three
passes and the copy; each pass costs several times a plain read of the row, as every logit meets 8
candidates. Sums run in another order than the reference's, so a row whose mass lands within rounding of top_p can
keep one token more or fewer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import _backend

WAYS = 8  # candidates per pass, the interval's start among them: each pass narrows the interval 8-fold
KEY_ROUNDS = 11  # 8**11 > 2**32: enough key steps to pin one int32 key
BLOCK = 2048  # logits a program's lanes load at once
NUM_WARPS = 16  # a program's lanes are latency-bound: more of them in flight, not more loads each
CAP = 1024  # logits inside the interval that the search copies out and finishes on in registers
# an interval of fewer keys takes candidates evenly spaced in key
VALUE_SPACING_MIN_KEYS: tl.constexpr = tl.constexpr(4096)


@triton.jit
def _key(x):
    """float32 -> int32 that orders as the floats do."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _value(key):
    """The float whose key `key` is (int64 scalars or tensors between the keys of -inf and inf)."""
    key = tl.minimum(tl.maximum(key, -2147483648), 2147483647).to(tl.int32)
    bits = tl.where(key >= 0, key, key ^ 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _candidates(lo, hi, BY_VALUE: tl.constexpr, WAYS: tl.constexpr):
    """WAYS nondecreasing keys in [lo, hi) from lo (int64 scalars), as int64 and as their floats: evenly
    spaced in value where BY_VALUE and the interval is wide and finite, else in key."""
    j = tl.arange(0, WAYS).to(tl.int64)
    step = (hi - lo + WAYS - 1) // WAYS
    cand = lo + j * step
    if BY_VALUE:
        lo_v = _value(lo)
        span = tl.minimum(_value(hi - 1) - lo_v, 3.0e38)  # finite: the spacing holds only where it is
        even = _key(lo_v + span * (j.to(tl.float32) / WAYS)).to(tl.int64)
        wide = (hi - lo >= VALUE_SPACING_MIN_KEYS) & (span < 3.0e38) & (lo_v > -3.0e38)
        cand = tl.where(wide, even, cand)
    cand = tl.where(j == 0, lo, tl.minimum(tl.maximum(cand, lo), hi - 1))
    return cand, _value(cand)


@triton.jit
def _narrow(lo, hi, c_hi, m_hi, cand, count, mass, ok, WAYS: tl.constexpr):
    """The interval after C and M at the candidates: lo the last qualifying candidate, hi the first
    failing one (or hi as it was), with C and M at the new hi and C at the new lo."""
    j = tl.arange(0, WAYS)
    last = tl.sum((ok | (j == 0)).to(tl.int32), 0) - 1  # the predicate falls once along the candidates
    lo = tl.sum(tl.where(j == last, cand, 0), 0)
    c_lo = tl.sum(tl.where(j == last, count, 0), 0)
    moved = last + 1 < WAYS
    hi = tl.where(moved, tl.sum(tl.where(j == last + 1, cand, 0), 0), hi)
    c_hi = tl.where(moved, tl.sum(tl.where(j == last + 1, count, 0), 0), c_hi)
    m_hi = tl.where(moved, tl.sum(tl.where(j == last + 1, mass, 0.0), 0), m_hi)
    return lo, hi, c_hi, m_hi, c_lo


@triton.jit
def _tally(x, live, m, at, count, mass):
    """Per lane: C and M at each candidate value `at` over one block of logits."""
    ge = live[:, None] & (x[:, None] >= at[None, :])  # (BLOCK, WAYS)
    w = tl.exp(x - m)
    return count + ge.to(tl.int32), mass + tl.where(ge, w[:, None], 0.0)


@triton.jit
def _pick(v, i, WAYS: tl.constexpr):
    """Element i of a (WAYS,) vector, as a scalar."""
    return tl.sum(tl.where(tl.arange(0, WAYS) == i, v, 0), 0)


@triton.jit
def _way(x, w, at, count, mass):
    ge = x >= at
    return count + ge.to(tl.int32), mass + tl.where(ge, w, 0.0)


@triton.jit
def _pass(row_ptr, vocab, m, at, BLOCK: tl.constexpr, WAYS: tl.constexpr):
    """(C, M) at the 8 candidate values `at`, over the whole row. Each candidate is a scalar and each of its
    sums a vector of the loads' own shape: broadcasting a block against the candidates instead moves every
    block between layouts, which costs several times the sums themselves."""
    tl.static_assert(WAYS == 8, "one accumulator pair per candidate, written out")
    offs = tl.arange(0, BLOCK)
    a0 = _pick(at, 0, WAYS)
    a1 = _pick(at, 1, WAYS)
    a2 = _pick(at, 2, WAYS)
    a3 = _pick(at, 3, WAYS)
    a4 = _pick(at, 4, WAYS)
    a5 = _pick(at, 5, WAYS)
    a6 = _pick(at, 6, WAYS)
    a7 = _pick(at, 7, WAYS)
    c0 = tl.zeros((BLOCK,), tl.int32)  # per lane, summed once after the pass
    c1 = tl.zeros((BLOCK,), tl.int32)
    c2 = tl.zeros((BLOCK,), tl.int32)
    c3 = tl.zeros((BLOCK,), tl.int32)
    c4 = tl.zeros((BLOCK,), tl.int32)
    c5 = tl.zeros((BLOCK,), tl.int32)
    c6 = tl.zeros((BLOCK,), tl.int32)
    c7 = tl.zeros((BLOCK,), tl.int32)
    s0 = tl.zeros((BLOCK,), tl.float32)
    s1 = tl.zeros((BLOCK,), tl.float32)
    s2 = tl.zeros((BLOCK,), tl.float32)
    s3 = tl.zeros((BLOCK,), tl.float32)
    s4 = tl.zeros((BLOCK,), tl.float32)
    s5 = tl.zeros((BLOCK,), tl.float32)
    s6 = tl.zeros((BLOCK,), tl.float32)
    s7 = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, vocab, BLOCK):
        # past the row's end: NaN, which compares false with every candidate, -inf included
        x = tl.load(row_ptr + start + offs, mask=start + offs < vocab, other=float("nan"))
        w = tl.exp(x - m)
        c0, s0 = _way(x, w, a0, c0, s0)
        c1, s1 = _way(x, w, a1, c1, s1)
        c2, s2 = _way(x, w, a2, c2, s2)
        c3, s3 = _way(x, w, a3, c3, s3)
        c4, s4 = _way(x, w, a4, c4, s4)
        c5, s5 = _way(x, w, a5, c5, s5)
        c6, s6 = _way(x, w, a6, c6, s6)
        c7, s7 = _way(x, w, a7, c7, s7)
    j = tl.arange(0, WAYS)
    count = tl.where(j == 0, tl.sum(c0, 0), 0) + tl.where(j == 1, tl.sum(c1, 0), 0)
    count += tl.where(j == 2, tl.sum(c2, 0), 0) + tl.where(j == 3, tl.sum(c3, 0), 0)
    count += tl.where(j == 4, tl.sum(c4, 0), 0) + tl.where(j == 5, tl.sum(c5, 0), 0)
    count += tl.where(j == 6, tl.sum(c6, 0), 0) + tl.where(j == 7, tl.sum(c7, 0), 0)
    mass = tl.where(j == 0, tl.sum(s0, 0), 0.0) + tl.where(j == 1, tl.sum(s1, 0), 0.0)
    mass += tl.where(j == 2, tl.sum(s2, 0), 0.0) + tl.where(j == 3, tl.sum(s3, 0), 0.0)
    mass += tl.where(j == 4, tl.sum(s4, 0), 0.0) + tl.where(j == 5, tl.sum(s5, 0), 0.0)
    mass += tl.where(j == 6, tl.sum(s6, 0), 0.0) + tl.where(j == 7, tl.sum(s7, 0), 0.0)
    return count, mass


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
def _search(
    row_ptr, scratch_ptr, taken_ptr, vocab, m, lo, hi, goal, z_share,
    BY_MASS: tl.constexpr, BLOCK: tl.constexpr, WAYS: tl.constexpr,
    CAP: tl.constexpr, KEY_ROUNDS: tl.constexpr,
):  # fmt: skip
    """(K, the logit at K, C(K + 1), M(K + 1)): K the largest key in [lo, hi) with C(K) >= goal (M(K) where
    BY_MASS), given that lo qualifies and hi does not, and that nothing lies at or above hi. A negative
    goal is z_share of M(lo), which the first pass sums (the top-p target when top-k is off)."""
    offs = tl.arange(0, BLOCK)
    j = tl.arange(0, WAYS)
    c_hi = tl.zeros((), tl.int32)
    m_hi = tl.zeros((), tl.float32)
    inside = CAP + 1  # unknown before the first pass
    while (inside > CAP) & (hi - lo > 1):
        cand, at = _candidates(lo, hi, True, WAYS)
        count_j, mass_j = _pass(row_ptr, vocab, m, at, BLOCK, WAYS)
        goal = tl.where(goal < 0, z_share * tl.sum(tl.where(j == 0, mass_j, 0.0), 0), goal)
        if BY_MASS:
            ok = mass_j >= goal
        else:
            ok = count_j.to(tl.float32) >= goal
        lo, hi, c_hi, m_hi, c_lo = _narrow(lo, hi, c_hi, m_hi, cand, count_j, mass_j, ok, WAYS)
        inside = c_lo - c_hi
    cut = _value(lo)
    if hi - lo > 1:  # copy the logits inside [lo, hi) out, then end the search on them
        lo_at = _value(lo)
        hi_at = _value(hi)
        tl.debug_barrier()  # every lane done with an earlier search's copies
        tl.store(taken_ptr, 0)
        tl.debug_barrier()
        for start in range(0, vocab, BLOCK):
            live = start + offs < vocab
            x = tl.load(row_ptr + start + offs, mask=live, other=float("-inf"))
            keep = live & (x >= lo_at) & ~(x >= hi_at)  # few lanes: each takes a slot with an atomic
            at = tl.atomic_add(taken_ptr + tl.zeros_like(offs), 1, mask=keep, sem="relaxed")
            tl.store(scratch_ptr + at, x, mask=keep & (at < CAP))
        tl.debug_barrier()  # the lanes' stores, seen by every lane below
        taken = tl.load(taken_ptr)
        slot = tl.arange(0, CAP)
        held = slot < taken
        x = tl.load(scratch_ptr + slot, mask=held, other=float("-inf"))
        c_out = c_hi  # C and M over the logits at or above hi, none of them copied
        m_out = m_hi
        for _ in range(KEY_ROUNDS):
            cand, at = _candidates(lo, hi, False, WAYS)
            zero_count = tl.zeros((CAP, WAYS), tl.int32)
            count, mass = _tally(x, held, m, at, zero_count, tl.zeros((CAP, WAYS), tl.float32))
            count_j = c_out + tl.sum(count, 0)
            mass_j = m_out + tl.sum(mass, 0)
            if BY_MASS:
                ok = mass_j >= goal
            else:
                ok = count_j.to(tl.float32) >= goal
            lo, hi, c_hi, m_hi, _c_lo = _narrow(lo, hi, c_hi, m_hi, cand, count_j, mass_j, ok, WAYS)
        # The copies' mass sums in another order than the passes' did, so where M(lo) lay within rounding of
        # the goal no key above lo may qualify here and lo, a candidate, need not be a logit's key: the
        # smallest copy at or above it is.
        least_kept = tl.min(tl.where(held & (x >= _value(lo)), x, float("inf")), 0)
        if least_kept < float("inf"):
            cut = least_kept
    return lo, cut, c_hi, m_hi


# per-row knobs: slices of a packed upload, aligned or not with the batch's rows (kernels/_backend.py)
@triton.jit(do_not_specialize_on_alignment=["top_k_ptr", "top_p_ptr", "out_ptr"])
def _top_k_top_p_cutoff_kernel(
    # pointers
    scaled_ptr,
    top_k_ptr,
    top_p_ptr,
    out_ptr,
    scratch_ptr,
    taken_ptr,
    # sizes
    vocab,
    # strides
    stride_row,
    # meta
    BLOCK: tl.constexpr,
    WAYS: tl.constexpr,
    CAP: tl.constexpr,
    KEY_ROUNDS: tl.constexpr,
):
    row = tl.program_id(0)
    row_ptr = scaled_ptr + row.to(tl.int64) * stride_row
    scratch_ptr += row.to(tl.int64) * CAP
    taken_ptr += row
    top_k = tl.load(top_k_ptr + row).to(tl.int32)
    top_p = tl.load(top_p_ptr + row)
    m, least = _row_extremes(row_ptr, vocab, BLOCK)
    top = _key(tl.where(m == 0.0, 0.0, m)).to(tl.int64)  # +0.0's key: a -0.0 maximum has 0.0s beside it
    kth_key = _key(least).to(tl.int64)
    kth = least
    z = tl.full((), -1.0, tl.float32)  # M(key(least)), summed by the top-p search's first pass
    if top_k < vocab:
        kth_key, kth, above, mass_above = _search(
            row_ptr, scratch_ptr, taken_ptr, vocab, m, kth_key, top + 1, top_k.to(tl.float32), 1.0,
            False, BLOCK, WAYS, CAP, KEY_ROUNDS,
        )  # fmt: skip
        z = mass_above + (top_k - above).to(tl.float32) * tl.exp(kth - m)
    cutoff = kth
    if top_p < 1.0:
        _key_at, cutoff, _c, _m = _search(
            row_ptr, scratch_ptr, taken_ptr, vocab, m, kth_key, top + 1, tl.where(z < 0, z, top_p * z), top_p,
            True, BLOCK, WAYS, CAP, KEY_ROUNDS,
        )  # fmt: skip
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
    scratch = torch.empty(rows, CAP, dtype=torch.float32, device=scaled.device)
    taken = torch.empty(rows, dtype=torch.int32, device=scaled.device)
    _top_k_top_p_cutoff_kernel[(rows,)](
        scaled, top_k.reshape(-1).float().contiguous(), top_p.reshape(-1).float().contiguous(), out, scratch, taken,
        vocab,
        scaled.stride(0),
        BLOCK=BLOCK, WAYS=WAYS, CAP=CAP, KEY_ROUNDS=KEY_ROUNDS,
        num_warps=NUM_WARPS,
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


# fewer rows than this take the sort: a program per row leaves most of the device idle (H200, 128k logits,
# top-p 0.95: the kernel 0.21 ms at 1 to 64 rows and 0.54 at 256; the sort 0.15 at 1 row, 0.25 at 8, 0.56 at 32
# and 0.98 at 64)
MIN_ROWS = 16


def top_k_top_p_cutoff(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """(rows, 1): the smallest of each row's logits / temperature that top-k then top-p keep."""
    if _backend.use_triton(scaled) and scaled.shape[0] >= MIN_ROWS:
        return top_k_top_p_cutoff_triton(scaled, top_k, top_p)
    return top_k_top_p_cutoff_reference(scaled, top_k, top_p)
