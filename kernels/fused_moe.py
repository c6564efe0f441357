"""A mixture-of-experts FFN: each token's top-k experts' SwiGLU MLPs, weighted by the router and summed.

Weights, per rank (its slice of every expert's intermediate features under tensor parallelism):
- w13 (E, 2 * I, H): each expert's gate rows, then its up rows;
- w2 (E, H, I): each expert's down projection.

On a GPU (and under the interpreter) two grouped GEMMs take every (token, choice) pair of the batch at once,
sorted by expert so that one program's rows share one expert's weights, the scheme of vLLM's and SGLang's
fused MoE:
- `align_pairs` orders the pairs by expert in blocks of BLOCK_M rows, each expert's rows padded to whole
  blocks (a padding row names a pair past the last and is masked). Torch ops only, no host sync, sized for the
  worst case (each chosen expert a block with one pair in it), so a CUDA graph captures it; the blocks past
  the ones in use return at once.
- `_gate_up_kernel`: a block's rows of x against its expert's gate and up columns; silu(gate) * up, a row per
  pair, rounded as the dense MLP rounds them (kernels/silu_and_mul.py).
- `_down_kernel`: those rows against the expert's down projection, times the pair's router weight, a row per
  pair. A token's k rows are then summed, in choice order.
Decode's few tokens read each chosen expert's weights once a block; most of a block's rows are padding there,
which costs tensor-core time the GEMV is not bound by.

`fused_moe_reference` loops over the experts the batch chose, transformers' order of operations (the CPU path).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import _backend
from kernels.silu_and_mul import silu_mul


def block_m(num_pairs: int) -> int:
    """Rows a program takes: 16 while a step is decode-sized, 64 for prefill's many rows an expert."""
    return 16 if num_pairs <= 256 else 64


