"""A mixture-of-experts FFN: each token's top-k experts' SwiGLU MLPs, weighted by the router and summed.

Weights, per rank (its slice of every expert's intermediate features under tensor parallelism):
- w13 (E, 2 * I, H): each expert's gate rows, then its up rows;
- w2 (E, H, I): each expert's down projection.

On a GPU (and under the interpreter) two grouped GEMMs take every (token, choice) pair of the batch at once,
sorted by expert so that one program's rows share one expert's weights, the scheme of vLLM's and SGLang's
fused MoE:
- `align_pairs` orders the pairs by expert in blocks of BLOCK_M rows, each expert's rows padded to whole blocks
  (a padding row names a pair past the last and is masked). Torch ops only, no host sync, sized for the worst case
  (each chosen expert a block with one pair in it), so a CUDA graph captures it; the blocks past the ones in use
  return at once. Up to SINGLE_PAIRS pairs (decode's few) each pair is a block of its own instead, with no
  alignment at all.
- `_gate_up_kernel`: a block's rows of x against its expert's gate and up columns; silu(gate) * up, a row per
  pair, rounded as the dense MLP rounds them (kernels/silu_and_mul.py).
- `_down_kernel`: those rows against the expert's down projection, times the pair's router weight, a row per
  pair. A token's k rows are then summed, in choice order (`summed=False`: left to the RMSNorm after, which sums
  them as it adds the residual, kernels/fused_add_rmsnorm.py).
Decode's few tokens read each chosen expert's weights once a block; most of a block's rows are padding there,
which costs tensor-core time the GEMV is not bound by. Quantized stacks at decode's few pairs (fused_moe_gemv.chosen)
take kernels/fused_moe_gemv.py instead, where decoding the padded tiles, not reading them, set the time.

Quantized experts are dequantized in the same kernels, a tile at a time in registers, in fp32 (exact: a small
integer times an fp16 scale), rounded to x's dtype:
- Int4Experts (AWQ / GPTQ checkpoints, GGUF Q4_0 / Q4_1 / Q4_K), each expert in kernels/int4_dequant.py's rows
  layout: (q - z) * s with integer zero points, q * s + m with GGUF Q4_1's and Q4_K's float offsets;
- Int8Experts (GGUF Q8_0, Q6_K): q * s, a scale per 32 (16) input features, each expert's rows as the checkpoint's.
Under GPTQ act order an Int4Experts' rows are in group order and its perm gives each row's input feature. Before a
grouped kernel, `_gather_by_perm` lays each pair's row of x (or of the activation) out in its expert's row order, one
contiguous copy, so the kernels' K loops read x as they do without act order; gathering x's columns inside the K loop
took Mixtral-8x7B's 4096-token layer 26x as long (H100). The GEMVs, a pair a program, read them through the perm.
A model's layers need no gather for the activation: `down_order_folded` puts gate's and up's output features in down's
row order at load, so the activation comes out as down reads it and down has no perm (only x is gathered).

A choice of expert E or past it (expert parallelism: another rank's) contributes nothing.

`fused_moe_reference` loops over the experts the batch chose, transformers' order of operations (the CPU path;
quantized experts dequantized first).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import _backend
from kernels.fused_add_rmsnorm import sum_choices_reference
from kernels.fused_moe_gemv import GEMV_TILES, GemvTiles, down_gemv, gate_up_gemv
from kernels.fused_moe_gemv import chosen as gemv_chosen
from kernels.fused_moe_gemv import takes as gemv_takes
from kernels.int4_dequant import unpack_rows
from kernels.moe_route import Routing
from kernels.silu_and_mul import silu_mul

# at most this many (token, choice) pairs take a block each, in pair order, with no alignment: align_pairs' torch
# ops cost ~50 us (H100, in a CUDA graph) against the ~50 us of the kernels at one token of Qwen3-30B-A3B (8 pairs),
# and a token's choices are distinct experts, so no expert is read twice there
SINGLE_PAIRS = 16


def block_m(num_pairs: int) -> int:
    """Rows a program takes: 16 while a step is decode-sized, 64 for prefill's many rows an expert."""
    return 16 if num_pairs <= 256 else 64


@dataclass(frozen=True)
class Tiles:
    """Output columns a program takes in each kernel, its warps, and (None: as block_m, the stack's kind and
    Triton choose) its rows, a dense stack's K tile and the pipeline's stages."""

    gate_up_n: int = 64
    down_n: int = 64
    warps: int = 4
    block_m: int | None = None
    block_k: int | None = None
    stages: int | None = None


