"""W4A16 GEMM: y = x W^T (+ bias) for int4 weights with group-wise scales and zeros (kernels/int4_dequant.py
has the layout), activations bf16, fp16 or fp32.

Weights in the fragment layout (groups of a multiple of 64 rows, loaded on a GPU: kernels/int4_dequant.py) take
kernels/w4a16_wgmma.py at its MIN_ROWS..MAX_ROWS (33..256) rows of 16-bit x on Hopper (integer zeros; unless
PDSERVE_WGMMA=0), kernels/w4a16_mma.py at up to its MAX_ROWS (64) rows otherwise, else dequantize + the dense
GEMM. For the rows layout, paths by the number of rows M:
- M = 1 (batch-1 decode), any activations and groups: the CUDA-core kernel below, with 512-row K tiles of 16
  output columns: each column's tile is a 256-byte run of its K-contiguous words, and the tiles alone fill
  the GPU, so no split-K. On the H200 this reads 0.42 of the copy bandwidth, 128-row tiles with split-K
  0.34 (bench/quant_int4.py).
- 2 <= M < DEQUANT_MIN_M, 16-bit activations, groups a multiple of BLOCK_K (AWQ, GPTQ): the swapped kernel,
  out^T = W x^T on the tensor cores, the weights as the wide operand (BLOCK_N output columns as the MMA's
  rows) and x^T, padded to 8 or 16 rows, as the narrow one. A K tile is again 16 packed rows; for
  j = 0..3 one shift and one LOP3 per int32 give nibbles j and j + 4 as two 16-bit magic + q values, the
  register pair that the MMA reads as two adjacent k: the dot's k order is (packed row, j / j + 4), and x's
  tile, loaded once, is regrouped into that order in registers. A nibble costs half a shift and half a LOP3;
  the scale, zero and magic go on once per tile as below. The weights are laid K-contiguous (qweight's stride (1, K/8)) so each
  output column's 16 words of a tile are one 64-byte run: 16-byte async copies.
- The CUDA-core kernel (one row, or a config that asks for it with up to 4 rows a program): a program owns
  BLOCK_N output columns of its rows; a K tile is block_k / 8 packed rows, each output column's words one
  contiguous run, and x's block_k columns are one contiguous load split in registers by nibble. Three shifts per
  word (8 either way, and a rotation by 16) and one LOP3 per nibble put each nibble in an fp32 mantissa under
  a fixed exponent: 128 + q at bits 16..19, 2048 + q at bits 12..15 (exact, as is its product with a
  16-bit x); one FMA each. The magics' share, 128 sum x + 1920 sum x_odd, comes off with the zero. Masks
  are passed as arguments: as constants the compiler rebuilds them before every LOP3. About 3.2 SASS
  instructions per weight with the tile in one group, ~5 with a scale and zero per packed row (the one-row
  default's 512-row tiles span 4 groups of 128; summing each group before its scale costs shared-memory
  round trips instead). fp32 x takes q itself (exact products). Several rows share each decoded nibble,
  but at 2 rows the swapped kernel stays faster (0.34 of copy against 0.31). For gate_up at one row
  (`w4a16_swiglu`, SWIGLU) a program's columns are its outputs' gate columns, then their up columns, and
  its epilogue writes silu(gate) * up, rounded as the GEMM and kernels/silu_and_mul.py round them.
- 2 <= M < DEQUANT_MIN_M otherwise, one kernel. Each program owns a (BLOCK_M, BLOCK_N) output tile and a range of K
  tiles. A K tile is BLOCK_K = 128 input rows: 16 packed int32 rows of BLOCK_N columns, loaded once; for
  j = 0..7 nibble j of every int32 is input row 8r + j, and x's matching columns (stride 8) meet it. The
  scale and zero go on after the products where the group allows:

      sum_k (q_k s - z s) x_k = s * sum_k q_k x_k + (-z s) * sum_k x_k        (one group)

  - groups a multiple of the tile: per nibble one tl.dot of depth 16 with 128 + q (bf16) or 1024 + q
    (fp16) built from the bits as x's own type, the tile's scale and zero after the 8 dots;
  - smaller groups: each weight dequantized (fp32, then x's dtype) before its dot.
  fp32 activations take q itself (exact products, IEEE dots).
- Split-K (small M, decode): when the output tiles alone cannot fill the GPU, SPLIT_K programs share a
  tile's K range. Each writes its fp32 partial to a workspace and takes a ticket from the tile's counter
  (atomic, acquire-release); the last to arrive sums the partials in split order (deterministic), writes
  the output and resets the counter to 0. One launch, no host sync, a fixed counter buffer per device:
  capturable in a CUDA graph. 2..16 rows run as one 16-row tile.
- M >= DEQUANT_MIN_M (prefill): dequantize into a dense weight, then the dense GEMM (cuBLAS).

The torch reference (the CPU path): dequantize, then F.linear.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import _backend, w4a16_mma, w4a16_wgmma
from kernels.int4_dequant import Int4Weight, int4_dequant, int4_dequant_reference, int4_values
from kernels.silu_and_mul import silu_and_mul, silu_mul

BLOCK_K = 128  # input rows per K tile: 16 packed rows, tl.dot depth 16 per nibble
# from this many rows: dequantize + dense GEMM. Measured on the H200 (bench/quant_int4.py, a Llama-3-8B layer):
# the tiled kernel takes 469 us at M = 32 against 272 for dequantize + cuBLAS, and falls further behind with M
# (3,082 against 326 at M = 256), so only the split-K rows (M <= 16) take the kernel
DEQUANT_MIN_M = 17
NUM_LOCKS = 1 << 14  # split-K tile counters per device
PROGRAMS_PER_SM = 4  # split-K aims at this many programs per SM
# the swapped kernel's tile, warps, stages and split-K target
SWAP_BLOCK_N, SWAP_WARPS, SWAP_STAGES, SWAP_PROGRAMS_PER_SM = 64, 4, 3, 8
# the CUDA-core kernel's at one row: 16 columns of 512-row K tiles, no split (the tiles fill the GPU), 4 stages
# (qkv, o and down of a Llama-3-8B layer 31.4 us against 33.0 at 3, H200)
GEMV_BLOCK_N, GEMV_BLOCK_K, GEMV_WARPS, GEMV_STAGES = 16, 512, 4, 4
# gate_up ending in SwiGLU at one row: 32 columns a program (16 outputs), 27.4 us against 16 columns' 30.6 for the
# Llama-3-8B layer's, and 3 stages (4: 28.3); the other GEMMs are fastest at 16 and slower with split-K
# (bench/results/quant_w4a16_m1_sweep)
GEMV_SWIGLU_BLOCK_N, GEMV_SWIGLU_STAGES = 32, 3


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 3
    swap: bool = False  # the swapped kernel (16-bit x, groups a multiple of BLOCK_K); block_m 8 or 16 then
    cuda_cores: bool = False  # the CUDA-core kernel, which block_m 1 always takes
    block_k: int = BLOCK_K  # input rows per K tile: the CUDA-core kernel takes any power of two from 128


@triton.jit
def _nibble_plus_128(packed, j: tl.constexpr):
    """Nibble j of every int32 as the fp32 value 128 + q: moved to bits 16..19 under 128.0's exponent, where the
    mantissa's bits count 1, 2, 4 and 8. One shift and one LOP3; (128 + q) * x is exact for 16-bit x."""
    if j <= 4:
        bits = (packed << (16 - 4 * j)) & 0xF0000
    else:
        bits = (packed >> (4 * j - 16)) & 0xF0000
    return (bits | 0x43000000).to(tl.float32, bitcast=True)