def align_pairs(
    topk_ids: torch.Tensor,  # (T, K) int: each token's chosen experts
    num_experts: int,
    rows: int,  # BLOCK_M
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (token, choice) pairs, numbered t * K + k, sorted by expert in blocks of `rows`:
    - pair_ids (num_blocks * rows,) int32: a block's pairs, padding rows naming T * K;
    - block_experts (num_blocks,) int32: the expert of each block (num_experts past the ones in use);
    - used (1,) int32: the rows in use, a multiple of `rows`.
    num_blocks is the worst case for T * K pairs, fixed by the shapes alone."""
    device = topk_ids.device
    pairs = topk_ids.numel()
    flat = topk_ids.flatten().to(torch.int64)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + rows - 1) // rows * rows
    padded_end = padded.cumsum(0)
    start = counts.cumsum(0) - counts  # each expert's first pair in sorted order
    order = torch.sort(flat, stable=True).indices  # pairs by expert, in pair order within one
    expert = flat[order]
    dest = (padded_end - padded)[expert] + torch.arange(pairs, device=device) - start[expert]
    num_blocks = triton.cdiv(pairs + min(pairs, num_experts) * (rows - 1), rows)
    pair_ids = torch.full((num_blocks * rows,), pairs, dtype=torch.int32, device=device)
    pair_ids.scatter_(0, dest, order.to(torch.int32))
    first_rows = torch.arange(num_blocks, device=device) * rows
    block_experts = torch.searchsorted(padded_end, first_rows, right=True).to(torch.int32)
    return pair_ids, block_experts, padded_end[-1:].to(torch.int32)


@triton.jit
def _gate_up_kernel(
    # pointers
    x_ptr,  # (T, H)
    w_ptr,  # (E, 2 * I, H)
    pair_ptr,  # (num_blocks * BLOCK_M,) int32
    expert_ptr,  # (num_blocks,) int32
    used_ptr,  # (1,) int32
    act_ptr,  # (T * K, I)
    # sizes
    num_pairs,
    H,
    inter,
    # strides
    stride_x,
    stride_we,
    stride_wn,
    stride_act,
    # meta
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    block = tl.program_id(0)
    if block * BLOCK_M >= tl.load(used_ptr):
        return
    expert = tl.load(expert_ptr + block).to(tl.int64)
    pairs = tl.load(pair_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    rows = pairs < num_pairs
    tokens = (pairs // TOP_K).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    x_tile = x_ptr + tokens[:, None] * stride_x + ks[None, :]  # (BLOCK_M, BLOCK_K)
    gate_tile = (
        w_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]
    )  # (BLOCK_K, BLOCK_N)
    up_tile = gate_tile + inter * stride_wn
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_in = ks + k0 < H
        w_mask = k_in[:, None] & (cols < inter)[None, :]
        a = tl.load(x_tile + k0, mask=rows[:, None] & k_in[None, :], other=0.0)
        gate = tl.dot(a, tl.load(gate_tile + k0, mask=w_mask, other=0.0), gate, input_precision="ieee")
        up = tl.dot(a, tl.load(up_tile + k0, mask=w_mask, other=0.0), up, input_precision="ieee")
    dt = act_ptr.dtype.element_ty
    act = silu_mul(gate.to(dt), up.to(dt))  # each GEMM's output rounded, as the dense MLP's
    dst = act_ptr + pairs[:, None].to(tl.int64) * stride_act + cols[None, :]
    tl.store(dst, act.to(dt), mask=rows[:, None] & (cols < inter)[None, :])


@triton.jit
def _down_kernel(
    # pointers
    act_ptr,  # (T * K, I)
    w_ptr,  # (E, H, I)
    weight_ptr,  # (T * K,) fp32: the pairs' router weights
    pair_ptr,
    expert_ptr,
    used_ptr,
    out_ptr,  # (T * K, H)
    # sizes
    num_pairs,
    H,
    inter,
    # strides
    stride_act,
    stride_we,
    stride_wn,
    stride_out,
    # meta
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    block = tl.program_id(0)
    if block * BLOCK_M >= tl.load(used_ptr):
        return
    expert = tl.load(expert_ptr + block).to(tl.int64)
    pairs = tl.load(pair_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    rows = pairs < num_pairs
    pairs64 = pairs.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_tile = act_ptr + pairs64[:, None] * stride_act + ks[None, :]
    w_tile = w_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k_in = ks + k0 < inter
        a = tl.load(a_tile + k0, mask=rows[:, None] & k_in[None, :], other=0.0)
        w = tl.load(w_tile + k0, mask=k_in[:, None] & (cols < H)[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision="ieee")
    dt = out_ptr.dtype.element_ty
    weight = tl.load(weight_ptr + pairs64, mask=rows, other=0.0)
    out = acc.to(dt).to(tl.float32) * weight[:, None]  # the expert's output rounded, then weighted
    dst = out_ptr + pairs64[:, None] * stride_out + cols[None, :]
    tl.store(dst, out.to(dt), mask=rows[:, None] & (cols < H)[None, :])


def fused_moe_triton(
    x: torch.Tensor,  # (T, H)
    w13: torch.Tensor,  # (E, 2 * I, H)
    w2: torch.Tensor,  # (E, H, I)
    topk_weights: torch.Tensor,  # (T, K) fp32
    topk_ids: torch.Tensor,  # (T, K) int
) -> torch.Tensor:  # (T, H) in x's dtype
    _check(x, w13, w2, topk_weights, topk_ids)
    (tokens, hidden), (experts, inter) = x.shape, (w13.shape[0], w2.shape[2])
    top_k = topk_ids.shape[1]
    num_pairs = tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    rows = block_m(num_pairs)
    pair_ids, block_experts, used = align_pairs(topk_ids, experts, rows)
    num_blocks = block_experts.numel()
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    block_n, block_k = 64, 64
    _gate_up_kernel[(num_blocks, triton.cdiv(inter, block_n))](
        x, w13, pair_ids, block_experts, used, act, num_pairs, hidden, inter, x.stride(0), w13.stride(0),
        w13.stride(1), act.stride(0), TOP_K=top_k, BLOCK_M=rows, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
    )  # fmt: skip
    out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    _down_kernel[(num_blocks, triton.cdiv(hidden, block_n))](
        act, w2, weights, pair_ids, block_experts, used, out, num_pairs, hidden, inter, act.stride(0),
        w2.stride(0), w2.stride(1), out.stride(0), BLOCK_M=rows, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
    )  # fmt: skip
    return _sum_choices(out.view(tokens, top_k, hidden))


def _sum_choices(per_choice: torch.Tensor) -> torch.Tensor:  # (T, K, H) -> (T, H), choice 0 first
    total = per_choice[:, 0].clone()
    for k in range(1, per_choice.shape[1]):
        total += per_choice[:, k]
    return total


def fused_moe_reference(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """Expert by expert over the tokens that chose it; each expert's output rounded to x's dtype, weighted, and a
    token's choices summed in choice order (as the kernels do)."""
    _check(x, w13, w2, topk_weights, topk_ids)
    tokens, top_k = topk_ids.shape
    inter = w2.shape[2]
    per_choice = torch.zeros(tokens, top_k, x.shape[1], dtype=x.dtype, device=x.device)
    for expert in torch.unique(topk_ids).tolist():
        token_idx, choice = torch.where(topk_ids == expert)
        gate_up = F.linear(x[token_idx], w13[expert])
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        out = F.linear(act, w2[expert])
        weight = topk_weights[token_idx, choice].to(torch.float32)[:, None]
        per_choice[token_idx, choice] = (out.to(torch.float32) * weight).to(x.dtype)
    return _sum_choices(per_choice)


def fused_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    if _backend.use_triton(x):
        return fused_moe_triton(x, w13, w2, topk_weights, topk_ids)
    return fused_moe_reference(x, w13, w2, topk_weights, topk_ids)


def _check(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> None:
    assert x.dim() == 2 and x.stride(1) == 1, f"x must be (tokens, hidden), got {tuple(x.shape)}"
    experts, two_inter, hidden = w13.shape
    assert hidden == x.shape[1] and two_inter % 2 == 0, f"w13 {tuple(w13.shape)} for x {tuple(x.shape)}"
    assert w2.shape == (experts, hidden, two_inter // 2), f"w2 {tuple(w2.shape)} for w13 {tuple(w13.shape)}"
    assert w13.stride(2) == 1 and w2.stride(2) == 1, "expert weights' last dim not contiguous"
    assert topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == x.shape[0], (
        f"topk {tuple(topk_ids.shape)} for x {tuple(x.shape)}"
    )