# from this many pairs an expert on average, prefill's taller tiles
TALL_ROWS = 256


def tiles(num_pairs: int, num_experts: int, quantized: bool, dtype: torch.dtype = torch.bfloat16) -> Tiles:
    """Measured on an H100 (python -m bench.moe --sweep): up to 64 tokens the default is within 4% of the best of 18;
    with many rows an expert the GEMMs are compute-bound and taller tiles win: at 4096 tokens Qwen3-30B-A3B 1,158
    against 1,512 us, Mixtral-8x7B 5,827 against 9,999. Int4 experts (their tiles dequantized as the MMA's register
    operand) from 256 rows an expert 128 x 128, 8 warps (Mixtral 8,886 against 10,186 us, Qwen3 1,496 against 1,553),
    and from 128 rows 128 x 64, 4 warps, 4 stages (Mixtral at 512 tokens: 1,597 against 1,850). fp32 activations keep
    the default: their exact (not TF32) products at the tall tiles spill 11-16 KB a thread on sm_90."""
    rows = num_pairs / num_experts
    if dtype == torch.float32:
        return Tiles()
    if quantized and rows >= TALL_ROWS:
        return Tiles(128, 128, 8, block_m=128, stages=3)
    if quantized and rows >= TALL_ROWS // 2:
        return Tiles(64, 64, 4, block_m=128, stages=4)
    if rows >= TALL_ROWS:
        return Tiles(128, 128, 8, block_m=128, block_k=64, stages=3)
    return Tiles()


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


