"""Decode's few (token, choice) pairs against int4 or int8 experts on the CUDA cores: one GEMV a pair and column block.

kernels/fused_moe.py's grouped GEMMs give each expert's rows a block of at least 16 and decode every weight of a
(K, N) tile to x's dtype for tl.dot; at decode most of a block's rows are padding, and decoding the tiles, not
reading them, set the int4 layer's time (an int4 Qwen3-30B-A3B layer at one token about as slow as bf16's, from a
quarter of the bytes). Here a program takes one pair and a block of its expert's output columns, and the int4
words meet x's row as in the dense one-row kernel (kernels/w4a16_gemm.py: `nibble_products`, one LOP3 and one FMA
a weight, the scale and zero once a group, `scaled_by_group`):
- `_gate_up_gemv_kernel`: the pair's token's x against GATE_UP_N of its expert's gate columns and the same up
  columns; silu(gate) * up, each rounded as the dense MLP rounds them (kernels/silu_and_mul.py), a row per pair.
  With routing (ROUTE) it picks the pair's expert itself: every program takes the top k of its token's logits as
  the route kernel does (kernels/moe_route.py: top_k_of_row), and column block 0 writes the pair's expert and
  weight for the down kernel, one launch fewer a layer;
- `_down_gemv_kernel`: the pair's activation row against DOWN_N of its expert's down columns, rounded, times the
  pair's router weight, a row per pair; another rank's expert (expert parallelism) writes zeros.
Pairs need no alignment (program p is pair p = t * K + k), so a CUDA graph captures the launches as they are. The
products are exact and summed in fp32, where the grouped kernels multiply by weights rounded to x's dtype: the two
agree within that rounding. An int4 stack is the rows layout of kernels/int4_dequant.py, per expert (E, K / 8, N); an
int8 one (GGUF Q8_0, Q6_K) the checkpoint's rows (E, N, K), each row's products summed a group at a time and then
scaled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from kernels import _backend
from kernels.moe_route import Routing, top_k_of_row
from kernels.silu_and_mul import silu_mul
from kernels.w4a16_gemm import nibble_products, scaled_by_group, x_columns

if TYPE_CHECKING:
    from kernels.fused_moe import Int4Experts, Int8Experts

# the nibble masks (kernels/w4a16_gemm.py: _nibble_plus_magic), passed as arguments
MASK_HI, MASK_LO = 0xF0000, 0xF000


@dataclass(frozen=True)
class GemvTiles:
    """Output features a program in each kernel, input rows a K tile (a power of two from 32), warps and stages.
    block_k and warps None: each kernel's by its grid (`_grid_tile`)."""

    gate_up_n: int = 16
    down_n: int = 32
    block_k: int | None = None
    warps: int | None = None
    stages: int = 4


# From this many programs an SM a kernel takes 128-row K tiles with 2 warps, below it 256 rows with 4 (more bytes in
# flight a program). Measured on an H100 (python -m bench.moe --sweep-gemv): Qwen3-30B-A3B's layer at 8 tokens (64
# pairs) 74.4 us against 83.3, Mixtral's at one token (2 pairs, down's 256 programs) 95.0 against 135.8.
MANY_PROGRAMS_PER_SM = 4


# int4 and int8 experts take these kernels up to this many (token, choice) pairs, and this many an expert on average:
# a pair reads its expert's columns itself, so the kernels' time grows with the pairs where the grouped kernels' grows
# with the experts chosen (H100, Mixtral's int4 layer: 2 pairs 82.9 us, 16 pairs 530 against the grouped 1,423;
# 128 pairs grouped 1,185, where 64 GEMV pairs would take about 2,100)
GEMV_MAX_PAIRS = 64
GEMV_PAIRS_PER_EXPERT = 4
GEMV_TILES = GemvTiles()


def chosen(num_pairs: int, num_experts: int) -> bool:
    """Whether a batch of `num_pairs` pairs over `num_experts` experts takes the GEMVs."""
    return num_pairs <= min(GEMV_MAX_PAIRS, GEMV_PAIRS_PER_EXPERT * num_experts)