@triton.jit
def x_columns(perm_ptr, cols, mask, HAS_PERM: tl.constexpr):
    """x's columns for layout rows `cols`: perm[cols] under GPTQ act order."""
    if HAS_PERM:
        cols = tl.load(perm_ptr + cols, mask=mask, other=0)
    return cols


@triton.jit
def _x_tile(x_ptr, offs_m, stride_xm, perm_ptr, cols, mask_m, mask_r, HAS_PERM: tl.constexpr):
    """(BLOCK_M, R) of x: its rows offs_m at the columns of layout rows `cols`."""
    cols = x_columns(perm_ptr, cols, mask_r, HAS_PERM)
    return tl.load(
        x_ptr + offs_m[:, None] * stride_xm + cols[None, :], mask=mask_m[:, None] & mask_r[None, :], other=0.0
    )


@triton.jit
def _nibble_plus_magic(packed, rot, j: tl.constexpr, mask_hi, mask_lo):
    """Nibble j of every int32 as an fp32 magic + q, from the word, the word shifted 8 either way, or the word
    rotated 16 (`rot`): nibbles 0, 2, 4, 6 land at bits 16..19 under 128.0's exponent (128 + q), nibbles
    1, 3, 5, 7 at bits 12..15 under 2048.0's (2048 + q). One LOP3 each, with three shifts per word; both
    products with a 16-bit x are exact. The masks 0xF0000 and 0xF000 come in as arguments: as constants
    the compiler rebuilds them in a register before every LOP3."""
    if j == 0:
        bits = (rot & mask_hi) | 0x43000000
    elif j == 1:
        bits = ((packed << 8) & mask_lo) | 0x45000000
    elif j == 2:
        bits = ((packed << 8) & mask_hi) | 0x43000000
    elif j == 3:
        bits = (packed & mask_lo) | 0x45000000
    elif j == 4:
        bits = (packed & mask_hi) | 0x43000000
    elif j == 5:
        bits = ((packed >> 8) & mask_lo) | 0x45000000
    elif j == 6:
        bits = ((packed >> 8) & mask_hi) | 0x43000000
    else:
        bits = (rot & mask_lo) | 0x45000000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _outer(plane, x):
    """A (BLOCK_N, R) plane against x's (R,) row or (BLOCK_M, R) rows: (BLOCK_N, R) or (BLOCK_M, BLOCK_N, R)."""
    if len(x.shape) == 1:
        out = plane * x[None, :]
    else:
        out = plane[None, :, :] * x[:, None, :]
    return out