@dataclass(frozen=True)
class Int4Experts:
    """Every expert's int4 weight of one projection, each laid as kernels/int4_dequant.py's rows layout (an
    Int4Weight of (K, N) = (input, output) features): qweight (E, K/8, N) int32, scales (E, K/G, N) fp16 (fp32: GGUF
    Q4_K's products d * sc, exact), zeros (E, K/G, N) uint8, expert e's weight w[k, n] = (q[k, n] - z[k // G, n]) *
    s[k // G, n]; or float zeros, GGUF Q4_1's and Q4_K's offsets: w[k, n] = q[k, n] * s[k // G, n] + z[k // G, n].
    perm (E, K) int32, GPTQ act order: expert e's layout row k is its input feature perm[e, k] (rows sorted by group
    at load; the kernels read x, or the activation, through it)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    group_size: int
    perm: torch.Tensor | None = None

    def __post_init__(self) -> None:
        e, k8, n = self.qweight.shape
        groups = (e, k8 * 8 // self.group_size, n)
        if self.group_size % 32 or (k8 * 8) % self.group_size:
            raise ValueError(
                f"int4 experts take groups of a multiple of 32 dividing K={k8 * 8}, not {self.group_size}"
            )
        if tuple(self.scales.shape) != groups or tuple(self.zeros.shape) != groups:
            raise ValueError(
                f"scales {tuple(self.scales.shape)} and zeros {tuple(self.zeros.shape)} must be {groups}"
            )
        floats = (torch.float16, torch.float32)
        if self.zeros.dtype not in (torch.uint8, *floats) or self.scales.dtype not in floats:
            raise ValueError(
                f"int4 experts' scales are fp16 or fp32 and their zeros uint8 zero points or float offsets, not "
                f"{self.scales.dtype}, {self.zeros.dtype}"
            )
        if self.perm is not None and (
            self.perm.dtype != torch.int32 or tuple(self.perm.shape) != (e, k8 * 8)
        ):
            raise ValueError(
                f"perm must be {(e, k8 * 8)} int32, got {tuple(self.perm.shape)} {self.perm.dtype}"
            )

    @property
    def shape(self) -> tuple[int, int, int]:  # (E, N, K), as a dense (E, N, K) stack
        e, k8, n = self.qweight.shape
        return e, n, k8 * 8

    @property
    def zero_is_offset(self) -> bool:
        return self.zeros.is_floating_point()

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:  # (E, N, K), in fp32 as the kernels, rounded
        e, n, k = self.shape
        g = self.group_size
        q = unpack_rows(self.qweight.transpose(0, 1).reshape(k // 8, e * n)).view(k // g, g, e, n).float()
        s = self.scales.float().permute(1, 0, 2)[:, None]  # (K/G, 1, E, N)
        z = self.zeros.float().permute(1, 0, 2)[:, None]
        dense = q * s + z if self.zero_is_offset else q * s - z * s  # exact products in fp32
        dense = dense.reshape(k, e, n).permute(1, 2, 0).to(dtype).contiguous()
        if self.perm is None:
            return dense
        # layout row j is input feature perm[e, j]: back in the checkpoint's input order
        return torch.empty_like(dense).scatter_(2, self.perm.long()[:, None, :].expand(e, n, k), dense)


def down_order_folded(w13: Int4Experts, w2: Int4Experts) -> tuple[Int4Experts, Int4Experts]:
    """w2's act order moved into w13: each expert's gate and up output features (the activation's columns) put in
    the order of down's rows, gate's feature perm[e, j] at column j and up's at I + j, so that the activation comes
    out in down's row order and down needs no perm (nor its gather). The same products: silu(gate) * up pairs column j
    of both halves, and each column's scales and zeros move with it."""
    assert w2.perm is not None, "down has no act order to fold"
    e, n, _ = w13.shape
    inter = w2.shape[2]
    if n != 2 * inter or w2.shape[0] != e:
        raise ValueError(f"w13 {w13.shape} and w2 {w2.shape} are not one layer's (E, 2I, H) and (E, H, I)")
    perm = w2.perm.long().to(w13.qweight.device)
    cols = torch.cat([perm, perm + inter], dim=1)[:, None, :]  # (E, 1, 2I)

    def take(t: torch.Tensor) -> torch.Tensor:
        return t.gather(2, cols.expand(-1, t.shape[1], -1)).contiguous()

    folded = replace(w13, qweight=take(w13.qweight), scales=take(w13.scales), zeros=take(w13.zeros))
    return folded, replace(w2, perm=None)


@dataclass(frozen=True)
class Int8Experts:
    """Every expert's int8 weight of one projection (GGUF Q8_0, Q6_K): qweight (E, N, K) int8, each expert's rows as
    the checkpoint holds them, and scales (E, N, K/G) fp16 or fp32 (Q6_K's d * sc, exact); expert e's weight is
    w[n, k] = q[n, k] * s[n, k // G]."""

    qweight: torch.Tensor
    scales: torch.Tensor
    group_size: int

    def __post_init__(self) -> None:
        e, n, k = self.qweight.shape
        if self.qweight.dtype != torch.int8 or self.scales.dtype not in (torch.float16, torch.float32):
            raise ValueError(
                f"int8 experts are int8 with fp16 or fp32 scales, not {self.qweight.dtype}, {self.scales.dtype}"
            )
        if (
            self.group_size % 16
            or k % self.group_size
            or tuple(self.scales.shape) != (e, n, k // self.group_size)
        ):
            raise ValueError(
                f"scales {tuple(self.scales.shape)} must be {(e, n, k // max(self.group_size, 1))}, in groups of a "
                f"multiple of 16 dividing K={k}, not {self.group_size}"
            )

    @property
    def shape(self) -> tuple[int, int, int]:  # (E, N, K)
        e, n, k = self.qweight.shape
        return e, n, k

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:  # (E, N, K), exact in fp32 then rounded
        scales = self.scales.float().repeat_interleave(self.group_size, dim=-1)
        return (self.qweight.float() * scales).to(dtype)


Experts = torch.Tensor | Int4Experts | Int8Experts  # a dense (E, N, K) stack or quantized experts
# the kinds of stack: dense, int4 with zero points, int4 with float offsets, int8
DENSE: tl.constexpr = tl.constexpr(0)
INT4: tl.constexpr = tl.constexpr(1)
INT4_OFFSETS: tl.constexpr = tl.constexpr(2)
INT8: tl.constexpr = tl.constexpr(3)


@triton.jit
def _dense_tile(w_ptr, expert, k0, ks, cols, n_in, K, stride_we, stride_wn, stride_wk, DT: tl.constexpr):
    """A dense stack's (BLOCK_K, BLOCK_N) tile of expert `expert` at rows k0.. of K and columns `cols`, in DT."""
    k_in = ks + k0 < K
    ptrs = (
        w_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn + (k0 + ks)[:, None] * stride_wk
    )
    return tl.load(ptrs, mask=k_in[:, None] & n_in[None, :], other=0).to(DT)


@triton.jit
def _quant_tile_t(
    w_ptr, s_ptr, z_ptr, expert, k0, cols, n_in,
    stride_we, stride_wn, stride_wk, stride_se, stride_sg, stride_sn,
    KIND: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, DT: tl.constexpr,
):  # fmt: skip
    """A quantized stack's tile transposed, (BLOCK_N, BLOCK_K) at columns `cols` and rows k0.. of K (whole tiles,
    one group a tile), dequantized in fp32 (the references' rounding), in DT: the register operand of
    out^T = W^T x^T, so the tile goes from the dequantizing threads to the tensor cores without a trip through shared
    memory in 2-byte stores. An int4 word's eight nibbles are joined on new last axes: each stays in the thread that
    loaded its word."""
    if KIND == INT8:  # (E, N, K): a column's K contiguous
        ks = tl.arange(0, BLOCK_K) + k0
        ptrs = w_ptr + expert * stride_we + cols[:, None].to(tl.int64) * stride_wn + ks[None, :] * stride_wk
        q = tl.load(ptrs, mask=n_in[:, None], other=0).to(tl.float32)
    else:  # (E, K / 8, N) int32: row 8r + j of K in bits 4j..4j + 3 of word r
        words = tl.arange(0, BLOCK_K // 8) + k0 // 8
        packed = tl.load(
            w_ptr + expert * stride_we + words[None, :] * stride_wk + cols[:, None],
            mask=n_in[:, None],
            other=0,
        )  # (BLOCK_N, BLOCK_K / 8)
        # nibble j lands at flat index j of the three joined axes: join(even, odd), each of those likewise
        even = tl.join(
            tl.join(packed & 0xF, (packed >> 16) & 0xF), tl.join((packed >> 8) & 0xF, (packed >> 24) & 0xF)
        )
        odd = tl.join(
            tl.join((packed >> 4) & 0xF, (packed >> 20) & 0xF),
            tl.join((packed >> 12) & 0xF, (packed >> 28) & 0xF),
        )
        q = tl.reshape(tl.join(even, odd), (BLOCK_N, BLOCK_K)).to(tl.float32)
    group = expert * stride_se + (k0 // GROUP) * stride_sg + cols * stride_sn
    s = tl.load(s_ptr + group, mask=n_in, other=0.0).to(tl.float32)[:, None]
    if KIND == INT8:
        return (q * s).to(DT)
    z = tl.load(z_ptr + group, mask=n_in, other=0).to(tl.float32)[:, None]
    if KIND == INT4_OFFSETS:
        return (q * s + z).to(DT)
    return (q * s - z * s).to(DT)


@triton.jit
def _block_pairs(pair_ptr, expert_ptr, block, num_pairs, BLOCK_M: tl.constexpr, SINGLE: tl.constexpr):
    """Block `block`'s expert and its rows' pairs (num_pairs marks a padding row): from align_pairs' plan, or, SINGLE,
    pair `block` alone in its block, its expert the router's choice itself (expert_ptr: the (T * K,) choices)."""
    expert = tl.load(expert_ptr + block).to(tl.int64)
    if SINGLE:
        pairs = tl.where(tl.arange(0, BLOCK_M) == 0, block, num_pairs)
    else:
        pairs = tl.load(pair_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    return expert, pairs


@triton.jit(do_not_specialize=["num_pairs"])  # a step's pairs: one variant for every batch
def _gate_up_kernel(
    # pointers
    x_ptr,  # (T, H), pair p reading row p // TOP_K; act order: (T * K, H), TOP_K 1 (_gather_by_perm)
    w_ptr,  # (E, 2 * I, H) dense, or int4 qweight (E, H / 8, 2 * I)
    s_ptr,  # int4: scales (E, H / G, 2 * I)
    z_ptr,  # int4: zeros (E, H / G, 2 * I)
    pair_ptr,  # (num_blocks * BLOCK_M,) int32
    expert_ptr,  # (num_blocks,) int32
    used_ptr,  # (1,) int32
    act_ptr,  # (T * K, I)
    # sizes
    num_pairs,
    num_experts,
    H,
    inter,
    # strides
    stride_x,
    stride_we,
    stride_wn,
    stride_wk,
    stride_se,
    stride_sg,
    stride_sn,
    stride_act,
    # meta
    TOP_K: tl.constexpr,
    SINGLE: tl.constexpr,
    KIND: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    block = tl.program_id(0)
    if not SINGLE:  # noqa: SIM102 (the load only where there is a plan)
        if block * BLOCK_M >= tl.load(used_ptr):
            return
    expert, pairs = _block_pairs(pair_ptr, expert_ptr, block, num_pairs, BLOCK_M, SINGLE)
    if expert >= num_experts:  # another rank's expert: the down kernel writes its rows' zeros
        return
    rows = pairs < num_pairs
    tokens = (pairs // TOP_K).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_in = cols < inter
    ks = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + tokens[:, None] * stride_x  # (BLOCK_M, 1)
    dt = act_ptr.dtype.element_ty
    if KIND == DENSE:
        gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            k_in = ks + k0 < H
            a = tl.load(
                x_rows + (ks + k0)[None, :],
                mask=rows[:, None] & k_in[None, :],
                other=0.0,
            )  # (BLOCK_M, BLOCK_K)
            g = _dense_tile(w_ptr, expert, k0, ks, cols, n_in, H, stride_we, stride_wn, stride_wk, dt)
            u = _dense_tile(w_ptr, expert, k0, ks, cols + inter, n_in, H, stride_we, stride_wn, stride_wk, dt)
            gate = tl.dot(a, g, gate, input_precision="ieee")
            up = tl.dot(a, u, up, input_precision="ieee")
    else:  # gate^T = W_gate^T x^T: the dequantized tile is the MMA's register operand
        gate_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        up_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            a = tl.load(x_rows + (ks + k0)[None, :], mask=rows[:, None], other=0.0)  # H: whole K tiles
            g_t = _quant_tile_t(w_ptr, s_ptr, z_ptr, expert, k0, cols, n_in, stride_we, stride_wn, stride_wk,
                                stride_se, stride_sg, stride_sn, KIND, GROUP, BLOCK_K, BLOCK_N, dt)  # fmt: skip
            u_t = _quant_tile_t(w_ptr, s_ptr, z_ptr, expert, k0, cols + inter, n_in, stride_we, stride_wn,
                                stride_wk, stride_se, stride_sg, stride_sn, KIND, GROUP, BLOCK_K, BLOCK_N,
                                dt)  # fmt: skip
            gate_t = tl.dot(g_t, tl.trans(a), gate_t, input_precision="ieee")
            up_t = tl.dot(u_t, tl.trans(a), up_t, input_precision="ieee")
        gate = tl.trans(gate_t)
        up = tl.trans(up_t)
    act = silu_mul(gate.to(dt), up.to(dt))  # each GEMM's output rounded, as the dense MLP's
    dst = act_ptr + pairs[:, None].to(tl.int64) * stride_act + cols[None, :]
    tl.store(dst, act.to(dt), mask=rows[:, None] & n_in[None, :])


@triton.jit(do_not_specialize=["num_pairs"])  # a step's pairs: one variant for every batch
def _down_kernel(
    # pointers
    act_ptr,  # (T * K, I)
    w_ptr,  # (E, H, I) dense, or int4 qweight (E, I / 8, H)
    s_ptr,
    z_ptr,
    weight_ptr,  # (T * K,) fp32: the pairs' router weights
    pair_ptr,
    expert_ptr,
    used_ptr,
    out_ptr,  # (T * K, H)
    # sizes
    num_pairs,
    num_experts,
    H,
    inter,
    # strides
    stride_act,
    stride_we,
    stride_wn,
    stride_wk,
    stride_se,
    stride_sg,
    stride_sn,
    stride_out,
    # meta
    SINGLE: tl.constexpr,
    KIND: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    block = tl.program_id(0)
    if not SINGLE:  # noqa: SIM102 (the load only where there is a plan)
        if block * BLOCK_M >= tl.load(used_ptr):
            return
    expert, pairs = _block_pairs(pair_ptr, expert_ptr, block, num_pairs, BLOCK_M, SINGLE)
    rows = pairs < num_pairs
    pairs64 = pairs.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_in = cols < H
    dst = out_ptr + pairs64[:, None] * stride_out + cols[None, :]
    if expert >= num_experts:  # another rank's expert: it adds nothing here
        tl.store(
            dst,
            tl.zeros((BLOCK_M, BLOCK_N), dtype=out_ptr.dtype.element_ty),
            mask=rows[:, None] & n_in[None, :],
        )
        return
    ks = tl.arange(0, BLOCK_K)
    a_rows = act_ptr + pairs64[:, None] * stride_act  # (BLOCK_M, 1)
    dt = out_ptr.dtype.element_ty
    if KIND == DENSE:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            k_in = ks + k0 < inter
            a = tl.load(
                a_rows + (ks + k0)[None, :],
                mask=rows[:, None] & k_in[None, :],
                other=0.0,
            )  # (BLOCK_M, BLOCK_K)
            w = _dense_tile(w_ptr, expert, k0, ks, cols, n_in, inter, stride_we, stride_wn, stride_wk, dt)
            acc = tl.dot(a, w, acc, input_precision="ieee")
    else:  # out^T = W^T act^T, as in the gate_up kernel
        acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            a = tl.load(a_rows + (ks + k0)[None, :], mask=rows[:, None], other=0.0)  # I: whole K tiles
            w_t = _quant_tile_t(w_ptr, s_ptr, z_ptr, expert, k0, cols, n_in, stride_we, stride_wn, stride_wk,
                                stride_se, stride_sg, stride_sn, KIND, GROUP, BLOCK_K, BLOCK_N, dt)  # fmt: skip
            acc_t = tl.dot(w_t, tl.trans(a), acc_t, input_precision="ieee")
        acc = tl.trans(acc_t)
    weight = tl.load(weight_ptr + pairs64, mask=rows, other=0.0)
    out = acc.to(dt).to(tl.float32) * weight[:, None]  # the expert's output rounded, then weighted
    tl.store(dst, out.to(dt), mask=rows[:, None] & n_in[None, :])


def _weight_args(w: Experts, cfg: Tiles) -> tuple[tuple, dict]:
    """A stack's pointers and strides for _dense_tile / _quant_tile_t: (w, s, z, stride_we, stride_wn, stride_wk, stride_se,
    stride_sg, stride_sn), and its constexprs. A K tile never spans two groups."""
    if isinstance(w, Int4Experts):
        q, s = w.qweight, w.scales
        args = (q, s, w.zeros, q.stride(0), 1, q.stride(1), s.stride(0), s.stride(1), 1)
        kind = INT4_OFFSETS if w.zero_is_offset else INT4
        return args, {
            "KIND": kind.value,
            "GROUP": w.group_size,
            "BLOCK_K": 64 if w.group_size % 64 == 0 else 32,
        }
    if isinstance(w, Int8Experts):
        q, s = w.qweight, w.scales
        args = (q, s, s, q.stride(0), q.stride(1), 1, s.stride(0), 1, s.stride(1))
        return args, {
            "KIND": INT8.value,
            "GROUP": w.group_size,
            "BLOCK_K": 32 if w.group_size % 32 == 0 else 16,
        }
    return (w, w, w, w.stride(0), w.stride(1), 1, 0, 0, 0), {
        "KIND": DENSE.value,
        "GROUP": 1,
        "BLOCK_K": cfg.block_k or 64,
    }


@triton.jit
def _gather_by_perm_kernel(
    src_ptr,  # (rows / DIV, K): a pair's source row is its index // DIV
    perm_ptr,  # (E, K) int32
    expert_ptr,  # (rows,) the pairs' experts
    dst_ptr,  # (rows, K)
    num_experts,
    K,
    stride_src,
    stride_pe,
    stride_dst,
    DIV: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pair = tl.program_id(0).to(tl.int64)
    ks = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    k_in = ks < K
    # another rank's expert (expert parallelism): no kernel reads its pair's row, gathered by the last expert's perm
    expert = tl.minimum(tl.load(expert_ptr + pair).to(tl.int64), num_experts - 1)
    cols = tl.load(perm_ptr + expert * stride_pe + ks, mask=k_in, other=0)
    row = tl.load(src_ptr + (pair // DIV) * stride_src + cols, mask=k_in, other=0.0)
    tl.store(dst_ptr + pair * stride_dst + ks, row, mask=k_in)


def _gather_by_perm(src: torch.Tensor, w: Int4Experts, pair_experts: torch.Tensor, div: int) -> torch.Tensor:
    """(pairs, K): pair p's row of src (row p // div) in its expert's layout order, dst[p, k] = src[p // div,
    perm[e, k]], for the grouped kernels under act order."""
    assert w.perm is not None
    pairs, k = pair_experts.numel(), src.shape[1]
    dst = torch.empty(pairs, k, dtype=src.dtype, device=src.device)
    block = min(1024, triton.next_power_of_2(k))
    _gather_by_perm_kernel[(pairs, triton.cdiv(k, block))](
        src, w.perm, pair_experts, dst, w.perm.shape[0], k, src.stride(0), w.perm.stride(0), dst.stride(0),
        DIV=div, BLOCK=block, num_warps=4,
    )  # fmt: skip
    return dst


def fused_moe_triton(
    x: torch.Tensor,  # (T, H)
    w13: Experts,  # (E, 2 * I, H)
    w2: Experts,  # (E, H, I)
    topk_weights: torch.Tensor | None,  # (T, K) fp32
    topk_ids: torch.Tensor | None,  # (T, K) int
    config: Tiles | None = None,  # None: tiles() picks
    gemv: GemvTiles | None = GEMV_TILES,  # quantized stacks' kernels for decode's few pairs; None: never
    summed: bool = True,  # False: each choice's weighted output, (T, K, H), for the norm after to sum
    routing: Routing | None = None,  # with topk_* None: the logits, routed in the gate_up GEMV or first
) -> torch.Tensor:  # (T, H) in x's dtype
    (tokens, hidden), experts = x.shape, w2.shape[0]
    top_k = routing.top_k if routing is not None else topk_ids.shape[1] if topk_ids is not None else 0
    few = gemv is not None and gemv_chosen(tokens * top_k, experts)
    gemv_gate_up, gemv_down = few and gemv_takes(w13), few and gemv_takes(w2)
    routed_in_gemv = routing is not None and gemv_gate_up and gemv_down and routing.in_kernel()
    if routing is not None and not routed_in_gemv:
        topk_weights, topk_ids = routing.route()
    elif routed_in_gemv:  # written by the gate_up GEMV
        topk_weights = torch.empty(tokens, top_k, dtype=torch.float32, device=x.device)
        topk_ids = torch.empty(tokens, top_k, dtype=torch.int32, device=x.device)
    assert topk_weights is not None and topk_ids is not None, "the router's choices, or routing"
    _check(x, w13, w2, topk_weights, topk_ids)
    inter = w2.shape[2]
    num_pairs = tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x) if summed else x.new_zeros(tokens, top_k, hidden)
    quantized = not (isinstance(w13, torch.Tensor) and isinstance(w2, torch.Tensor))
    cfg = config or tiles(num_pairs, experts, quantized, x.dtype)
    plan = None if gemv_gate_up and gemv_down else _plan(topk_ids, experts, cfg)
    pair_experts = topk_ids.reshape(-1).contiguous()
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    launch = {"num_warps": cfg.warps} | ({"num_stages": cfg.stages} if cfg.stages else {})
    if gemv_gate_up:
        act = gate_up_gemv(
            x, w13, pair_experts, top_k, gemv,  # type: ignore[arg-type]
            routing if routed_in_gemv else None, weights if routed_in_gemv else None,
        )  # fmt: skip
    else:
        assert plan is not None
        act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
        rows, per_token = x, top_k
        if isinstance(w13, Int4Experts) and w13.perm is not None:  # a row a pair, in its expert's order
            rows, per_token = _gather_by_perm(x, w13, pair_experts, top_k), 1
        (w, s, z, *strides), meta = _weight_args(w13, cfg)
        _gate_up_kernel[(plan.num_blocks, triton.cdiv(inter, cfg.gate_up_n))](
            rows, w, s, z, plan.pair_ids, plan.block_experts, plan.used, act, num_pairs, experts, hidden, inter,
            rows.stride(0), *strides, act.stride(0), TOP_K=per_token, SINGLE=plan.single, BLOCK_M=plan.rows,
            BLOCK_N=cfg.gate_up_n, **launch, **meta,
        )  # fmt: skip
    if gemv_down:
        out = down_gemv(act, w2, weights, pair_experts, gemv)  # type: ignore[arg-type]
    else:
        assert plan is not None
        out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
        if isinstance(w2, Int4Experts) and w2.perm is not None:
            act = _gather_by_perm(act, w2, pair_experts, 1)
        (w, s, z, *strides), meta = _weight_args(w2, cfg)
        _down_kernel[(plan.num_blocks, triton.cdiv(hidden, cfg.down_n))](
            act, w, s, z, weights, plan.pair_ids, plan.block_experts, plan.used, out, num_pairs, experts, hidden,
            inter, act.stride(0), *strides, out.stride(0), SINGLE=plan.single, BLOCK_M=plan.rows,
            BLOCK_N=cfg.down_n, **launch, **meta,
        )  # fmt: skip
    per_choice = out.view(tokens, top_k, hidden)
    return _sum_choices(per_choice) if summed else per_choice


@dataclass(frozen=True)
class _Plan:
    """The grouped kernels' blocks: align_pairs' (pair_ids, block_experts, used), or, single, a pair a block."""

    pair_ids: torch.Tensor
    block_experts: torch.Tensor
    used: torch.Tensor
    rows: int  # BLOCK_M
    single: bool

    @property
    def num_blocks(self) -> int:
        return self.block_experts.numel()


def _plan(topk_ids: torch.Tensor, experts: int, cfg: Tiles) -> _Plan:
    num_pairs = topk_ids.numel()
    single = num_pairs <= SINGLE_PAIRS
    rows = block_m(num_pairs) if single or cfg.block_m is None else cfg.block_m
    if single:  # a pair a block, in pair order: no alignment to run (distinct experts at one token)
        block_experts = topk_ids.reshape(-1)
        return _Plan(block_experts, block_experts, block_experts, rows, True)  # pair_ids and used unread
    pair_ids, block_experts, used = align_pairs(topk_ids, experts + 1, rows)  # E: another rank's experts
    return _Plan(pair_ids, block_experts, used, rows, False)


def _sum_choices(per_choice: torch.Tensor) -> torch.Tensor:  # (T, K, H) -> (T, H)
    """A token's K weighted expert outputs summed in fp32, choice 0 first, rounded once: one kernel on the GPU."""
    if _backend.use_triton(per_choice):
        tokens, top_k, hidden = per_choice.shape
        out = torch.empty(tokens, hidden, dtype=per_choice.dtype, device=per_choice.device)
        block = min(1024, triton.next_power_of_2(hidden))
        _sum_choices_kernel[(tokens, triton.cdiv(hidden, block))](
            per_choice, out, hidden, per_choice.stride(0), per_choice.stride(1), out.stride(0), TOP_K=top_k,
            BLOCK=block,
        )  # fmt: skip
        return out
    return sum_choices_reference(per_choice)


@triton.jit
def _sum_choices_kernel(
    src_ptr, out_ptr, H, stride_t, stride_k, stride_o, TOP_K: tl.constexpr, BLOCK: tl.constexpr
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        total += tl.load(src_ptr + t * stride_t + k * stride_k + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o + cols, total.to(out_ptr.dtype.element_ty), mask=mask)


def fused_moe_reference(
    x: torch.Tensor, w13: Experts, w2: Experts, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    summed: bool = True,
) -> torch.Tensor:  # fmt: skip
    """Expert by expert over the tokens that chose it; each expert's output rounded to x's dtype, weighted, and a
    token's choices summed in choice order (as the kernels do; summed=False: (T, K, H), each choice's). Int4
    experts are dequantized first."""
    _check(x, w13, w2, topk_weights, topk_ids)
    if not isinstance(w13, torch.Tensor):
        w13 = w13.dequantize(x.dtype)
    if not isinstance(w2, torch.Tensor):
        w2 = w2.dequantize(x.dtype)
    tokens, top_k = topk_ids.shape
    inter = w2.shape[2]
    per_choice = torch.zeros(tokens, top_k, x.shape[1], dtype=x.dtype, device=x.device)
    for expert in torch.unique(topk_ids).tolist():
        if expert >= w13.shape[0]:
            continue  # another rank's expert (expert parallelism)
        token_idx, choice = torch.where(topk_ids == expert)
        gate_up = F.linear(x[token_idx], w13[expert])
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        out = F.linear(act, w2[expert])
        weight = topk_weights[token_idx, choice].to(torch.float32)[:, None]
        per_choice[token_idx, choice] = (out.to(torch.float32) * weight).to(x.dtype)
    return _sum_choices(per_choice) if summed else per_choice


def fused_moe(
    x: torch.Tensor, w13: Experts, w2: Experts, topk_weights: torch.Tensor | None, topk_ids: torch.Tensor | None,
    summed: bool = True, routing: Routing | None = None,
) -> torch.Tensor:  # fmt: skip
    """(T, H): the layer's output; summed=False: (T, K, H), each choice's weighted output, which
    kernels/fused_add_rmsnorm.py's norm sums as it adds the residual (one kernel fewer a layer). routing, with
    topk_weights and topk_ids None: the router's logits, routed here (kernels/moe_route.py: route), inside the
    gate_up GEMV where decode's quantized stacks take the GEMVs."""
    if _backend.use_triton(x):
        return fused_moe_triton(x, w13, w2, topk_weights, topk_ids, summed=summed, routing=routing)
    if routing is not None:
        topk_weights, topk_ids = routing.route()
    assert topk_weights is not None and topk_ids is not None, "the router's choices, or routing"
    return fused_moe_reference(x, w13, w2, topk_weights, topk_ids, summed)


def _check(
    x: torch.Tensor, w13: Experts, w2: Experts, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> None:
    assert x.dim() == 2 and x.stride(1) == 1, f"x must be (tokens, hidden), got {tuple(x.shape)}"
    experts, two_inter, hidden = w13.shape
    assert hidden == x.shape[1] and two_inter % 2 == 0, f"w13 {tuple(w13.shape)} for x {tuple(x.shape)}"
    assert tuple(w2.shape) == (experts, hidden, two_inter // 2), (
        f"w2 {tuple(w2.shape)} for w13 {tuple(w13.shape)}"
    )
    for w in (w13, w2):
        stride = w.stride(2) if isinstance(w, torch.Tensor) else w.qweight.stride(2)
        assert stride == 1, "expert weights' last dim not contiguous"
    assert topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == x.shape[0], (
        f"topk {tuple(topk_ids.shape)} for x {tuple(x.shape)}"
    )