@triton.jit
def _row_products(
    x_row, w_ptr, s_ptr, z_ptr, perm_row, offs_n, mask_n, K, stride_wk, stride_wn, stride_sg, mask_hi, mask_lo,
    BLOCK_N: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
    EVEN_K: tl.constexpr, ZERO_IS_OFFSET: tl.constexpr, EXACT: tl.constexpr, HAS_PERM: tl.constexpr,
):  # fmt: skip
    """x's row (K,) against one expert's int4 columns offs_n (act order: x read through perm_row): (BLOCK_N,)
    fp32."""
    R: tl.constexpr = BLOCK_K // 8  # packed rows a K tile
    rows = tl.arange(0, R)
    acc = tl.zeros((1, BLOCK_N), dtype=tl.float32)  # the zero and magic terms
    acc_r = tl.zeros((BLOCK_N, R), dtype=tl.float32)  # scaled products
    for t in tl.range(0, tl.cdiv(K, BLOCK_K), num_stages=NUM_STAGES):
        prow = t * R + rows
        cols = t * BLOCK_K + tl.arange(0, BLOCK_K)
        if EVEN_K:
            mask_w = mask_n[:, None]
            x_tile = tl.load(x_row + x_columns(perm_row, cols, cols < K, HAS_PERM))
        else:
            mask_w = mask_n[:, None] & (prow < K // 8)[None, :]
            x_tile = tl.load(x_row + x_columns(perm_row, cols, cols < K, HAS_PERM), mask=cols < K, other=0.0)
        packed = tl.load(
            w_ptr + offs_n[:, None] * stride_wn + prow[None, :] * stride_wk, mask=mask_w, other=0
        )  # (BLOCK_N, R)
        part, x_sum, x_magic = nibble_products(packed, x_tile, mask_hi, mask_lo, acc_r.shape, R, EXACT)
        acc, acc_r = scaled_by_group(
            acc, acc_r, part, x_sum, x_magic, s_ptr, z_ptr, t, prow, offs_n, mask_n, mask_w, stride_sg,
            GROUP, BLOCK_K, ZERO_IS_OFFSET,
        )  # fmt: skip
    return tl.reshape(acc, (BLOCK_N,)) + tl.sum(acc_r, 1)


@triton.jit
def _int8_row_products(
    x_row, w_ptr, s_ptr, offs_n, mask_n, K, stride_wk, stride_wn, stride_sg, stride_sn,
    BLOCK_N: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
    EVEN_K: tl.constexpr,
):  # fmt: skip
    """x's row (K,) against one expert's int8 rows offs_n (a scale a GROUP inputs): (BLOCK_N,) fp32."""
    GROUPS: tl.constexpr = BLOCK_K // GROUP  # a K tile's groups
    acc = tl.zeros((BLOCK_N, GROUPS), dtype=tl.float32)
    for t in tl.range(0, tl.cdiv(K, BLOCK_K), num_stages=NUM_STAGES):
        ks = t * BLOCK_K + tl.arange(0, BLOCK_K)
        groups = t * GROUPS + tl.arange(0, GROUPS)
        if EVEN_K:
            mask_w = mask_n[:, None]
            x = tl.load(x_row + ks).to(tl.float32)
        else:
            mask_w = mask_n[:, None] & (ks < K)[None, :]
            x = tl.load(x_row + ks, mask=ks < K, other=0.0).to(tl.float32)
        q = tl.load(w_ptr + offs_n[:, None] * stride_wn + ks[None, :] * stride_wk, mask=mask_w, other=0)
        sums = tl.sum(
            tl.reshape(q.to(tl.float32) * x[None, :], (BLOCK_N, GROUPS, GROUP)), 2
        )  # exact products
        s_mask = mask_n[:, None] & (groups < K // GROUP)[None, :]
        s = tl.load(s_ptr + offs_n[:, None] * stride_sn + groups[None, :] * stride_sg, mask=s_mask, other=0.0)
        acc += sums * s.to(tl.float32)
    return tl.sum(acc, 1)


@triton.jit
def _products(
    x_row, w_ptr, s_ptr, z_ptr, perm_row, offs_n, mask_n, K, stride_wk, stride_wn, stride_sg, stride_sn, mask_hi,
    mask_lo, BLOCK_N: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
    EVEN_K: tl.constexpr, ZERO_IS_OFFSET: tl.constexpr, EXACT: tl.constexpr, INT8: tl.constexpr,
    HAS_PERM: tl.constexpr,
):  # fmt: skip
    """x's row against one expert's columns offs_n, int8 or int4 (whose scales' columns are contiguous)."""
    if (
        INT8
    ):  # both branches, not an early return: the compiler would build the int4 path for int8 pointers too
        acc = _int8_row_products(
            x_row, w_ptr, s_ptr, offs_n, mask_n, K, stride_wk, stride_wn, stride_sg, stride_sn, BLOCK_N, GROUP,
            BLOCK_K, NUM_STAGES, EVEN_K,
        )  # fmt: skip
    else:
        acc = _row_products(
            x_row, w_ptr, s_ptr, z_ptr, perm_row, offs_n, mask_n, K, stride_wk, stride_wn, stride_sg, mask_hi,
            mask_lo, BLOCK_N, GROUP, BLOCK_K, NUM_STAGES, EVEN_K, ZERO_IS_OFFSET, EXACT, HAS_PERM,
        )  # fmt: skip
    return acc


@triton.jit
def _gate_up_gemv_kernel(
    # pointers
    x_ptr,  # (T, H)
    w_ptr,  # qweight (E, H / 8, 2 * I) int4, or (E, 2 * I, H) int8
    s_ptr,  # scales (E, H / G, 2 * I), int8: (E, 2 * I, H / G)
    z_ptr,  # zeros (E, H / G, 2 * I), int8: unread
    perm_ptr,  # int4 act order: (E, H) int32, x's column of each layout row
    ids_ptr,  # (T * K,): each pair's expert (ROUTE: written here)
    act_ptr,  # (T * K, I)
    logits_ptr,  # ROUTE: (T, E_all) the router's outputs
    weights_ptr,  # ROUTE: (T * K,) fp32, each pair's router weight, written here
    # sizes
    num_experts,
    H,
    inter,
    num_logits,  # ROUTE: E_all, every rank's experts
    first,  # ROUTE: this rank's first expert
    held,  # ROUTE: the experts held here
    stride_l,
    # strides
    stride_x,
    stride_we,
    stride_wk,
    stride_wn,
    stride_se,
    stride_sg,
    stride_sn,
    stride_pe,
    stride_act,
    # the nibble masks
    mask_hi,
    mask_lo,
    # meta
    TOP_K: tl.constexpr,
    ZERO_IS_OFFSET: tl.constexpr,
    GROUP: tl.constexpr,
    OUT_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    EVEN_K: tl.constexpr,
    EXACT: tl.constexpr,
    INT8: tl.constexpr,  # int8 rows (E, N, K), else int4 (E, K / 8, N)
    HAS_PERM: tl.constexpr,
    ROUTE: tl.constexpr,  # the pair's expert from its token's logits (kernels/moe_route.py), not from ids_ptr
    K_PAD: tl.constexpr,
    BLOCK_E: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    ROUND: tl.constexpr,
):
    pair = tl.program_id(0).to(tl.int64)
    # ROUTE: every program of the pair routes its token; column block 0 writes the pair's expert and weight
    if ROUTE:
        slots, vals, ids = top_k_of_row(
            logits_ptr + (pair // TOP_K) * stride_l, num_logits, first, held, TOP_K, K_PAD, BLOCK_E, RENORMALIZE,
            ROUND,
        )  # fmt: skip
        mine = slots == pair % TOP_K
        chosen_id = tl.sum(tl.where(mine, ids, 0), axis=0)
        if tl.program_id(1) == 0:
            tl.store(ids_ptr + pair, chosen_id.to(ids_ptr.dtype.element_ty))
            tl.store(weights_ptr + pair, tl.sum(tl.where(mine, vals, 0.0), axis=0))
        expert = chosen_id.to(tl.int64)
    else:
        expert = tl.load(ids_ptr + pair).to(tl.int64)
    if expert >= num_experts:  # another rank's expert: the down kernel writes its row's zeros
        return
    outs = tl.program_id(1) * OUT_N + tl.arange(0, OUT_N)
    lane = tl.arange(0, 2 * OUT_N)
    feature = tl.program_id(1) * OUT_N + lane % OUT_N
    offs_n = feature + (lane // OUT_N) * inter  # the outputs' gate columns, then their up columns
    acc = _products(
        x_ptr + (pair // TOP_K) * stride_x, w_ptr + expert * stride_we, s_ptr + expert * stride_se,
        z_ptr + expert * stride_se, perm_ptr + expert * stride_pe, offs_n, feature < inter, H, stride_wk,
        stride_wn, stride_sg, stride_sn, mask_hi, mask_lo, 2 * OUT_N, GROUP, BLOCK_K, NUM_STAGES, EVEN_K,
        ZERO_IS_OFFSET, EXACT, INT8, HAS_PERM,
    )  # fmt: skip
    gate, up = tl.split(tl.permute(tl.reshape(acc, (2, OUT_N)), (1, 0)))
    dt = act_ptr.dtype.element_ty
    tl.store(act_ptr + pair * stride_act + outs, silu_mul(gate.to(dt), up.to(dt)).to(dt), mask=outs < inter)


@triton.jit
def _down_gemv_kernel(
    # pointers
    act_ptr,  # (T * K, I)
    w_ptr,  # qweight (E, I / 8, H) int4, or (E, H, I) int8
    s_ptr,  # scales (E, I / G, H), int8: (E, H, I / G)
    z_ptr,  # zeros (E, I / G, H), int8: unread
    perm_ptr,  # int4 act order: (E, I) int32, the activation's column of each layout row
    weight_ptr,  # (T * K,) fp32: the pairs' router weights
    ids_ptr,  # (T * K,): each pair's expert
    out_ptr,  # (T * K, H)
    # sizes
    num_experts,
    H,
    inter,
    # strides
    stride_act,
    stride_we,
    stride_wk,
    stride_wn,
    stride_se,
    stride_sg,
    stride_sn,
    stride_pe,
    stride_out,
    # the nibble masks
    mask_hi,
    mask_lo,
    # meta
    ZERO_IS_OFFSET: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    EVEN_K: tl.constexpr,
    EXACT: tl.constexpr,
    INT8: tl.constexpr,  # int8 rows (E, N, K), else int4 (E, K / 8, N)
    HAS_PERM: tl.constexpr,
):
    pair = tl.program_id(0).to(tl.int64)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < H
    dst = out_ptr + pair * stride_out + offs_n
    dt = out_ptr.dtype.element_ty
    if expert >= num_experts:  # another rank's expert: it adds nothing here
        tl.store(dst, tl.zeros((BLOCK_N,), dtype=dt), mask=mask_n)
        return
    acc = _products(
        act_ptr + pair * stride_act, w_ptr + expert * stride_we, s_ptr + expert * stride_se,
        z_ptr + expert * stride_se, perm_ptr + expert * stride_pe, offs_n, mask_n, inter, stride_wk, stride_wn,
        stride_sg, stride_sn, mask_hi, mask_lo, BLOCK_N, GROUP, BLOCK_K, NUM_STAGES, EVEN_K, ZERO_IS_OFFSET,
        EXACT, INT8, HAS_PERM,
    )  # fmt: skip
    weight = tl.load(weight_ptr + pair)
    tl.store(dst, (acc.to(dt).to(tl.float32) * weight).to(dt), mask=mask_n)  # rounded, then weighted


def takes(w: object) -> bool:
    """Whether a stack has a GEMV here: int4 experts, or int8 ones in groups of a power of two up to 128 (whole
    groups a K tile)."""
    from kernels.fused_moe import Int4Experts, Int8Experts

    if isinstance(w, Int8Experts):
        return w.group_size in (16, 32, 64, 128)
    return isinstance(w, Int4Experts)


def _stack_args(w: Int4Experts | Int8Experts) -> tuple:
    """qweight, scales, zeros (int8: the scales again, unread), act order's perm (else qweight, unread) and their
    strides as the kernels take them: expert, packed row or input, column; expert, group, column; expert."""
    from kernels.fused_moe import Int8Experts

    q, s = w.qweight, w.scales
    if isinstance(w, Int8Experts):  # (E, N, K) rows, (E, N, K / G) scales
        return q, s, s, q, q.stride(0), q.stride(2), q.stride(1), s.stride(0), s.stride(2), s.stride(1), 0
    z, perm = w.zeros, w.perm
    assert s.stride() == z.stride() and s.stride(2) == 1, f"scales' strides {s.stride()}, zeros' {z.stride()}"
    return (q, s, z, q if perm is None else perm, q.stride(0), q.stride(1), q.stride(2), s.stride(0), s.stride(1),
            1, 0 if perm is None else perm.stride(0))  # fmt: skip


def _grid_tile(programs: int, device: torch.device, tiles: GemvTiles) -> tuple[int, int]:
    """(block_k, warps): as given, else by the programs an SM."""
    many = programs >= MANY_PROGRAMS_PER_SM * _backend.num_sms(device)
    return tiles.block_k or (128 if many else 256), tiles.warps or (2 if many else 4)


def _meta(w: Int4Experts | Int8Experts, k: int, x: torch.Tensor, programs: int, tiles: GemvTiles) -> dict:
    block_k, warps = _grid_tile(programs, x.device, tiles)
    int8 = w.qweight.dtype == torch.int8
    if int8:  # a byte a weight: half the int4 K tile reads the same bytes, at about the registers
        block_k = max(block_k // 2, w.group_size)
    block_k = min(block_k, triton.next_power_of_2(k))
    assert not int8 or block_k % w.group_size == 0, f"int8 groups of {w.group_size} in {block_k}-row K tiles"
    return {
        "INT8": int8,
        "HAS_PERM": not int8 and w.perm is not None,  # type: ignore[union-attr]
        "ZERO_IS_OFFSET": not int8 and w.zero_is_offset,  # type: ignore[union-attr]
        "GROUP": w.group_size,
        "BLOCK_K": block_k,
        "NUM_STAGES": tiles.stages,
        "EVEN_K": k % block_k == 0,
        "EXACT": x.dtype == torch.float32,  # fp32 x: q itself, exact products; 16-bit x: the magic planes
        "num_warps": warps,
        "num_stages": tiles.stages,
    }


def gate_up_gemv(
    x: torch.Tensor,  # (T, H)
    w13: Int4Experts | Int8Experts,  # (E, 2 * I, H)
    pair_experts: torch.Tensor,  # (T * K,) int: pair t * K + k's expert (E or past: another rank's)
    top_k: int,
    tiles: GemvTiles,
    routing: Routing | None = None,  # the kernel routes: pair_experts and pair_weights are its outputs
    pair_weights: torch.Tensor | None = None,  # with routing: (T * K,) fp32, each pair's router weight
) -> torch.Tensor:  # (T * K, I): silu(gate) * up, a row per pair (another rank's pairs unwritten)
    experts, two_inter, hidden = w13.shape
    inter = two_inter // 2
    assert x.stride(1) == 1 and pair_experts.is_contiguous(), (
        "x's rows and the pairs' experts must be contiguous"
    )
    act = torch.empty(pair_experts.numel(), inter, dtype=x.dtype, device=x.device)
    q, s, z, perm, *strides = _stack_args(w13)
    grid = (pair_experts.numel(), triton.cdiv(inter, tiles.gate_up_n))
    route_args: tuple = (x, 0, 0, 0, 0)  # unread without routing
    route_meta: dict = {"K_PAD": 1, "BLOCK_E": 1, "RENORMALIZE": False, "ROUND": 0}
    if routing is not None:
        assert routing.top_k == top_k and pair_weights is not None and pair_weights.is_contiguous()
        route_args, route_meta = routing.kernel_args()
    _gate_up_gemv_kernel[grid](
        x, q, s, z, perm, pair_experts, act, route_args[0], pair_weights if pair_weights is not None else act,
        experts, hidden, inter, *route_args[1:], x.stride(0), *strides, act.stride(0), MASK_HI, MASK_LO, TOP_K=top_k,
        OUT_N=tiles.gate_up_n, ROUTE=routing is not None, **route_meta,
        **_meta(w13, hidden, x, grid[0] * grid[1], tiles),
    )  # fmt: skip
    return act


def down_gemv(
    act: torch.Tensor,  # (T * K, I)
    w2: Int4Experts | Int8Experts,  # (E, H, I)
    pair_weights: torch.Tensor,  # (T * K,) fp32: the router's weights
    pair_experts: torch.Tensor,  # (T * K,) int
    tiles: GemvTiles,
) -> torch.Tensor:  # (T * K, H): each pair's expert output, rounded, times its weight
    experts, hidden, inter = w2.shape
    out = torch.empty(act.shape[0], hidden, dtype=act.dtype, device=act.device)
    q, s, z, perm, *strides = _stack_args(w2)
    grid = (act.shape[0], triton.cdiv(hidden, tiles.down_n))
    _down_gemv_kernel[grid](
        act, q, s, z, perm, pair_weights, pair_experts, out, experts, hidden, inter, act.stride(0), *strides,
        out.stride(0), MASK_HI, MASK_LO, BLOCK_N=tiles.down_n, **_meta(w2, inter, act, grid[0] * grid[1], tiles),
    )  # fmt: skip
    return out
