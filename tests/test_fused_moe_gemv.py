"""Decode's expert GEMVs (kernels/fused_moe_gemv.py, under the interpreter) against the torch reference: every kind
of int4 stack and the int8 ones (GGUF Q8_0, Q6_K), groups smaller than and as large as a K tile, masked columns
and K tails, expert parallelism, and which pair counts and stacks take them."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything here imports triton

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kernels.fused_moe as fm
from kernels.fused_moe import Int4Experts, Int8Experts, fused_moe_reference, fused_moe_triton
from kernels.fused_moe_gemv import GEMV_MAX_PAIRS, GEMV_PAIRS_PER_EXPERT, GemvTiles
from tests.test_fused_moe import int4_experts, int8_experts, moe_inputs


def offsets_form(w: Int4Experts, scales: torch.dtype, seed: int) -> Int4Experts:
    """GGUF Q4_1's (fp16) or Q4_K's (fp32) form: float offsets for zero points, scales of that dtype."""
    gen = torch.Generator().manual_seed(seed)
    offsets = (torch.rand(w.zeros.shape, generator=gen) * -0.1).to(scales)
    return Int4Experts(w.qweight, w.scales.to(scales), offsets, w.group_size)


def q6_k_form(experts: int, n: int, k: int, seed: int) -> Int8Experts:
    """GGUF Q6_K's form: int8 rows of -32..31, an fp32 scale per 16 input features."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-32, 32, (experts, n, k), generator=gen, dtype=torch.int8)
    return Int8Experts(q, torch.rand(experts, n, k // 16, generator=gen) * 0.004 + 0.001, 16)


def stacks(hidden: int, inter: int, experts: int, group: int, kind: str) -> tuple:
    """(w13, w2) of a kind: int4 with zero points (act_order: and GPTQ's act order), Q4_1's or Q4_K's offsets, Q8_0,
    Q6_K, or Q4_K_M's Q4_K and Q6_K."""
    if kind == "q8_0":
        return int8_experts(experts, 2 * inter, hidden, 1), int8_experts(experts, hidden, inter, 2)
    if kind == "q6_k":
        return q6_k_form(experts, 2 * inter, hidden, 1), q6_k_form(experts, hidden, inter, 2)
    w13 = int4_experts(experts, 2 * inter, hidden, group, 1, kind == "act_order")
    w2 = int4_experts(experts, hidden, inter, group, 2, kind == "act_order")
    if kind in ("zeros", "act_order"):
        return w13, w2
    scales = torch.float16 if kind == "q4_1" else torch.float32
    if kind == "q4_k_m":
        return offsets_form(w13, scales, 3), q6_k_form(experts, hidden, inter, 4)
    return offsets_form(w13, scales, 3), offsets_form(w2, scales, 4)


def calls_of(monkeypatch, name: str) -> list[int]:
    """Counts the calls of fused_moe's `name` (a launcher it imports)."""
    calls: list[int] = []
    real = getattr(fm, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(fm, name, counted)
    return calls


@pytest.mark.parametrize(
    ("tokens", "hidden", "inter", "top_k", "group", "kind", "tiles"),
    [
        (1, 128, 64, 2, 32, "zeros", GemvTiles()),  # groups of 32: a scale and zero per packed row
        (2, 256, 128, 4, 128, "zeros", GemvTiles()),  # one group a K tile: the scale after the products
        (1, 160, 96, 2, 32, "zeros", GemvTiles(64, 64, 64)),  # masked columns in both, K tails (96 of 128)
        (3, 128, 64, 2, 64, "q4_1", GemvTiles(16, 32, 32)),  # float offsets, two K tiles a group
        (1, 128, 64, 4, 32, "q4_k", GemvTiles(8, 16, 128, warps=2, stages=2)),  # fp32 scales
        (2, 128, 64, 2, 32, "q8_0", GemvTiles()),  # int8 rows, fp16 scales a 32
        (1, 160, 96, 4, 16, "q6_k", GemvTiles(64, 64, 64)),  # int8, fp32 scales a 16, masked columns, K tails
        (3, 128, 64, 2, 32, "q4_k_m", GemvTiles()),  # gate / up Q4_K, down Q6_K
        (2, 128, 64, 2, 32, "act_order", GemvTiles()),  # x and the activations read through the perms
        (1, 160, 96, 2, 32, "act_order", GemvTiles(64, 64, 64)),  # the same with K tails
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gemv_matches_the_reference(
    monkeypatch, tokens, hidden, inter, top_k, group, kind, tiles, dtype
) -> None:
    """fp32 x takes q itself (exact products), fp16 the magic planes; both within the reference's rounding of the
    dequantized weights, and the GEMVs are what ran."""
    gate_up, down = calls_of(monkeypatch, "gate_up_gemv"), calls_of(monkeypatch, "down_gemv")
    x, _, _, weights, ids = moe_inputs(tokens, hidden, inter, 8, top_k, dtype, seed=tokens + group)
    w13, w2 = stacks(hidden, inter, 8, group, kind)
    expected = fused_moe_reference(x, w13, w2, weights, ids)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(
        fused_moe_triton(x, w13, w2, weights, ids, gemv=tiles), expected, atol=tol, rtol=tol
    )
    assert (len(gate_up), len(down)) == (1, 1)


def test_gemv_agrees_with_the_grouped_kernels() -> None:
    """The same pairs through the grouped kernels (gemv=None), which round each dequantized weight first."""
    x, _, _, weights, ids = moe_inputs(4, 128, 64, 8, 2, torch.float16, seed=11)
    w13, w2 = stacks(128, 64, 8, 32, "zeros")
    torch.testing.assert_close(
        fused_moe_triton(x, w13, w2, weights, ids),
        fused_moe_triton(x, w13, w2, weights, ids, gemv=None),
        atol=2e-3,
        rtol=2e-3,
    )


def test_gemv_choices_of_experts_held_elsewhere_add_nothing() -> None:
    """Expert parallelism: a choice of expert E or past it contributes zero, as in the grouped kernels."""
    x, _, _, weights, ids = moe_inputs(3, 64, 32, 4, 2, torch.float32, seed=5)
    w13, w2 = stacks(64, 32, 4, 32, "zeros")
    elsewhere = torch.where(ids >= 2, 2, ids)  # this rank holds experts 0 and 1 of 4
    here = Int4Experts(w13.qweight[:2], w13.scales[:2], w13.zeros[:2], 32)
    here2 = Int4Experts(w2.qweight[:2], w2.scales[:2], w2.zeros[:2], 32)
    masked = torch.where(ids < 2, weights, torch.zeros_like(weights))
    expected = fused_moe_reference(x, w13, w2, masked, ids)
    torch.testing.assert_close(fused_moe_triton(x, here, here2, weights, elsewhere), expected)


def test_pair_counts_and_stacks_that_take_the_gemv(monkeypatch) -> None:
    """Up to GEMV_MAX_PAIRS pairs, and GEMV_PAIRS_PER_EXPERT an expert, each quantized stack takes its GEMV (a dense
    stack beside it its grouped kernel); past either, both take the grouped kernels."""
    gate_up, down = calls_of(monkeypatch, "gate_up_gemv"), calls_of(monkeypatch, "down_gemv")
    experts = GEMV_MAX_PAIRS // GEMV_PAIRS_PER_EXPERT  # both bounds at GEMV_MAX_PAIRS pairs
    w13, w2 = stacks(64, 32, experts, 32, "zeros")
    x, dense13, _, weights, ids = moe_inputs(GEMV_MAX_PAIRS // 2, 64, 32, experts, 2, torch.float32, seed=6)
    torch.testing.assert_close(
        fused_moe_triton(x, dense13, w2, weights, ids), fused_moe_reference(x, dense13, w2, weights, ids)
    )
    assert (len(gate_up), len(down)) == (0, 1)
    x, _, _, weights, ids = moe_inputs(GEMV_MAX_PAIRS // 2 + 1, 64, 32, experts, 2, torch.float32, seed=7)
    torch.testing.assert_close(
        fused_moe_triton(x, w13, w2, weights, ids), fused_moe_reference(x, w13, w2, weights, ids)
    )
    assert (len(gate_up), len(down)) == (0, 1)
    few = stacks(64, 32, 4, 32, "zeros")  # Mixtral's proportions: 8 tokens of top 2 over 4 experts
    x, _, _, weights, ids = moe_inputs(GEMV_PAIRS_PER_EXPERT * 2 + 1, 64, 32, 4, 2, torch.float32, seed=8)
    torch.testing.assert_close(
        fused_moe_triton(x, *few, weights, ids), fused_moe_reference(x, *few, weights, ids)
    )
    assert (len(gate_up), len(down)) == (0, 1), "18 pairs over 4 experts: the grouped kernels"


@pytest.mark.parametrize(
    ("tokens", "experts", "held", "first", "top_k", "renormalize", "round_to", "dtype"),
    [
        (1, 8, 8, 0, 2, True, torch.float16, torch.float16),  # Qwen's renormalised weights, rounded
        (2, 16, 16, 0, 4, False, None, torch.float32),  # Mixtral's... as they are
        (
            3,
            8,
            4,
            4,
            2,
            True,
            torch.float16,
            torch.float16,
        ),  # expert parallelism: this rank holds experts 4-7
    ],
)
def test_gate_up_gemv_routes_as_the_route_kernel(
    monkeypatch, tokens, experts, held, first, top_k, renormalize, round_to, dtype
) -> None:
    """With routing, the gate_up GEMV picks each pair's expert from its token's logits and writes the pair's expert
    and weight for the down GEMV: the layer's output bit for bit that of routing first (kernels/moe_route.py), and no
    route ran."""
    from kernels.moe_route import Routing, route_triton

    monkeypatch.setattr(Routing, "in_kernel", lambda self: True)  # the interpreter's logits are on the CPU
    monkeypatch.setattr(Routing, "route", lambda self: pytest.fail("routed before the GEMV"))
    gate_up = calls_of(monkeypatch, "gate_up_gemv")
    x, _, _, _, _ = moe_inputs(tokens, 128, 64, held, top_k, dtype, seed=tokens)
    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(tokens)).to(dtype)
    w13, w2 = stacks(128, 64, held, 32, "zeros")
    routing = Routing(logits, top_k, renormalize, round_to, first, held)
    routed = fused_moe_triton(x, w13, w2, None, None, summed=False, routing=routing)
    weights, ids = route_triton(logits, top_k, renormalize, round_to, first, held)
    assert torch.equal(routed, fused_moe_triton(x, w13, w2, weights, ids, summed=False))
    assert len(gate_up) == 2


def test_every_kind_compiles_for_hopper() -> None:
    """The compiler builds what the interpreter never looks at (a constexpr branch not taken, pointer dtypes): each
    kind of stack and dtype compiled for sm_90 in a process of its own, no GPU needed, with nothing spilled; the
    grouped kernels of each kind at decode's and prefill's tiles and their act-order gather too."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-m", "bench.sass", "--moe"], env=env, capture_output=True, text=True, timeout=600,
        cwd=Path(__file__).resolve().parent.parent,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    compiled = [line for line in done.stdout.splitlines() if "_kernel:" in line]
    assert len([line for line in compiled if "_gemv_kernel:" in line]) == 20, done.stdout
    assert len([line for line in compiled if "routed _gate_up_gemv_kernel:" in line]) == 4, done.stdout
    spilled = [line for line in compiled if "LOCAL:0 " not in line or "STACK:0 " not in line]
    assert len(compiled) == 35 and not spilled, done.stdout
