"""A MoE router's choices: each token's top-k experts of its fp32 softmax, their weights renormalised and rounded as
the model's reference does, one kernel on the GPU where the torch ops take a dozen small ones.

Expert parallelism: a rank holding experts first .. first + held - 1 gets their local ids; the other ranks' choices
map to `held`, which kernels/fused_moe.py's kernels skip.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import _backend

_TAKEN = tl.constexpr(-(2**62))  # an expert already chosen: below every key


@triton.jit
def top_k_of_row(
    row_ptr, E, first, held, TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_E: tl.constexpr,
    RENORMALIZE: tl.constexpr, ROUND: tl.constexpr,
):  # fmt: skip
    """A token's E router logits at row_ptr -> (slots, weights, ids), K_PAD each (slots past TOP_K unused): its top-k
    experts and their weights, as `route_reference` computes them. The route kernel's body, and the int4 gate_up
    GEMV's prologue where that kernel routes (kernels/fused_moe_gemv.py)."""
    offs = tl.arange(0, BLOCK_E)
    x = tl.load(row_ptr + offs, mask=offs < E, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    probs = p / tl.sum(p, axis=0)
    # one max a choice, of keys: a probability's bits (non-negative floats order as their int32 bits; padding's -1.0
    # is negative, below every probability) above the index reversed, so that equals go to the lowest index
    prob_bits = tl.where(offs < E, probs, -1.0).to(tl.int32, bitcast=True).to(tl.int64)
    left = (prob_bits << 32) | (BLOCK_E - 1 - offs).to(tl.int64)
    slots = tl.arange(0, K_PAD)
    vals = tl.zeros((K_PAD,), dtype=tl.float32)
    ids = tl.zeros((K_PAD,), dtype=tl.int32)
    for k in tl.static_range(TOP_K):  # the largest left, the lowest index among equals
        best = tl.max(left, axis=0)
        v = (best >> 32).to(tl.int32).to(tl.float32, bitcast=True)
        i = (BLOCK_E - 1 - (best & 0xFFFFFFFF)).to(tl.int32)
        vals = tl.where(slots == k, v, vals)
        ids = tl.where(slots == k, i, ids)
        left = tl.where(offs == i, _TAKEN, left)
    if RENORMALIZE:
        vals = vals / tl.sum(tl.where(slots < TOP_K, vals, 0.0), axis=0)
    if ROUND == 1:  # to the nearest bf16, ties to even, in the bits (the interpreter's bf16 cast truncates)
        bits = vals.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        vals = bits.to(tl.float32, bitcast=True)
    elif ROUND == 2:
        vals = vals.to(tl.float16).to(tl.float32)
    local = ids - first  # expert parallelism: this rank's experts by local index, the others' past them
    ids = tl.where((local >= 0) & (local < held), local, held)
    return slots, vals, ids


@triton.jit
def _route_kernel(
    logits_ptr, weights_ptr, ids_ptr, E, stride_l, first, held,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_E: tl.constexpr, RENORMALIZE: tl.constexpr,
    ROUND: tl.constexpr,
):  # fmt: skip
    """A token's router logits -> its top-k experts and their weights, as `route_reference` computes them."""
    t = tl.program_id(0).to(tl.int64)
    slots, vals, ids = top_k_of_row(
        logits_ptr + t * stride_l, E, first, held, TOP_K, K_PAD, BLOCK_E, RENORMALIZE, ROUND
    )  # fmt: skip
    tl.store(weights_ptr + t * TOP_K + slots, vals, mask=slots < TOP_K)
    tl.store(ids_ptr + t * TOP_K + slots, ids, mask=slots < TOP_K)


_ROUND = {
    None: 0,
    torch.float32: 0,
    torch.bfloat16: 1,
    torch.float16: 2,
}  # the weights rounded to: as they are


# the int4 gate_up GEMV routes in its prologue up to this many experts (as the route kernel takes in one warp)
MAX_EXPERTS_IN_GEMV = 512


@dataclass(frozen=True)
class Routing:
    """`route`'s arguments, for a kernel that routes itself (kernels/fused_moe.py: fused_moe with routing=)."""

    logits: torch.Tensor  # (T, E)
    top_k: int
    renormalize: bool
    round_to: torch.dtype | None = None
    first: int = 0
    held: int | None = None

    def route(self) -> tuple[torch.Tensor, torch.Tensor]:
        return route(self.logits, self.top_k, self.renormalize, self.round_to, self.first, self.held)

    def in_kernel(self) -> bool:
        """Whether a kernel can route: the route kernel's conditions, and at most MAX_EXPERTS_IN_GEMV experts."""
        return (
            _backend.use_triton(self.logits) and self.round_to in _ROUND
            and self.logits.shape[1] <= MAX_EXPERTS_IN_GEMV and self.logits.stride(1) == 1
        )  # fmt: skip

    def kernel_args(self) -> tuple[tuple, dict]:
        """(logits, E, first, held, logits' row stride) and the constexprs top_k_of_row takes, but TOP_K."""
        experts = self.logits.shape[1]
        held = experts if self.held is None else self.held
        args = (self.logits, experts, self.first, held, self.logits.stride(0))
        meta = {
            "K_PAD": triton.next_power_of_2(self.top_k), "BLOCK_E": triton.next_power_of_2(experts),
            "RENORMALIZE": self.renormalize, "ROUND": _ROUND[self.round_to],
        }  # fmt: skip
        return args, meta


def route(
    logits: torch.Tensor,  # (T, E): the router's outputs
    top_k: int,
    renormalize: bool,
    round_to: torch.dtype | None = None,  # round the weights to this dtype (kept fp32): the Qwen MoEs
    first: int = 0,  # expert parallelism: this rank holds experts first .. first + held - 1
    held: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's top-k experts of the router's fp32 softmax: weights (T, K) fp32 (renormalised to sum to 1 where
    asked) and ids (T, K) int32, local to the experts held here (the others' choices map to `held`). One kernel on
    the GPU, where the torch ops take a dozen small ones."""
    if not _backend.use_triton(logits) or round_to not in _ROUND:
        return route_reference(logits, top_k, renormalize, round_to, first, held)
    return route_triton(logits, top_k, renormalize, round_to, first, held)


def route_triton(
    logits: torch.Tensor, top_k: int, renormalize: bool, round_to: torch.dtype | None = None, first: int = 0,
    held: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`route` in one kernel; among equal probabilities the lowest expert first."""
    held = logits.shape[1] if held is None else held
    tokens, experts = logits.shape
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=logits.device)
    if tokens:
        _route_kernel[(tokens,)](
            logits, weights, ids, experts, logits.stride(0), first, held, TOP_K=top_k,
            K_PAD=triton.next_power_of_2(top_k), BLOCK_E=triton.next_power_of_2(experts), RENORMALIZE=renormalize,
            ROUND=_ROUND[round_to], num_warps=1 if experts <= 512 else 4,
        )  # fmt: skip
    return weights, ids


def route_reference(
    logits: torch.Tensor, top_k: int, renormalize: bool, round_to: torch.dtype | None = None, first: int = 0,
    held: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """transformers' order of operations: softmax in fp32, top k, renormalise, round."""
    held = logits.shape[1] if held is None else held
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if round_to is not None:
        weights = weights.to(round_to).float()
    local = ids - first
    ids = torch.where((local >= 0) & (local < held), local, held)
    return weights, ids.to(torch.int32)
