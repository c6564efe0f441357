"""The online-softmax step over one tile of paged keys, shared by the decode and prefill attention
kernels (kernels/paged_decode_attention.py, kernels/paged_prefill_attention.py).

A program holds ROWS query rows (decode: the query heads of one kv head; prefill: BLOCK_M tokens of
one head) and walks its keys BLOCK_N at a time. Per tile it gathers the K/V rows through the block
table, scores them, and folds them into the running state: acc (ROWS, BLOCK_D) the unnormalised
output, m_i (ROWS,) the running max and l_i (ROWS,) the sum of exp2, all in log2 units (the softmax
scale times log2(e) is folded into one FMA per score).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.kv_quant import fp8_pairs_as_fp16

LOG2E = 1.4426950408889634


@triton.jit
def _kv_tile(
    n0, end, table, kv_base, cols, col_ok, stride_c_kv, stride_c_block, stride_c_off, zero,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, ALL_COLS: tl.constexpr,
):  # fmt: skip
    """Keys n0 .. n0 + BLOCK_N through the block table: their positions and their K and V rows at `cols`
    (elements of kv_base's type). Masked keys (>= end, when MASKED) and columns (not col_ok, unless ALL_COLS)
    load `zero` (0.0 for float elements, 0 for integer words)."""
    pos = n0 + tl.arange(0, BLOCK_N)
    if MASKED:
        block_id = tl.load(table + pos // BLOCK_SIZE, mask=pos < end, other=0).to(tl.int64)
    else:
        block_id = tl.load(table + pos // BLOCK_SIZE).to(tl.int64)
    row_off = block_id * stride_c_block + (pos % BLOCK_SIZE) * stride_c_off  # (BLOCK_N,)
    k_ptrs = kv_base + row_off[:, None] + cols[None, :]  # (BLOCK_N, columns)
    if MASKED or not ALL_COLS:
        kv_mask = (pos < end)[:, None] & col_ok[None, :]
        k = tl.load(k_ptrs, mask=kv_mask, other=zero)
        v = tl.load(k_ptrs + stride_c_kv, mask=kv_mask, other=zero)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(k_ptrs + stride_c_kv)
    return pos, k, v


@triton.jit
def _softmax_step(s, m_i, l_i, qk_scale):
    """Fold scores s (ROWS, BLOCK_N) into the running max and sum: (probabilities, the old state's rescale,
    new max, new sum), in log2 units (the softmax scale times log2(e) on the scores in one FMA each)."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s * qk_scale - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    return p, alpha, m_new, l_i


@triton.jit
def online_softmax_tile(
    acc, m_i, l_i, q, qk_scale, q_pos, n0, end, table, kv_base, dims,
    stride_c_kv, stride_c_block, stride_c_off,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One step over keys n0 .. n0 + BLOCK_N. MASKED=False: every key is < end and visible to every
    row. MASKED: keys >= end are masked, and with CAUSAL so are keys past each row's position q_pos
    (ROWS,); without CAUSAL q_pos is unused."""
    pos, k, v = _kv_tile(
        n0, end, table, kv_base, dims, dims < HEAD_DIM, stride_c_kv, stride_c_block, stride_c_off, 0.0,
        BLOCK_SIZE, BLOCK_N, MASKED, BLOCK_D == HEAD_DIM,
    )  # fmt: skip
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION)  # (ROWS, BLOCK_N)
    if MASKED:
        if CAUSAL:
            s = tl.where((pos[None, :] <= q_pos[:, None]) & (pos < end)[None, :], s, float("-inf"))
        else:
            s = tl.where((pos < end)[None, :], s, float("-inf"))
    p, alpha, m_new, l_i = _softmax_step(s, m_i, l_i, qk_scale)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def online_softmax_tile_fp8(
    acc_even, acc_odd, m_i, l_i, q_even, q_odd, qk_scale, n0, end, table, kv_base, pairs,
    stride_c_kv, stride_c_block, stride_c_off,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr, CUDA: tl.constexpr,
):  # fmt: skip
    """online_softmax_tile over an fp8 cache read as 16-bit words (kv_base an int16 pointer, the strides in
    words): each word's low byte is an even dim and its high byte the next odd one (kernels/kv_quant.py:
    fp8_pairs_as_fp16), so the scores are two dots of half depth, q's even dims against the low bytes and
    its odd dims against the high, and the output is kept as its even and odd halves. CUDA: the conversion's
    inline assembly (the interpreter has none). No causal mask (decode)."""
    pos, k, v = _kv_tile(
        n0, end, table, kv_base, pairs, pairs * 2 < HEAD_DIM, stride_c_kv, stride_c_block, stride_c_off, 0,
        BLOCK_SIZE, BLOCK_N, MASKED, BLOCK_D == HEAD_DIM,
    )  # fmt: skip
    k_even, k_odd = fp8_pairs_as_fp16(k, CUDA)
    s = tl.dot(q_even, tl.trans(k_even.to(q_even.dtype)), input_precision=DOT_PRECISION)
    s = tl.dot(q_odd, tl.trans(k_odd.to(q_odd.dtype)), s, input_precision=DOT_PRECISION)  # (ROWS, BLOCK_N)
    if MASKED:
        s = tl.where((pos < end)[None, :], s, float("-inf"))
    p, alpha, m_new, l_i = _softmax_step(s, m_i, l_i, qk_scale)
    v_even, v_odd = fp8_pairs_as_fp16(v, CUDA)
    p = p.to(q_even.dtype)
    acc_even = acc_even * alpha[:, None] + tl.dot(p, v_even.to(p.dtype), input_precision=DOT_PRECISION)
    acc_odd = acc_odd * alpha[:, None] + tl.dot(p, v_odd.to(p.dtype), input_precision=DOT_PRECISION)
    return acc_even, acc_odd, m_new, l_i