@triton.jit
def _by_nibble(x_tile, R: tl.constexpr):
    """(BLOCK_M, 8R) or (8R,) -> 8 tensors (BLOCK_M, R) or (R,): column 8r + j goes to the j-th, at r. One
    contiguous load of the tile and splits in registers, where 8 strided loads cost a load and a conversion
    per element."""
    if len(x_tile.shape) == 1:
        even, odd = tl.split(tl.reshape(x_tile, (R, 2, 2, 2)))  # by bit 0 of j
    else:
        even, odd = tl.split(tl.reshape(x_tile, (x_tile.shape[0], R, 2, 2, 2)))
    j0, j4 = tl.split(tl.split(even)[0])
    j2, j6 = tl.split(tl.split(even)[1])
    j1, j5 = tl.split(tl.split(odd)[0])
    j3, j7 = tl.split(tl.split(odd)[1])
    return j0, j1, j2, j3, j4, j5, j6, j7


@triton.jit
def nibble_products(
    packed, x_tile, mask_hi, mask_lo, shape: tl.constexpr, R: tl.constexpr, EXACT: tl.constexpr
):
    """A K tile's products on the CUDA cores: packed (BLOCK_N, R) words, 8 input rows a word, against x's (8R,)
    row or (BLOCK_M, 8R) rows. Returns part = sum_j plane_j * x_j, (BLOCK_N, R) or (BLOCK_M, BLOCK_N, R), where
    plane_j is nibble j as magic_j + q (q itself when EXACT: fp32 x, exact products), and per packed row x's sum
    and sum_j magic_j x_j (zero when EXACT), the terms the zero and the magic take off. `shape`: part's. (Summed
    from zeros: starting from the first product cost the one-row kernel 16 more registers.)"""
    u = packed.to(tl.uint32, bitcast=True)
    rot = ((u << 16) | (u >> 16)).to(tl.int32, bitcast=True)
    x_by_j = _by_nibble(x_tile.to(tl.float32), R)  # x at input rows 8r + j, for each j
    part = tl.zeros(shape, dtype=tl.float32)
    x_sum = tl.zeros(x_by_j[0].shape, dtype=tl.float32)
    x_odd = tl.zeros(x_by_j[0].shape, dtype=tl.float32)  # x of the odd nibbles: magic 2048, not 128
    for j in tl.static_range(8):
        xj = x_by_j[j]
        x_sum += xj
        if EXACT:
            part += _outer(int4_values(packed, j), xj)
        else:
            part += _outer(_nibble_plus_magic(packed, rot, j, mask_hi, mask_lo), xj)
            if j % 2 == 1:
                x_odd += xj
    x_magic = 128.0 * x_sum + 1920.0 * x_odd
    if EXACT:
        x_magic = tl.zeros(x_sum.shape, dtype=tl.float32)
    return part, x_sum, x_magic


@triton.jit
def scaled_by_group(
    acc, acc_r, part, x_sum, x_magic, s_ptr, z_ptr, t, prow, offs_n, mask_n, mask_w, stride_sg,
    GROUP: tl.constexpr, BLOCK_K: tl.constexpr, ZERO_IS_OFFSET: tl.constexpr,
):  # fmt: skip
    """nibble_products' terms of K tile t scaled into the accumulators: acc (BLOCK_M, BLOCK_N) takes the zero and
    magic terms, acc_r ((BLOCK_N, R) at one row, else (BLOCK_M, BLOCK_N, R)) the scaled products. Scales and zeros
    at s_ptr / z_ptr + group * stride_sg + column."""
    ONE: tl.constexpr = len(acc_r.shape) == 2
    if GROUP % BLOCK_K == 0:  # the tile in one group: one scale and zero per column
        g_off = ((t * BLOCK_K) // GROUP) * stride_sg + offs_n
        s = tl.load(s_ptr + g_off, mask=mask_n, other=0.0).to(tl.float32)  # (BLOCK_N,)
        z = tl.load(z_ptr + g_off, mask=mask_n, other=0).to(tl.float32)
        if not ZERO_IS_OFFSET:
            z = -z * s  # w = q * s - z * s, exact in fp32
        acc_r += part * s[:, None]  # the scale per column (broadcast over the rows' leading dim)
        x_total = tl.sum(x_sum, 0) if ONE else tl.sum(x_sum, 1)[:, None]
        magic_total = tl.sum(x_magic, 0) if ONE else tl.sum(x_magic, 1)[:, None]
        acc += z[None, :] * x_total - s[None, :] * magic_total
    else:  # smaller groups: a scale and zero per packed row (a group holds whole packed rows)
        g_off = ((prow * 8) // GROUP)[None, :] * stride_sg + offs_n[:, None]
        s = tl.load(s_ptr + g_off, mask=mask_w, other=0.0).to(tl.float32)  # (BLOCK_N, R)
        z = tl.load(z_ptr + g_off, mask=mask_w, other=0).to(tl.float32)
        if not ZERO_IS_OFFSET:
            z = -z * s
        acc_r += part * s + _outer(z, x_sum) - _outer(s, x_magic)
    return acc, acc_r


@triton.jit
def _w4a16_gemv_kernel(
    # pointers
    x_ptr,
    qw_ptr,
    s_ptr,
    z_ptr,
    perm_ptr,
    bias_ptr,
    out_ptr,
    ws_ptr,
    lock_ptr,
    # sizes
    M,
    N,
    K,
    tiles_per_split,
    # strides
    stride_xm,
    stride_om,
    stride_qk,
    stride_qn,
    # the nibble masks (see _nibble_plus_magic)
    mask_hi,
    mask_lo,
    # meta
    GROUP: tl.constexpr,
    ZERO_IS_OFFSET: tl.constexpr,
    HAS_PERM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    EVEN_K: tl.constexpr,
    EXACT: tl.constexpr,
    SWIGLU: tl.constexpr,  # N columns of (gate | up): out = silu(gate) * up, N / 2 columns
):
    """BLOCK_M rows of x against BLOCK_N output columns per program, over its split's K tiles, on the CUDA
    cores: each nibble is decoded once and meets every row."""
    pid_mn, pid_k = tl.program_id(0), tl.program_id(1)
    num_n = tl.cdiv(N, BLOCK_N)
    offs_m = (pid_mn // num_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = (pid_mn % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    outs = (pid_mn % num_n) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)  # SWIGLU: this program's outputs
    if SWIGLU:  # their gate columns, then their up columns: two contiguous runs, as the scales' loads want
        HALF: tl.constexpr = BLOCK_N // 2
        pair = (pid_mn % num_n) * HALF + tl.arange(0, BLOCK_N) % HALF
        offs_n = pair + (tl.arange(0, BLOCK_N) // HALF) * (N // 2)
        mask_n = pair < N // 2
    R: tl.constexpr = BLOCK_K // 8  # packed rows per K tile
    rows = tl.arange(0, R)
    # one row: (BLOCK_N, R) products and (R,) x, as 2-D and 1-D tensors (a leading dim of 1 costs the layouts
    # their registers-only split of x); more rows: (BLOCK_M, BLOCK_N, R) and (BLOCK_M, R)
    ONE: tl.constexpr = BLOCK_M == 1
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # the zero and magic terms
    acc_r = tl.zeros((BLOCK_N, R) if ONE else (BLOCK_M, BLOCK_N, R), dtype=tl.float32)  # scaled products
    first = pid_k * tiles_per_split
    last = tl.minimum(first + tiles_per_split, tl.cdiv(K, BLOCK_K))
    for t in tl.range(first, last, num_stages=NUM_STAGES):
        prow = t * R + rows
        mask_r = prow < K // 8
        mask_w = mask_n[:, None] & mask_r[None, :]
        if EVEN_K:
            mask_w = mask_n[:, None]
        packed = tl.load(
            qw_ptr + offs_n[:, None] * stride_qn + prow[None, :] * stride_qk, mask=mask_w, other=0
        )  # (BLOCK_N, R)
        cols = t * BLOCK_K + tl.arange(0, BLOCK_K)
        if ONE:
            x_row = x_ptr + (pid_mn // num_n) * stride_xm
            if EVEN_K:
                x_tile = tl.load(x_row + x_columns(perm_ptr, cols, cols < K, HAS_PERM))
            else:
                x_tile = tl.load(
                    x_row + x_columns(perm_ptr, cols, cols < K, HAS_PERM), mask=cols < K, other=0.0
                )
        else:
            x_tile = _x_tile(x_ptr, offs_m, stride_xm, perm_ptr, cols, mask_m, cols < K, HAS_PERM)
        part, x_sum, x_magic = nibble_products(packed, x_tile, mask_hi, mask_lo, acc_r.shape, R, EXACT)
        acc, acc_r = scaled_by_group(
            acc, acc_r, part, x_sum, x_magic, s_ptr, z_ptr, t, prow, offs_n, mask_n, mask_w, N,
            GROUP, BLOCK_K, ZERO_IS_OFFSET,
        )  # fmt: skip
    acc += tl.sum(acc_r, 1)[None, :] if ONE else tl.sum(acc_r, 2)
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    bias = tl.zeros((1, BLOCK_N), dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if SWIGLU:  # one row, no split: gate and up rounded as the unfused GEMM writes them
        dtype = out_ptr.dtype.element_ty
        gate, up = tl.split(tl.permute(tl.reshape(acc + bias, (2, BLOCK_N // 2)), (1, 0)))
        tl.store(out_ptr + offs_m * stride_om + outs, silu_mul(gate.to(dtype), up.to(dtype)).to(dtype),
                 mask=outs < N // 2)  # fmt: skip
    else:
        _finish(
            acc, bias, out_ptrs, mask_m[:, None] & mask_n[None, :], ws_ptr, lock_ptr, pid_mn, pid_k, SPLIT_K
        )


@triton.jit
def _w4a16_kernel(
    # pointers
    x_ptr,
    qw_ptr,
    s_ptr,
    z_ptr,
    perm_ptr,
    bias_ptr,
    out_ptr,
    ws_ptr,
    lock_ptr,
    # sizes
    M,
    N,
    K,
    tiles_per_split,
    # strides
    stride_xm,
    stride_om,
    stride_qk,
    stride_qn,
    # meta
    GROUP: tl.constexpr,
    ZERO_IS_OFFSET: tl.constexpr,
    HAS_PERM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    EVEN_K: tl.constexpr,
    POST_SCALE: tl.constexpr,
    EXACT: tl.constexpr,
    MAGIC_BITS: tl.constexpr,
    MAGIC_VALUE: tl.constexpr,
):
    pid_mn, pid_k = tl.program_id(0), tl.program_id(1)
    num_n = tl.cdiv(N, BLOCK_N)
    offs_m = (pid_mn // num_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = (pid_mn % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    R: tl.constexpr = BLOCK_K // 8  # packed rows per K tile
    rows = tl.arange(0, R)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    magic = 0.0 if EXACT else MAGIC_VALUE  # what the dots' nibble planes carry on top of q
    first = pid_k * tiles_per_split
    last = tl.minimum(first + tiles_per_split, tl.cdiv(K, BLOCK_K))
    for t in tl.range(first, last, num_stages=NUM_STAGES):
        prow = t * R + rows  # (R,) packed rows of this K tile
        mask_r = prow < K // 8
        mask_w = mask_r[:, None] & mask_n[None, :]
        if EVEN_K:  # the weight tile masked along K only where a tile runs past it
            mask_w = mask_n[None, :]
        packed = tl.load(
            qw_ptr + prow[:, None] * stride_qk + offs_n[None, :] * stride_qn, mask=mask_w, other=0
        )
        if GROUP % BLOCK_K == 0:  # the whole tile in one group: one row of scales and zeros, loaded 1-D (the
            # tile's column layout, no conversion)
            g_off = ((t * BLOCK_K) // GROUP) * N + offs_n
            s = tl.load(s_ptr + g_off, mask=mask_n, other=0.0).to(tl.float32)[None, :]  # (1, BLOCK_N)
            z = tl.load(z_ptr + g_off, mask=mask_n, other=0).to(tl.float32)[None, :]
        else:
            g_off = ((prow * 8) // GROUP)[:, None] * N + offs_n[None, :]
            s = tl.load(s_ptr + g_off, mask=mask_w, other=0.0).to(tl.float32)  # (R, BLOCK_N)
            z = tl.load(z_ptr + g_off, mask=mask_w, other=0).to(tl.float32)
        if not ZERO_IS_OFFSET:
            z = -z * s  # w = q * s - z * s, exact in fp32
        if POST_SCALE:  # raw nibbles through the dots, the tile's one scale and zero after them
            dots = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            x_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
            for j in tl.static_range(8):
                xj = _x_tile(x_ptr, offs_m, stride_xm, perm_ptr, prow * 8 + j, mask_m, mask_r, HAS_PERM)
                if EXACT:
                    dots = tl.dot(xj, _nibble_plus_128(packed, j) - 128.0, dots, input_precision="ieee")
                else:  # magic + q in x's own 16-bit type, straight from the bits: exact, no conversion
                    qj = (((packed >> (4 * j)) & 0xF) | MAGIC_BITS).to(tl.int16).to(xj.dtype, bitcast=True)
                    dots = tl.dot(xj, qj, dots)
                x_sum += tl.sum(xj.to(tl.float32), 1)
            acc += dots * s + x_sum[:, None] * (z - magic * s)
        else:  # groups smaller than the tile: each weight dequantized before the dots
            for j in tl.static_range(8):
                w = int4_values(packed, j) * s + z  # (R, BLOCK_N)
                xj = _x_tile(x_ptr, offs_m, stride_xm, perm_ptr, prow * 8 + j, mask_m, mask_r, HAS_PERM)
                if EXACT:
                    acc = tl.dot(xj, w.to(xj.dtype), acc, input_precision="ieee")
                else:
                    acc = tl.dot(xj, w.to(xj.dtype), acc)
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    bias = tl.zeros((1, BLOCK_N), dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    _finish(acc, bias, out_ptrs, mask_m[:, None] & mask_n[None, :], ws_ptr, lock_ptr, pid_mn, pid_k, SPLIT_K)


@triton.jit
def _finish(acc, bias, out_ptrs, mask_o, ws_ptr, lock_ptr, pid_mn, pid_k, SPLIT_K: tl.constexpr):
    """Write a program's output tile (plus bias, broadcast over it). Under split-K each program writes its
    fp32 partial to the workspace and takes a ticket from the tile's counter; the last to arrive sums the
    partials in split order, writes, and resets the counter."""
    if SPLIT_K == 1:
        tl.store(out_ptrs, (acc + bias).to(out_ptrs.dtype.element_ty), mask=mask_o)
    else:
        tile: tl.constexpr = acc.shape[0] * acc.shape[1]
        local = tl.arange(0, acc.shape[0])[:, None] * acc.shape[1] + tl.arange(0, acc.shape[1])[None, :]
        partials = ws_ptr + pid_mn.to(tl.int64) * SPLIT_K * tile + local
        tl.store(partials + pid_k * tile, acc)
        tl.debug_barrier()  # every thread's partial is written before the ticket is taken
        ticket = tl.atomic_add(lock_ptr + pid_mn, 1, sem="acq_rel")
        if ticket == SPLIT_K - 1:  # the last to arrive: sum in split order, write, reset the counter
            total = tl.zeros(acc.shape, dtype=tl.float32)
            for split in tl.static_range(SPLIT_K):
                total += tl.load(partials + split * tile, cache_modifier=".cg")
            tl.store(out_ptrs, (total + bias).to(out_ptrs.dtype.element_ty), mask=mask_o)
            tl.atomic_xchg(lock_ptr + pid_mn, 0)


@triton.jit
def _pairs(packed, j: tl.constexpr, magic_pair: tl.constexpr, dtype: tl.constexpr):
    """(BLOCK_N, R) int32 -> (BLOCK_N, 2R) of 16-bit magic + q: k = 2r + h is nibble j + 4h of word r. One
    shift and one LOP3 per word; each word stays one register, the MMA's pair of adjacent k."""
    pair = ((packed >> (4 * j)) & 0x000F000F) | magic_pair
    lo = pair.to(tl.int16).to(dtype, bitcast=True)
    hi = (pair >> 16).to(tl.int16).to(dtype, bitcast=True)
    return tl.reshape(tl.join(lo, hi), (packed.shape[0], 2 * packed.shape[1]))


@triton.jit
def _w4a16_swap_kernel(
    # pointers
    x_ptr,
    qw_ptr,
    s_ptr,
    z_ptr,
    perm_ptr,
    bias_ptr,
    out_ptr,
    ws_ptr,
    lock_ptr,
    # sizes
    M,
    N,
    K,
    tiles_per_split,
    # strides
    stride_xm,
    stride_om,
    stride_qk,
    stride_qn,
    # meta
    GROUP: tl.constexpr,
    ZERO_IS_OFFSET: tl.constexpr,
    HAS_PERM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    MAGIC_BITS: tl.constexpr,
    MAGIC_VALUE: tl.constexpr,
):
    """(BLOCK_N, BLOCK_M) of out^T per program over its split's K tiles; every tile lies in one group."""
    pid_mn, pid_k = tl.program_id(0), tl.program_id(1)
    num_n = tl.cdiv(N, BLOCK_N)
    offs_m = (pid_mn // num_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = (pid_mn % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    R: tl.constexpr = BLOCK_K // 8  # packed rows per K tile
    rows = tl.arange(0, R)
    all_cols = tl.arange(0, BLOCK_K)
    magic_pair: tl.constexpr = MAGIC_BITS * 65537  # the magic in both 16-bit halves
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    first = pid_k * tiles_per_split
    last = tl.minimum(first + tiles_per_split, K // BLOCK_K)
    for t in tl.range(first, last, num_stages=NUM_STAGES):
        prow = t * R + rows
        packed = tl.load(qw_ptr + prow[None, :] * stride_qk + offs_n[:, None] * stride_qn, mask=mask_n[:, None],
                         other=0)  # (BLOCK_N, R)  # fmt: skip
        g_off = ((t * BLOCK_K) // GROUP) * N + offs_n
        s = tl.load(s_ptr + g_off, mask=mask_n, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g_off, mask=mask_n, other=0).to(tl.float32)
        if not ZERO_IS_OFFSET:
            z = -z * s  # w = q * s - z * s, exact in fp32
        # x's tile, once: its sum carries the zero and the magic,
        #   sum_k (magic + q_k) s x_k + (z - magic s) sum_k x_k,
        # and its columns 8r + 4h + 2b + a, regrouped in registers, are the dots' x^T (j = 2b + a, k = 2r + h)
        x_all = _x_tile(x_ptr, offs_m, stride_xm, perm_ptr, t * BLOCK_K + all_cols, mask_m, all_cols < BLOCK_K,
                        HAS_PERM)  # fmt: skip
        x_sum = tl.sum(x_all.to(tl.float32), 1)  # (BLOCK_M,)
        x_even_b, x_odd_b = tl.split(tl.permute(tl.reshape(x_all, (BLOCK_M, R, 2, 2, 2)), (1, 2, 0, 4, 3)))
        x_0, x_1 = tl.split(x_even_b)  # (R, 2, BLOCK_M) each: r, h, m
        x_2, x_3 = tl.split(x_odd_b)
        dt = x_ptr.dtype.element_ty
        dots = tl.dot(_pairs(packed, 0, magic_pair, dt), tl.reshape(x_0, (2 * R, BLOCK_M)))
        dots = tl.dot(_pairs(packed, 1, magic_pair, dt), tl.reshape(x_1, (2 * R, BLOCK_M)), dots)
        dots = tl.dot(_pairs(packed, 2, magic_pair, dt), tl.reshape(x_2, (2 * R, BLOCK_M)), dots)
        dots = tl.dot(_pairs(packed, 3, magic_pair, dt), tl.reshape(x_3, (2 * R, BLOCK_M)), dots)
        acc += dots * s[:, None] + (z - MAGIC_VALUE * s)[:, None] * x_sum[None, :]
    out_ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
    bias = tl.zeros((BLOCK_N, 1), dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
    _finish(acc, bias, out_ptrs, mask_n[:, None] & mask_m[None, :], ws_ptr, lock_ptr, pid_mn, pid_k, SPLIT_K)


@functools.cache
def _locks(device: torch.device) -> torch.Tensor:
    # made by the first split-K call, which runs eagerly (a graph's warm-up) before any capture
    return torch.zeros(NUM_LOCKS, dtype=torch.int32, device=device)


def default_config(m: int, n: int, k: int, device: torch.device, group: int = BLOCK_K,
                   dtype: torch.dtype = torch.float32) -> GemmConfig:  # fmt: skip
    """One row: the CUDA-core kernel, GEMV_BLOCK_N columns of GEMV_BLOCK_K-row K tiles. Up to 16 rows of 16-bit
    x in groups of a multiple of BLOCK_K: the swapped kernel, x padded to 8 or 16 rows, SWAP_BLOCK_N columns a
    program. Otherwise 16-row tiles up to 16 rows, then 32/64/128. Split-K while the output tiles are fewer than the target programs per SM, each
    split keeping at least one K tile. Tiles, stages and targets: the best of H200 sweeps over a Llama-3-8B
    layer (bench/quant_int4.py --sweep)."""
    if m == 1:  # long K tiles: each output column's tile is a 512-byte run, as DRAM serves best
        block_k = min(GEMV_BLOCK_K, triton.next_power_of_2(k))
        return GemmConfig(1, GEMV_BLOCK_N, 1, GEMV_WARPS, GEMV_STAGES, block_k=block_k)
    k_tiles = triton.cdiv(k, BLOCK_K)
    if m <= 16 and dtype in MAGIC and group % BLOCK_K == 0:
        block_m = 8 if m <= 8 else 16
        tiles = triton.cdiv(m, block_m) * triton.cdiv(n, SWAP_BLOCK_N)
        split = _split(tiles, k_tiles, SWAP_PROGRAMS_PER_SM * _backend.num_sms(device))
        return GemmConfig(block_m, SWAP_BLOCK_N, split, SWAP_WARPS, SWAP_STAGES, swap=True)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 128 else 128
    fast = block_m == 16 and group % BLOCK_K == 0
    block_n = 256 if fast else 128
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split = _split(tiles, k_tiles, PROGRAMS_PER_SM * _backend.num_sms(device))
    warps = 8 if block_m >= 128 else 4
    return GemmConfig(block_m, block_n, split, num_warps=warps, num_stages=2 if fast else 3)


def _split(tiles: int, k_tiles: int, target: int) -> int:
    """The power of two (at most 16, at most the K tiles) that brings the programs nearest under target."""
    split = 1
    while split * 2 <= min(16, k_tiles) and tiles * split * 2 <= target:
        split *= 2
    return split


MAGIC = {torch.bfloat16: (0x4300, 128.0), torch.float16: (0x6400, 1024.0)}  # 16-bit bits of 128 / 1024


def w4a16_gemm_triton(
    x: torch.Tensor,  # (M, K)
    w: Int4Weight,
    bias: torch.Tensor | None = None,  # (N,)
    config: GemmConfig | None = None,
    swiglu: bool = False,  # N columns of (gate | up): silu(gate) * up, (M, N / 2); one row only
) -> torch.Tensor:  # (M, N)
    m, k = x.shape
    n = w.out_features
    assert k == w.in_features, f"x has {k} features, the weight {w.in_features}"
    assert w.layout == "rows", "fragment-laid weights take kernels/w4a16_mma.py"
    assert x.stride(1) == 1, "x's last dim not contiguous"
    assert bias is None or bias.shape == (n,), f"bias {tuple(bias.shape)} for {n} outputs"
    out = torch.empty(m, n // 2 if swiglu else n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    cfg = config or default_config(m, n, k, x.device, w.group_size, x.dtype)
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    cores = cfg.block_m == 1 or cfg.cuda_cores
    assert not swiglu or (
        m == 1 and cfg.block_m == 1 and cfg.split_k == 1 and n % 2 == 0 and cfg.block_n % 2 == 0
    ), f"swiglu runs one row of (gate | up) on the CUDA-core kernel, unsplit: {m} rows, {n} columns, {cfg}"
    assert cfg.block_k == BLOCK_K or cores, f"only the CUDA-core kernel takes K tiles other than {BLOCK_K}"
    k_tiles = triton.cdiv(k, cfg.block_k)
    per_split = triton.cdiv(k_tiles, cfg.split_k)
    split = triton.cdiv(k_tiles, per_split)  # no split without a K tile
    locks = _locks(x.device)
    magic_bits, magic_value = MAGIC.get(x.dtype, (0, 0.0))  # fp32 planes are exact: no magic
    assert split == 1 or tiles <= NUM_LOCKS, f"{tiles} output tiles exceed the {NUM_LOCKS} split-K counters"
    workspace = torch.empty(tiles * split * cfg.block_m * cfg.block_n if split > 1 else 1,
                            dtype=torch.float32, device=x.device)  # fmt: skip
    args = (
        x, w.qweight, w.scales, w.zeros, w.perm if w.perm is not None else w.qweight,
        bias if bias is not None else x, out, workspace, locks,
        m, n, k, per_split,
        x.stride(0), out.stride(0), w.qweight.stride(0), w.qweight.stride(1),
    )  # fmt: skip
    common = dict(
        GROUP=w.group_size, ZERO_IS_OFFSET=w.zero_is_offset, HAS_PERM=w.perm is not None,
        HAS_BIAS=bias is not None, SPLIT_K=split, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=BLOCK_K, NUM_STAGES=cfg.num_stages, MAGIC_BITS=magic_bits, MAGIC_VALUE=magic_value,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if cfg.swap:
        assert x.dtype in MAGIC and w.group_size % BLOCK_K == 0, (
            f"the swapped kernel takes 16-bit x in groups of {BLOCK_K}k"
        )
        _w4a16_swap_kernel[(tiles, split)](*args, **common)
    elif cores:
        del common["MAGIC_BITS"], common["MAGIC_VALUE"]
        common["BLOCK_K"] = cfg.block_k
        _w4a16_gemv_kernel[(tiles, split)](
            *args, 0xF0000, 0xF000, **common, EVEN_K=k % cfg.block_k == 0, EXACT=x.dtype == torch.float32,
            SWIGLU=swiglu,
        )  # fmt: skip
    else:
        _w4a16_kernel[(tiles, split)](
            *args, **common, EVEN_K=k % BLOCK_K == 0, POST_SCALE=w.group_size % BLOCK_K == 0,
            EXACT=x.dtype == torch.float32,
        )  # fmt: skip
    return out


def w4a16_gemm_reference(x: torch.Tensor, w: Int4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, int4_dequant_reference(w, x.dtype), bias)


def w4a16_gemm(
    x: torch.Tensor, w: Int4Weight, bias: torch.Tensor | None = None, ordered: bool = False
) -> torch.Tensor:
    """(M, K) -> (M, N): the kernel the layout takes, fragments (kernels/w4a16_wgmma.py where chosen,
    kernels/w4a16_mma.py at up to its MAX_ROWS rows of 16-bit x on a GPU) or rows (below DEQUANT_MIN_M rows on
    the Triton path), else the dense weight's GEMM. ordered: x's columns already in the fragment layout's K order
    (kernels/int4_dequant.py: layout_column), which only the wgmma kernel takes."""
    if ordered:
        if not (w.layout == "fragments" and w4a16_wgmma.chosen(x, w)):
            raise ValueError(
                "x in the fragment layout's K order goes to the wgmma kernel, which does not take it here"
            )
        return w4a16_wgmma.w4a16_wgmma(x, w, bias, ordered=True)
    if w.layout == "fragments":
        if w4a16_wgmma.chosen(x, w):
            return w4a16_wgmma.w4a16_wgmma(x, w, bias)
        if w4a16_mma.applies(x, w):
            return w4a16_mma.w4a16_mma(x, w, bias)
    elif _backend.use_triton(x) and x.shape[0] < DEQUANT_MIN_M:
        return w4a16_gemm_triton(x, w, bias)
    return F.linear(x, int4_dequant(w, x.dtype), bias)


def w4a16_swiglu(
    x: torch.Tensor,
    w: Int4Weight,
    bias: torch.Tensor | None = None,
    ordered: bool = False,
    out_order: int = 0,
) -> torch.Tensor:
    """(M, K) -> (M, N / 2): silu(gate) * up of x W^T for W = (gate | up), one kernel (the GEMM's epilogue) for up
    to w4a16_mma.MAX_ROWS rows in the fragment layout on a GPU (but the rows kernels/w4a16_wgmma.py takes) and for
    one row in the rows layout on the Triton path, else the GEMM and then the activation, written in out_order's K
    order (0: column order). ordered: as in w4a16_gemm."""
    plain = not ordered and not out_order
    if plain and w.layout == "fragments" and w4a16_mma.swiglu_applies(x, w) and not w4a16_wgmma.chosen(x, w):
        return w4a16_mma.w4a16_mma(x, w, bias, swiglu=True)
    if plain and _backend.use_triton(x) and x.shape[0] == 1 and w.layout == "rows":
        cfg = replace(
            default_config(1, w.out_features, w.in_features, x.device),
            block_n=GEMV_SWIGLU_BLOCK_N,
            num_stages=GEMV_SWIGLU_STAGES,
        )
        return w4a16_gemm_triton(x, w, bias, config=cfg, swiglu=True)
    return silu_and_mul(w4a16_gemm(x, w, bias, ordered), out_order)
