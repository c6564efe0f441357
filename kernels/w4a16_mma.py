"""W4A16 GEMM for 1 to 64 rows (MAX_ROWS) on the tensor cores: mma.sync m16n8k16 over int4 weights laid in the
MMA's own fragment order (`layout="fragments"`, kernels/int4_dequant.py), written in Gluon, Triton's explicit-layout
dialect, so that no value crosses lanes or shared memory between its load and its MMA.

- Weights: output columns in blocks of 16, K in chunks of Q * 64 rows (Q = 2 for groups a multiple of 128, else
  1). For each (column block, 64-row quad, lane) one 16-byte load holds four words, one per 16-row k-block; the
  word's nibble r + 4h is the A fragment's register r, half h. Three shifts and four LOP3 (inline PTX: nibbles
  r and r + 4 under the 16-bit type's magic exponent, 128 + q in bf16, 1024 + q in fp16) give one MMA's four A
  registers. Inside a chunk K is permuted so that lane t's x values, its B fragments, are one contiguous run
  (x row t * Q * 16 + kb * 4 + r1 * 2 + h): one 16-byte load per eight.
- x's rows are the MMA's 8 (or 16) columns, and the scale goes on once per chunk (one group at most). Integer
  zeros are folded into the A registers by one bf16x2 / f16x2 FMA each, (magic + q) - (magic + z) = q - z
  exactly: s * sum (q - z) x. Otherwise (offsets, or 9-16 rows, where the fold's registers cost more) a second
  MMA against ones sums x: s * sum (magic + q) x - s (magic + z) sum x, or - (magic s - m) sum x for offsets.
- A program owns 16 output columns of up to 16 rows of x (PROGRAM_ROWS); past 16 rows a column block has one
  program per 16 rows, adjacent in the grid, so that they run side by side and its words come from DRAM once.
  Its W warps split K as the MMA layout's leading dimension, ask for all a chunk reads (words, scales, zeros, x)
  one step ahead, U chunks a step, and meet in one reduction at the end (config()). With prefetch=N
  (PDSERVE_W4A16_PREFETCH) each lane also asks L2 for its words N steps past that one. About 2.9 SASS
  instructions a weight per lane at one row, against ~5 for the CUDA-core kernel of the rows layout
  (kernels/w4a16_gemm.py).
- SwiGLU (swiglu=True): for gate_up's (gate | up) columns a program owns gate block c and up block c + N / 32,
  one x for both, and writes silu(gate) * up, rounded as the GEMM and SiLU-and-mul round. The same two-block
  step serves pair=True: blocks 2c and 2c + 1 against one x (config() picks it at 9-16 rows).
- A decoder layer's norms ride in its GEMMs (engine/model.py), so no norm kernel runs between them. A GEMM
  that ends a sublayer (o_proj, down_proj) adds its product into the residual stream in place (add_to),
  rounded as the separate add rounds, and leaves the next norm's weight times the result (rounded once) and
  each 16 columns' sums of squares of it (NextNorm). The GEMM after (qkv, gate_up) takes the first as its x
  and multiplies its fp32 sums by 1 / sqrt(mean + eps), summed from the second (NormedInput). Where RMSNorm
  rounds x * rstd and then weight times that, this rounds weight * x only.
- RoPE and the KV-cache write (rope=RopeWrite, 1-8 rows): for qkv's heads a program owns a head's first-half
  block j and its second-half block j + head_dim / 32, so a lane holds both halves of its rows' pairs; it rotates
  the query and key heads, writes the queries in place and the keys and values into the paged cache, rounded as
  the GEMM and then kernels/rotary_kv_write.py round.
- GPTQ act order: x's columns are gathered into the layout's order first (x[:, perm]).
- A programmatic dependent launch (PDL, kernels/pdl.py): a program lets the next kernel start (up to 8 rows;
  at 16 the early dependents' registers slow it), asks for its first step's weights, scales and zeros, then
  waits (griddepcontrol.wait) for the kernel before, whose output x is. The kernels before a decoder layer's
  GEMMs let it start on their entry, so the GEMM's programs are resident and its weights in flight while those
  run.
There is no interpreter for Gluon: the CPU path dequantizes the same layout (int4_dequant, tested under the
interpreter) and the GPU tests hold this kernel to the dequantize-then-matmul reference.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.experimental.gluon as gluon
import triton.experimental.gluon.language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from kernels import _backend
from kernels._backend import num_sms
from kernels.fused_add_rmsnorm import norm_input_reference
from kernels.int4_dequant import Int4Weight
from kernels.pdl import pdl as pdl_on

PROGRAM_ROWS = 16  # rows of x a program takes: the MMA's 8 columns, or two of them
# rows of x one launch takes, PROGRAM_ROWS a program: a column block's programs are adjacent in the grid, so they
# run side by side and read its words once from DRAM between them. Past it, dequantizing once for cuBLAS is as fast
# or faster (H200, a Llama-3-8B layer, bench/quant_int4.py --chunked: 231 against 279 us at 64 rows, even at 80)
MAX_ROWS = 64
BLOCK_COLS = 16  # output columns a program owns: the MMA's 16 rows
MANY_BLOCKS = 1024  # from this many column blocks a program has 4 warps (Llama-3-8B's gate_up), else 8
SHORT_K = 2048  # up to this K, a grid past two programs an SM has 4 warps a program too (config())
# qkv ending in RoPE and the KV-cache write: 8 warps a program of two column blocks, zeros folded. Past 8 rows
# these programs were slower than the GEMM and rotary_kv_write apart (H200: 21.6 against 14.7 us at 16 rows)
ROPE_MAX_ROWS, ROPE_WARPS = 8, 8


@gluon.jit
def _index(n: gl.constexpr, d: gl.constexpr, r: gl.constexpr, layout: gl.constexpr):
    """arange(n) along dimension d of a rank-r tensor, in the slice of its layout `layout` names."""
    a = gl.arange(0, n, layout=layout)
    for e in gl.static_range(r):
        if e != d:
            a = gl.expand_dims(a, e)
    return a


@gluon.jit
def _launch_dependents():
    """griddepcontrol.launch_dependents: the kernel after this one (a programmatic dependent launch) may start."""
    gl.inline_asm_elementwise(
        "griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
    )


@gluon.jit
def _wait_for_primary():
    """griddepcontrol.wait: the kernel before this one (a programmatic dependent launch) has finished, and its
    writes are visible."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _ask_ahead(
    qw_ptr, c, ch, n_chunks, K,
    D: gl.constexpr,
    P0: gl.constexpr, P1: gl.constexpr, P2: gl.constexpr, P3: gl.constexpr, P4: gl.constexpr,
    W: gl.constexpr, Q: gl.constexpr,
):  # fmt: skip
    """Asks L2 for warp w's words of chunk ch + D + w (prefetch.global.L2, one a lane's four words) when every warp's
    chunk is inside K: bytes in flight that hold no registers. The pointers are chunk ch's, which the register load
    of the same step computes, D chunks on as an immediate offset."""
    if ch + D + W <= n_chunks:
        ptrs, _ = _words(qw_ptr, c, ch, n_chunks, K, P0, P1, P2, P3, P4, W, Q)
        gl.inline_asm_elementwise(
            "prefetch.global.L2 [$4]; mov.u32 $0, 0; mov.u32 $1, 0; mov.u32 $2, 0; mov.u32 $3, 0;",
            "=r,=r,=r,=r,l,l,l,l", [ptrs + D * Q * 128], dtype=gl.int32, is_pure=False, pack=4,
        )  # fmt: skip


@gluon.jit
def _words(
    qw_ptr, c, ch, n_chunks, K,
    P0: gl.constexpr, P1: gl.constexpr, P2: gl.constexpr, P3: gl.constexpr, P4: gl.constexpr,
    W: gl.constexpr, Q: gl.constexpr,
):  # fmt: skip
    """Pointers to warp w's words of chunk ch + w, (W, Q, 4 words, 8 groups, 4 threads), and their mask."""
    iw = _index(W, 0, 5, P0)
    iq = _index(Q, 1, 5, P1)
    iv = _index(4, 2, 5, P2)
    ig = _index(8, 3, 5, P3)
    it = _index(4, 4, 5, P4)
    chw = ch + iw
    offs = ((c * (K // 64) + chw * Q + iq) * 32 + ig * 4 + it) * 4 + iv
    return qw_ptr + offs, chw < n_chunks


@gluon.jit
def _x(
    x_ptr, ch, n_chunks, M, stride_xw,
    B0: gl.constexpr, B1: gl.constexpr, B2: gl.constexpr, B3: gl.constexpr,
    W: gl.constexpr, Q: gl.constexpr, BN: gl.constexpr,
):  # fmt: skip
    """Warp w's x for chunk ch + w, (W, Q * 8, 4, BN) int32 pairs of 16-bit values."""
    bw = _index(W, 0, 4, B0)
    bkr = _index(Q * 8, 1, 4, B1)  # (kb, r1)
    bt = _index(4, 2, 4, B2)
    bn = _index(BN, 3, 4, B3)
    chb = ch + bw
    x32 = x_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
    xoffs = bn * stride_xw + chb * (Q * 32) + bt * (Q * 8) + bkr
    return gl.load(x32 + xoffs, mask=(bn < M) & (chb < n_chunks), other=0)


@gluon.jit
def _side(
    s_ptr, z_ptr, c, ch, cols, sw, n_chunks, N,
    GROUP: gl.constexpr, FOLD: gl.constexpr, W: gl.constexpr, Q: gl.constexpr, P0: gl.constexpr, P3: gl.constexpr,
):  # fmt: skip
    """Warp w's scales of chunk ch + w, (W, 16), and its zeros: (W, 1, 1, 8, 1) for columns g and g + 8 in the
    words' layout when they are folded in (FOLD), else (W, 16) twice. As stored: one group a chunk at most."""
    BK: gl.constexpr = Q * 64
    grp = ((ch + sw) * BK) // GROUP
    smask = ((ch + sw) < n_chunks) & (cols < N)
    s = gl.load(s_ptr + grp * N + cols, mask=smask, other=0.0)
    if FOLD:
        zw = _index(W, 0, 5, P0)
        zc = c * 16 + _index(8, 3, 5, P3)  # columns g; g + 8 is the other half of the block
        zoff = (((ch + zw) * BK) // GROUP) * N + zc
        zmask = (ch + zw) < n_chunks
        z0 = gl.load(z_ptr + zoff, mask=zmask & (zc < N), other=0)
        z1 = gl.load(z_ptr + zoff + 8, mask=zmask & (zc + 8 < N), other=0)
    else:
        z0 = gl.load(z_ptr + grp * N + cols, mask=smask, other=0)
        z1 = z0
    return s, z0, z1


@gluon.jit
def _load_chunk(
    qw_ptr, x_ptr, s_ptr, z_ptr, c, ch, cols, sw, n_chunks, M, N, K, stride_xw,
    GROUP: gl.constexpr, FOLD: gl.constexpr,
    P0: gl.constexpr, P1: gl.constexpr, P2: gl.constexpr, P3: gl.constexpr, P4: gl.constexpr,
    B0: gl.constexpr, B1: gl.constexpr, B2: gl.constexpr, B3: gl.constexpr,
    W: gl.constexpr, Q: gl.constexpr, BN: gl.constexpr,
):  # fmt: skip
    """Warp w's words of chunk ch + w (int32, _words), their scales and zeros (_side) and its x (_x), loaded into
    registers: everything a chunk reads from memory, asked for a step before it is used."""
    ptrs, mask = _words(qw_ptr, c, ch, n_chunks, K, P0, P1, P2, P3, P4, W, Q)
    P = gl.load(ptrs, mask=mask, other=0)
    s, z0, z1 = _side(s_ptr, z_ptr, c, ch, cols, sw, n_chunks, N, GROUP, FOLD, W, Q, P0, P3)
    B = _x(x_ptr, ch, n_chunks, M, stride_xw, B0, B1, B2, B3, W, Q, BN)
    return P, B, s, z0, z1


@gluon.jit
def _halves(P):
    """The words P joined as (..., r1, r0, h): nibble r at bits 0..3 and r + 4 at 16..19, once per 16-bit half."""
    J = gl.join(gl.join(P, P >> 8), gl.join(P >> 4, P >> 12))
    return gl.join(J, J)


@gluon.jit
def _a_order(A, W: gl.constexpr, Q: gl.constexpr):
    """16-bit values (W, Q, 4, 8, 4, r1, r0, h) of one chunk as the A fragments' (W, 16, Q * 64): (w, r0 g,
    q v r1 t h)."""
    return gl.reshape(gl.permute(A, (0, 6, 3, 1, 2, 5, 4, 7)), (W, 16, Q * 64))


@gluon.jit
def folded_a(P, z0, z1, FP16: gl.constexpr, W: gl.constexpr, Q: gl.constexpr):
    """One chunk's words (W, Q, 4, 8, 4) as (W, 16, Q * 64) q - z in the 16-bit type, in the A fragments' order: the
    nibbles under the magic exponent, the zeros of columns g and g + 8 of each block (z0, z1: (W, 1, 1, 8, 1)) taken
    off by one FMA a register, (magic + q) - (magic + z) exactly. kernels/w4a16_wgmma.py takes it too."""
    J = _halves(P)
    NEG: gl.constexpr = 0xE400 if FP16 else 0xC300  # -(magic) in the 16-bit type; + z in its low bits
    za = z0.to(gl.int32) + NEG
    zb = z1.to(gl.int32) + NEG
    za = za | (za << 16)
    zb = zb | (zb << 16)
    za, _ = gl.broadcast(za, P)
    zb, _ = gl.broadcast(zb, P)
    Z = gl.join(gl.join(za, za), gl.join(zb, zb))
    Z = gl.join(Z, Z)
    if FP16:
        A = gl.inline_asm_elementwise(
            "{ .reg .b32 t, one; mov.b32 one, 0x3C003C00; lop3.b32 t, $1, 0x000F000F, 0x64006400, 0xEA; "
            "fma.rn.f16x2 $0, t, one, $3; }",
            "=r,r,r,r,r", [J, Z], dtype=gl.float16, is_pure=True, pack=2,
        )  # fmt: skip
    else:
        A = gl.inline_asm_elementwise(
            "{ .reg .b32 t, one; mov.b32 one, 0x3F803F80; lop3.b32 t, $1, 0x000F000F, 0x43004300, 0xEA; "
            "fma.rn.bf16x2 $0, t, one, $3; }",
            "=r,r,r,r,r", [J, Z], dtype=gl.bfloat16, is_pure=True, pack=2,
        )  # fmt: skip
    return _a_order(A, W, Q)


@gluon.jit
def _chunk(
    P, B, s, z0, z1, ones,
    ZERO_IS_OFFSET: gl.constexpr, FOLD: gl.constexpr, FP16: gl.constexpr,
    W: gl.constexpr, Q: gl.constexpr, BN: gl.constexpr, MMA: gl.constexpr,
):  # fmt: skip
    """One chunk's contribution to the (W, 16, BN) partial sums, from its loaded words, x, scales and zeros."""
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B_L: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    BK: gl.constexpr = Q * 64
    MAGIC: gl.constexpr = 1024.0 if FP16 else 128.0
    if FOLD:  # integer zeros: (magic + q) - (magic + z) = q - z, exact, one FMA per register
        A = folded_a(P, z0, z1, FP16, W, Q)
    else:  # magic + q: 1024 + q in fp16, 128 + q in bf16
        J = _halves(P)
        if FP16:
            A = gl.inline_asm_elementwise(
                "lop3.b32 $0, $1, 0x000F000F, 0x64006400, 0xEA;",
                "=r,r,r",
                [J],
                dtype=gl.float16,
                is_pure=True,
                pack=2,
            )
        else:
            A = gl.inline_asm_elementwise(
                "lop3.b32 $0, $1, 0x000F000F, 0x43004300, 0xEA;",
                "=r,r,r",
                [J],
                dtype=gl.bfloat16,
                is_pure=True,
                pack=2,
            )
        A = _a_order(A, W, Q)
    A = gl.convert_layout(A, A_L, assert_trivial=True)
    Bj = gl.reshape(gl.join(B, B), (W, Q * 4, 2, 4, BN, 2))
    if FP16:  # the int32 pairs read as two 16-bit values each
        Bx = gl.inline_asm_elementwise(
            "mov.b32 $0, $1;", "=r,r,r", [Bj], dtype=gl.float16, is_pure=True, pack=2
        )
    else:
        Bx = gl.inline_asm_elementwise(
            "mov.b32 $0, $1;", "=r,r,r", [Bj], dtype=gl.bfloat16, is_pure=True, pack=2
        )
    Bx = gl.reshape(gl.permute(Bx, (0, 1, 2, 3, 5, 4)), (W, BK, BN))
    Bx = gl.convert_layout(Bx, B_L, assert_trivial=True)
    zero = gl.zeros([W, 16, BN], gl.float32, MMA)
    acc = mma_v2(A, Bx, zero)
    sf = s.to(gl.float32)
    if FOLD:
        out = acc * gl.expand_dims(sf, 2)
    else:  # a second MMA against ones sums x, for the magic and the zero
        xs = mma_v2(ones, Bx, zero)
        z = z0.to(gl.float32)
        if ZERO_IS_OFFSET:
            corr = MAGIC * sf - z
        else:
            corr = (MAGIC + z) * sf
        out = acc * gl.expand_dims(sf, 2) - gl.expand_dims(corr, 2) * xs
    return out


@gluon.jit
def _sumsq(
    sumsq_ptr, M, NB: gl.constexpr, NBP: gl.constexpr, BN: gl.constexpr, Q0: gl.constexpr, Q1: gl.constexpr
):
    """x's rows' (NBP, BN) partial sums of squares (NB = K / 16 of them a row, as the GEMM which wrote x left
    them: _store with ADD), spread over the program's threads, one load each per row."""
    j = _index(NBP, 0, 2, Q0)
    on = _index(BN, 1, 2, Q1)
    return gl.load(sumsq_ptr + on * NB + j, mask=(on < M) & (j < NB), other=0.0)


@gluon.jit
def _rstd(sq, K, eps, O1: gl.constexpr):
    """(1, BN): 1 / sqrt(mean(x^2) + eps) of x's rows, from their partial sums (_sumsq), in the output's layout."""
    total = gl.convert_layout(gl.sum(sq, axis=0), O1)
    return gl.expand_dims(gl.rsqrt(total / K + eps), 0)


@gluon.jit
def _store(
    out, c, M, N, out_ptr, stride_om, bias_ptr, gn, y_ptr, part_ptr, R, rstd,
    HAS_BIAS: gl.constexpr, NORM: gl.constexpr, ADD: gl.constexpr, DT: gl.constexpr,
    O0: gl.constexpr, O1: gl.constexpr, BN: gl.constexpr,
):  # fmt: skip
    """Column block c's (16, BN) fp32 sums, written in x's dtype: times x's rstd (NORM), plus the bias. With ADD
    they are added into the stream there instead (R, as loaded before the K loop), rounded as a separate add
    rounds; the next norm's weight (gn, loaded before the wait) times the result, rounded once, goes to y_ptr
    (M, N), the next GEMM's x, and the block's sums of squares of the result to part_ptr (M, N / 16)."""
    ocol = c * 16 + _index(16, 0, 2, O0)
    on = _index(BN, 1, 2, O1)
    mask = (on < M) & (ocol < N)
    if NORM:
        out = out * rstd
    if HAS_BIAS:
        out += gl.load(bias_ptr + ocol, mask=ocol < N, other=0.0).to(gl.float32)
    if ADD:
        h = (out.to(DT).to(gl.float32) + R.to(gl.float32)).to(DT)
        gl.store(out_ptr + on * stride_om + ocol, h, mask=mask)
        hf = gl.where(mask, h.to(gl.float32), 0.0)
        # a product of two 16-bit values is exact in fp32: one rounding, to DT
        gl.store(y_ptr + on * N + ocol, (gn * hf).to(DT), mask=mask)
        sq = gl.expand_dims(gl.sum(hf * hf, axis=0), 0)  # (1, BN)
        gl.store(part_ptr + on * (N // 16) + c, sq, mask=on < M)
    else:
        gl.store(out_ptr + on * stride_om + ocol, out.to(out_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def _rope_store(
    out, up, c, M, N, out_ptr, stride_om, bias_ptr, rstd, pos_ptr, cs_ptr, cache_ptr, slot_ptr, stride_cs,
    max_pos, num_heads, num_kv_heads, stride_c_kv, stride_c_block, stride_c_off, stride_c_head,
    HAS_BIAS: gl.constexpr, NORM: gl.constexpr, DT: gl.constexpr, HALF: gl.constexpr, BLOCK_SIZE: gl.constexpr,
    O0: gl.constexpr, O1: gl.constexpr, BN: gl.constexpr,
):  # fmt: skip
    """The qkv GEMM's epilogue with RoPE and the KV-cache write (kernels/rotary_kv_write.py's work, rounded as
    it rounds): block c holds rows j * 16 .. + 15 of a head's first half and `up` the same rows of its second
    half, each rounded as the GEMM writes it. A query head is rotated and written in place; a key head is
    rotated and a value head taken as it is into the cache at each row's slot (a negative slot writes
    nothing), and both are also written to the output unrotated, as the GEMM alone writes them."""
    ocol = c * 16 + _index(16, 0, 2, O0)  # (16, 1)
    on = _index(BN, 1, 2, O1)  # (1, BN)
    rows = on < M
    if NORM:
        out = out * rstd
        up = up * rstd
    if HAS_BIAS:
        out += gl.load(bias_ptr + ocol).to(gl.float32)
        up += gl.load(bias_ptr + ocol + HALF).to(gl.float32)
    x1 = out.to(DT).to(gl.float32)
    x2 = up.to(DT).to(gl.float32)
    head = c // (HALF // 8)
    dim = ocol - head * (2 * HALF)  # (16, 1): within the head's first half
    pos = gl.load(pos_ptr + on, mask=rows, other=0).to(gl.int64)
    pos = gl.minimum(gl.maximum(pos, 0), max_pos - 1)  # in bounds whatever the caller passes
    cs = cs_ptr + pos * stride_cs + dim
    cos = gl.load(cs).to(gl.float32)
    sin = gl.load(cs + HALF).to(gl.float32)
    r1 = x1 * cos - x2 * sin
    r2 = x2 * cos + x1 * sin
    is_q = head < num_heads
    dst = out_ptr + on * stride_om + ocol
    gl.store(dst, gl.where(is_q, r1, x1).to(DT), mask=rows)
    gl.store(dst + HALF, gl.where(is_q, r2, x2).to(DT), mask=rows)
    kv = head - num_heads  # 0 .. num_kv_heads - 1: keys, then values
    is_v = kv >= num_kv_heads
    slot = gl.load(slot_ptr + on, mask=rows, other=-1).to(gl.int64)
    cache = (
        cache_ptr + is_v.to(gl.int64) * stride_c_kv + (slot // BLOCK_SIZE) * stride_c_block
        + (slot % BLOCK_SIZE) * stride_c_off + (kv - is_v.to(gl.int32) * num_kv_heads) * stride_c_head + dim
    )  # fmt: skip
    cmask = rows & (slot >= 0) & (kv >= 0)
    et = cache_ptr.dtype.element_ty
    gl.store(cache, gl.where(is_v, x1, r1).to(et), mask=cmask)
    gl.store(cache + HALF, gl.where(is_v, x2, r2).to(et), mask=cmask)


@gluon.jit
def _stream(out_ptr, c, M, N, stride_om, O0: gl.constexpr, O1: gl.constexpr, BN: gl.constexpr):
    """Column block c of the stream an ADD GEMM adds into, (16, BN) as the output is laid."""
    ocol = c * 16 + _index(16, 0, 2, O0)
    on = _index(BN, 1, 2, O1)
    return gl.load(out_ptr + on * stride_om + ocol, mask=(on < M) & (ocol < N), other=0.0)


@gluon.jit
def _next_weight(g_ptr, c, N, O0: gl.constexpr):
    """Column block c's (16, 1) of the next norm's weight, which an ADD GEMM's epilogue multiplies the stream by:
    a constant, asked for before the wait."""
    ocol = c * 16 + _index(16, 0, 2, O0)
    return gl.load(g_ptr + ocol, mask=ocol < N, other=0.0).to(gl.float32)


@gluon.jit
def _after_wait(
    sumsq_ptr, out_ptr, c, M, N, K, stride_om, eps,
    NORM: gl.constexpr, ADD: gl.constexpr, PAIR: gl.constexpr, NB: gl.constexpr, NBP: gl.constexpr,
    O0: gl.constexpr, O1: gl.constexpr, Q0: gl.constexpr, Q1: gl.constexpr, BN: gl.constexpr,
):  # fmt: skip
    """What the epilogue reads of the kernels before, asked for with the first x: x's rstd (NORM; its partial
    sums summed before the K loop, so that only the result is held through it), and the stream's columns that the
    sums are added into (ADD; block c, and c + 1 with PAIR)."""
    rstd = _rstd(_sumsq(sumsq_ptr, M, NB, NBP, BN, Q0, Q1), K, eps, O1) if NORM else 1.0
    R = _stream(out_ptr, c, M, N, stride_om, O0, O1, BN) if ADD else 0.0
    R_u = _stream(out_ptr, c + 1, M, N, stride_om, O0, O1, BN) if ADD and PAIR else 0.0
    return rstd, R, R_u


@gluon.jit
def _w4a16_mma_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, g_ptr, y_ptr, sumsq_ptr, part_ptr, M, N, K, stride_xw,
    stride_om, eps, R,
    pos_ptr, cs_ptr, cache_ptr, slot_ptr, stride_cs, max_pos, num_heads, num_kv_heads,
    stride_c_kv, stride_c_block, stride_c_off, stride_c_head,
    GROUP: gl.constexpr, ZERO_IS_OFFSET: gl.constexpr, FOLD: gl.constexpr, FP16: gl.constexpr,
    HAS_BIAS: gl.constexpr, W: gl.constexpr, Q: gl.constexpr, U: gl.constexpr, BN: gl.constexpr,
    SWIGLU: gl.constexpr, PAIR: gl.constexpr, NORM: gl.constexpr, ADD: gl.constexpr, NB: gl.constexpr,
    NBP: gl.constexpr, ROPE: gl.constexpr, HALF: gl.constexpr, BLOCK_SIZE: gl.constexpr,
    PDL: gl.constexpr, EARLY: gl.constexpr, SPLIT_ROWS: gl.constexpr, MMA: gl.constexpr, PF: gl.constexpr,
    P0: gl.constexpr, P1: gl.constexpr, P2: gl.constexpr, P3: gl.constexpr, P4: gl.constexpr,
    B0: gl.constexpr, B1: gl.constexpr, B2: gl.constexpr, B3: gl.constexpr,
    S0: gl.constexpr, S1: gl.constexpr, O0: gl.constexpr, O1: gl.constexpr, Q0: gl.constexpr, Q1: gl.constexpr,
):  # fmt: skip
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    DT: gl.constexpr = gl.float16 if FP16 else gl.bfloat16
    BK: gl.constexpr = Q * 64
    if PDL and EARLY:  # the next kernel may start now (else when this one's programs end)
        _launch_dependents()
    c = gl.program_id(0)
    if SPLIT_ROWS:  # rows r * BN.. of x for program c // R's columns: a block's R programs run side by side
        row0 = (c % R) * BN
        c = c // R
        x_ptr += row0 * (2 * stride_xw)
        out_ptr += row0 * stride_om
        sumsq_ptr += row0 * NB
        y_ptr += row0 * N
        part_ptr += row0 * (N // 16)
        M -= row0
    if PAIR:  # column blocks 2c and 2c + 1
        c = c * 2
    if ROPE:  # a head's first-half block j and its second-half block j + HALF / 16: program (head, j)
        HB: gl.constexpr = HALF // 16
        c = (c // HB) * (2 * HB) + c % HB
    n_chunks = K // BK
    ones = gl.full([W, 16, BK], 1.0, DT, A_L)
    total = gl.zeros([W, 16, BN], gl.float32, MMA)
    sw = _index(W, 0, 2, S0)
    cols = c * 16 + _index(16, 1, 2, S1)
    # the first step's weights, scales and zeros are asked for before the wait: x is the kernel before's output
    ptrs, mask = _words(qw_ptr, c, 0, n_chunks, K, P0, P1, P2, P3, P4, W, Q)
    Pa = gl.load(ptrs, mask=mask, other=0)
    sa, za0, za1 = _side(s_ptr, z_ptr, c, 0, cols, sw, n_chunks, N, GROUP, FOLD, W, Q, P0, P3)
    gn = _next_weight(g_ptr, c, N, O0) if ADD else 0.0
    gn_u = _next_weight(g_ptr, c + 1, N, O0) if ADD and PAIR else 0.0
    TWO: gl.constexpr = SWIGLU or PAIR or ROPE  # a second column block cu a step, against the same x
    if TWO:
        gl.static_assert(U == 1, "two column blocks take one chunk of each a step")
        if SWIGLU:  # N columns of (gate | up): gate block c, up block c + N / 32
            cu = c + N // 32
            cols_u = cols + N // 2
        elif ROPE:  # the same rows of the head's second half
            cu = c + HALF // 16
            cols_u = cols + HALF
        else:
            cu = c + 1
            cols_u = cols + 16
        ptrs, mask = _words(qw_ptr, cu, 0, n_chunks, K, P0, P1, P2, P3, P4, W, Q)
        Ua = gl.load(ptrs, mask=mask, other=0)
        ta, ya0, ya1 = _side(s_ptr, z_ptr, cu, 0, cols_u, sw, n_chunks, N, GROUP, FOLD, W, Q, P0, P3)
        total_u = gl.zeros([W, 16, BN], gl.float32, MMA)  # block cu's partial sums
    if U == 1:  # one chunk (of each block) a step, the next loaded into registers before this one is used
        for d in gl.static_range(1, PF + 1):  # the first PF steps after the registers' one, before the wait
            _ask_ahead(qw_ptr, c, 0, n_chunks, K, d * W, P0, P1, P2, P3, P4, W, Q)
            if TWO:
                _ask_ahead(qw_ptr, cu, 0, n_chunks, K, d * W, P0, P1, P2, P3, P4, W, Q)
        if PDL:
            _wait_for_primary()
        Ba = _x(x_ptr, 0, n_chunks, M, stride_xw, B0, B1, B2, B3, W, Q, BN)
        rstd, R, R_u = _after_wait(
            sumsq_ptr, out_ptr, c, M, N, K, stride_om, eps, NORM, ADD, PAIR, NB, NBP, O0, O1, Q0, Q1, BN
        )
        for ch in range(0, n_chunks, W):
            P = Pa
            B = Ba
            s = sa
            z0 = za0
            z1 = za1
            if TWO:
                Pu = Ua
                su = ta
                y0 = ya0
                y1 = ya1
            Pa, Ba, sa, za0, za1 = _load_chunk(
                qw_ptr, x_ptr, s_ptr, z_ptr, c, ch + W, cols, sw, n_chunks, M, N, K, stride_xw, GROUP, FOLD,
                P0, P1, P2, P3, P4, B0, B1, B2, B3, W, Q, BN,
            )  # fmt: skip
            if PF > 0:  # step PF + 1 from here, PF past the one just asked into registers
                _ask_ahead(qw_ptr, c, ch + W, n_chunks, K, PF * W, P0, P1, P2, P3, P4, W, Q)
                if TWO:
                    _ask_ahead(qw_ptr, cu, ch + W, n_chunks, K, PF * W, P0, P1, P2, P3, P4, W, Q)
            if TWO:
                ptrs, mask = _words(qw_ptr, cu, ch + W, n_chunks, K, P0, P1, P2, P3, P4, W, Q)
                Ua = gl.load(ptrs, mask=mask, other=0)
                ta, ya0, ya1 = _side(
                    s_ptr, z_ptr, cu, ch + W, cols_u, sw, n_chunks, N, GROUP, FOLD, W, Q, P0, P3
                )  # fmt: skip
            total += _chunk(P, B, s, z0, z1, ones, ZERO_IS_OFFSET, FOLD, FP16, W, Q, BN, MMA)
            if TWO:
                total_u += _chunk(Pu, B, su, y0, y1, ones, ZERO_IS_OFFSET, FOLD, FP16, W, Q, BN, MMA)
    else:  # two chunks a step, the next two loaded before these are used
        ptrs, mask = _words(qw_ptr, c, W, n_chunks, K, P0, P1, P2, P3, P4, W, Q)
        Pb = gl.load(ptrs, mask=mask, other=0)
        sb, zb0, zb1 = _side(s_ptr, z_ptr, c, W, cols, sw, n_chunks, N, GROUP, FOLD, W, Q, P0, P3)
        for d in gl.static_range(2, 2 * PF + 2):  # two chunks a step
            _ask_ahead(qw_ptr, c, 0, n_chunks, K, d * W, P0, P1, P2, P3, P4, W, Q)
        if PDL:
            _wait_for_primary()
        Ba = _x(x_ptr, 0, n_chunks, M, stride_xw, B0, B1, B2, B3, W, Q, BN)
        Bb = _x(x_ptr, W, n_chunks, M, stride_xw, B0, B1, B2, B3, W, Q, BN)
        rstd, R, R_u = _after_wait(
            sumsq_ptr, out_ptr, c, M, N, K, stride_om, eps, NORM, ADD, PAIR, NB, NBP, O0, O1, Q0, Q1, BN
        )
        for ch in range(0, n_chunks, 2 * W):
            P = Pa
            B = Ba
            s = sa
            z0 = za0
            z1 = za1
            P2_ = Pb
            B2_ = Bb
            s2 = sb
            z20 = zb0
            z21 = zb1
            Pa, Ba, sa, za0, za1 = _load_chunk(
                qw_ptr, x_ptr, s_ptr, z_ptr, c, ch + 2 * W, cols, sw, n_chunks, M, N, K, stride_xw, GROUP, FOLD,
                P0, P1, P2, P3, P4, B0, B1, B2, B3, W, Q, BN,
            )  # fmt: skip
            Pb, Bb, sb, zb0, zb1 = _load_chunk(
                qw_ptr, x_ptr, s_ptr, z_ptr, c, ch + 3 * W, cols, sw, n_chunks, M, N, K, stride_xw, GROUP, FOLD,
                P0, P1, P2, P3, P4, B0, B1, B2, B3, W, Q, BN,
            )  # fmt: skip
            if PF > 0:
                _ask_ahead(qw_ptr, c, ch + 2 * W, n_chunks, K, 2 * PF * W, P0, P1, P2, P3, P4, W, Q)
                _ask_ahead(qw_ptr, c, ch + 2 * W, n_chunks, K, (2 * PF + 1) * W, P0, P1, P2, P3, P4, W, Q)
            total += _chunk(P, B, s, z0, z1, ones, ZERO_IS_OFFSET, FOLD, FP16, W, Q, BN, MMA)
            total += _chunk(P2_, B2_, s2, z20, z21, ones, ZERO_IS_OFFSET, FOLD, FP16, W, Q, BN, MMA)
    out = gl.sum(total, axis=0)  # (16, BN): the warps' K ranges summed
    if SWIGLU:  # gate and up rounded as the GEMM writes them, silu(gate) as SiLU-and-mul rounds it
        N_OUT = N // 2
        ocol = c * 16 + _index(16, 0, 2, O0)
        on = _index(BN, 1, 2, O1)
        up = gl.sum(total_u, axis=0)
        if NORM:
            out = out * rstd
            up = up * rstd
        if HAS_BIAS:
            out += gl.load(bias_ptr + ocol, mask=ocol < N_OUT, other=0.0).to(gl.float32)
            up += gl.load(bias_ptr + N_OUT + ocol, mask=ocol < N_OUT, other=0.0).to(gl.float32)
        g = out.to(DT).to(gl.float32)
        act = (g / (1.0 + gl.exp(-g))).to(DT).to(gl.float32)
        out = act * up.to(DT).to(gl.float32)
        gl.store(
            out_ptr + on * stride_om + ocol, out.to(out_ptr.dtype.element_ty), mask=(on < M) & (ocol < N_OUT)
        )  # fmt: skip
    elif ROPE:
        _rope_store(
            out, gl.sum(total_u, axis=0), c, M, N, out_ptr, stride_om, bias_ptr, rstd, pos_ptr, cs_ptr,
            cache_ptr, slot_ptr, stride_cs, max_pos, num_heads, num_kv_heads, stride_c_kv, stride_c_block,
            stride_c_off, stride_c_head, HAS_BIAS, NORM, DT, HALF, BLOCK_SIZE, O0, O1, BN,
        )  # fmt: skip
    else:
        _store(
            out, c, M, N, out_ptr, stride_om, bias_ptr, gn, y_ptr, part_ptr, R, rstd, HAS_BIAS, NORM, ADD, DT,
            O0, O1, BN,
        )  # fmt: skip
    if PAIR:  # block c + 1's columns
        _store(
            gl.sum(total_u, axis=0), c + 1, M, N, out_ptr, stride_om, bias_ptr, gn_u, y_ptr, part_ptr, R_u, rstd,
            HAS_BIAS, NORM, ADD, DT, O0, O1, BN,
        )  # fmt: skip


def _slices(parent: Any, rank: int) -> list[Any]:
    """For each dimension d of a rank-`rank` layout, the 1-D layout that _index expands back to `parent`."""
    out = []
    for d in range(rank):
        lay = parent
        for e in reversed(range(rank)):
            if e != d:
                lay = gl.SliceLayout(e, lay)
        out.append(lay)
    return out


@functools.cache
def _layouts(w: int, q: int, bn: int) -> dict[str, Any]:
    mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[w, 1, 1], instr_shape=[1, 16, 8])
    words = gl.BlockedLayout(
        size_per_thread=[1, q, 4, 1, 1], threads_per_warp=[1, 1, 1, 8, 4], warps_per_cta=[w, 1, 1, 1, 1],
        order=[2, 1, 4, 3, 0],
    )  # fmt: skip
    x = gl.BlockedLayout(
        size_per_thread=[1, q * 8, 1, 1], threads_per_warp=[1, 1, 4, 8], warps_per_cta=[w, 1, 1, 1],
        order=[1, 2, 3, 0],
    )  # fmt: skip
    out: dict[str, Any] = {"MMA": mma}
    for name, lay, rank in (
        ("P", words, 5),
        ("B", x, 4),
        ("S", gl.SliceLayout(2, mma), 2),
        ("O", gl.SliceLayout(0, mma), 2),
        # a norm's partial sums, (K / 16, rows): along K over every thread, once each
        ("Q", gl.BlockedLayout([1, 1], [32, 1], [w, 1], [0, 1]), 2),
    ):
        for i, sl in enumerate(_slices(lay, rank)):
            out[f"{name}{i}"] = sl
    return out


def applies(x: torch.Tensor, w: Int4Weight) -> bool:
    """Whether this kernel takes x against w: fragment-laid weights, 16-bit x of at most MAX_ROWS rows on a GPU,
    the Triton path not forced off (PDSERVE_ATTENTION_BACKEND=torch: the reference dequantizes instead)."""
    return (
        w.layout == "fragments" and x.is_cuda and _backend.use_triton(x)
        and x.dtype in (torch.bfloat16, torch.float16) and 1 <= x.shape[0] <= MAX_ROWS
    )  # fmt: skip


def swiglu_applies(x: torch.Tensor, w: Int4Weight) -> bool:
    """Whether gate_up's GEMM can end in SwiGLU here: at most MAX_ROWS rows, and gate and up each in whole
    column blocks (a program takes gate block c and up block c + N / 32 together)."""
    return applies(x, w) and x.shape[0] <= MAX_ROWS and w.out_features % (2 * BLOCK_COLS) == 0


def config(m: int, n: int, k: int, device: torch.device) -> tuple[int, int, bool, bool]:
    """(warps, chunks a step, zeros folded, two column blocks a program) for an (m, k) x (k, n) GEMM, from a sweep
    of a Llama-3-8B layer on the H200 (BENCHMARKS.md). Folding the zeros halves the MMAs; at 9-16 rows on gate_up's
    grid its registers cost more than the second MMA. Programs of 8 warps taking two chunks a step need ~114
    registers a thread, two programs an SM: past two programs per SM, one chunk a step keeps the grid in one wave.
    Two column blocks a program (pair) read x once for both: at 9-16 rows gate_up 33.4 against 46.6 us, down 19.2
    against 23.5. On gate_up's grid they win at 8 rows too (H200 21.3 against 26.7 us, H100 25.9 against 26.9); at
    1-4 rows the H200 gains 1-2 us and the H100 loses 1, so they stay off there (SwiGLU's step, swiglu_config, is
    the same one); on the other GEMMs they are slower at 1-8 rows. Past two programs an SM with K up to SHORT_K
    (Qwen3-30B-A3B's qkv, 2048 x 5120), 8 warps leave a warp two chunks; 4 warps of two chunks a step take 3.6
    against 4.3 us at one row, 4.8 against 5.5 at 8 (H100)."""
    blocks = -(-n // BLOCK_COLS)
    many = blocks > 2 * num_sms(device)
    if blocks >= MANY_BLOCKS and m > 4:  # gate_up's grid: pairs past 4 rows, zeros folded up to 8
        return 4, 1, m <= 8, True
    if m > 8:
        return (8, 1, True, True) if k >= 8192 else (4, 1, True, many)
    if blocks >= MANY_BLOCKS or (many and k <= SHORT_K):
        return 4, 2, True, False
    return (8, 1, True, False) if many else (8, 2, True, False)


def rope_applies(x: torch.Tensor, w: Int4Weight, rope: RopeWrite) -> bool:
    """Whether the qkv GEMM can end in RoPE and the KV-cache write here: 1..ROPE_MAX_ROWS rows, a 16-bit
    cache, half a head in whole column blocks, and N the heads' columns."""
    d = rope.head_dim
    return (
        applies(x, w) and x.shape[0] <= ROPE_MAX_ROWS and rope.kv_cache.dtype in (torch.bfloat16, torch.float16)
        and d % (2 * BLOCK_COLS) == 0 and w.out_features == (rope.num_heads + 2 * rope.num_kv_heads) * d
    )  # fmt: skip


def swiglu_config(m: int) -> tuple[int, int, bool, bool]:
    """gate_up ending in SwiGLU: 4 warps, one chunk of gate's block and one of up's a step, zeros folded up to 8
    rows and summed by a second MMA past them (as the pair config at 9-16 rows)."""
    return 4, 1, m <= 8, False


@dataclass(frozen=True)
class NormedInput:
    """A GEMM's x given as RMSNorm's weight times the residual stream h, before the norm's 1 / rms: the GEMM
    multiplies its sums by 1 / sqrt(mean(h^2) + eps), which it adds up from `sumsq` (M, K / 16) fp32, the sums
    of squares of each 16 of h's columns. An add_to GEMM leaves both (NextNorm)."""

    sumsq: torch.Tensor
    eps: float


@dataclass(frozen=True)
class RopeWrite:
    """What the qkv GEMM's epilogue needs to do rotary_kv_write's work (kernels/rotary_kv_write.py): RoPE on the
    query and key heads from cos_sin_cache at each row's position, the key and value heads written into a 16-bit
    paged cache at each row's slot. The GEMM's N is (num_heads + 2 * num_kv_heads) * head_dim."""

    positions: torch.Tensor  # (M,) int32/int64
    cos_sin_cache: torch.Tensor  # (max_positions, head_dim): cos | sin
    kv_cache: torch.Tensor  # (2, num_blocks, block_size, num_kv_heads, head_dim), 16-bit
    slot_mapping: torch.Tensor  # (M,) int32/int64; a negative slot writes nothing
    num_heads: int
    num_kv_heads: int

    @property
    def head_dim(self) -> int:
        return int(self.cos_sin_cache.shape[1])


@dataclass(frozen=True)
class NextNorm:
    """What an add_to GEMM leaves for the norm after it: `normed` (M, N) = `weight` times the stream, each
    product rounded once to the stream's dtype, and `sumsq` (M, N / 16) fp32, the stream's sums of squares of each
    16 columns (NormedInput)."""

    weight: torch.Tensor  # (N,) the next RMSNorm's
    normed: torch.Tensor  # (M, N), contiguous
    sumsq: torch.Tensor  # (M, N / 16) fp32, contiguous


def w4a16_mma(
    x: torch.Tensor,
    w: Int4Weight,
    bias: torch.Tensor | None = None,
    warps: int | None = None,  # these three: config() by default
    unroll: int | None = None,
    fold: bool
    | None = None,  # integer zeros folded into the A registers; False: a second MMA's x sums take them
    pdl: bool | None = None,  # a programmatic dependent launch (kernels/pdl.py; by default on a GPU)
    swiglu: bool = False,  # w is (gate | up): silu(gate) * up, (M, N / 2); swiglu_applies(x, w)
    pair: bool | None = None,  # two adjacent column blocks a program (an even count); config() by default
    norm: NormedInput | None = None,  # x is weight * the stream: the sums take 1 / rms
    add_to: torch.Tensor | None = None,  # (M, N): the stream, which the product is added into in place
    next_norm: NextNorm | None = None,  # with add_to: where the next norm's input goes
    rope: RopeWrite | None = None,  # qkv: RoPE and the KV-cache write in its epilogue (rope_applies)
    max_registers: int
    | None = None,  # ptxas's cap a thread (bench.quant_int4 --sweep-regs); None: the default
    out: torch.Tensor | None = None,  # where the product goes ((M, N) or with swiglu (M, N / 2), x's dtype)
    prefetch: int | None = None,  # steps of words asked into L2 past the registers' one; None: the knob's
) -> torch.Tensor:
    """(M <= MAX_ROWS, K) 16-bit x against fragment-laid int4 weights: (M, N) in x's dtype; (M, N / 2) with swiglu;
    add_to itself with add_to; with rope the query columns rotated, the key and value columns as computed. Past
    PROGRAM_ROWS rows each column block's program runs once per PROGRAM_ROWS rows, in one launch."""
    m, k = x.shape
    n = w.out_features
    if not applies(x, w):
        raise ValueError(f"w4a16_mma takes fragment-laid weights and 1..{MAX_ROWS} rows of 16-bit x on a GPU")
    if swiglu and not swiglu_applies(x, w):
        raise ValueError(f"swiglu takes 1..{MAX_ROWS} rows and (gate | up) halves of whole column blocks")
    blocks = triton.cdiv(n, BLOCK_COLS)
    row_chunks = triton.cdiv(m, PROGRAM_ROWS)
    pm = min(m, PROGRAM_ROWS)
    default = swiglu_config(pm) if swiglu else config(pm, n, k, x.device)
    if rope is not None:
        default = (ROPE_WARPS, 1, True, False)
    named = warps is not None or unroll is not None or fold is not None
    if pair is None:  # config()'s pick, unless the caller names a config
        pair = default[3] and blocks % 2 == 0 and not swiglu and not named
    if pair and (swiglu or blocks % 2):
        raise ValueError(f"pair takes an even count of column blocks and no swiglu, not {n} columns")
    check_fused(x, w, norm, add_to, next_norm, swiglu)
    if rope is not None:
        if swiglu or add_to is not None or pair:
            raise ValueError("rope takes the qkv GEMM alone: no swiglu, add_to or pair")
        if not rope_applies(x, w, rope):
            raise ValueError(
                f"rope takes 1..{ROPE_MAX_ROWS} rows, a 16-bit cache and heads of a multiple of {2 * BLOCK_COLS} "
                f"dims filling the {n} columns"
            )
        _expect(rope.positions, (m,), rope.positions.dtype, "rope positions")
        _expect(rope.slot_mapping, (m,), rope.slot_mapping.dtype, "rope slot_mapping")
        if rope.kv_cache.stride(-1) != 1 or rope.cos_sin_cache.stride(1) != 1:
            raise ValueError("rope: the cache's and cos_sin_cache's head_dim must be contiguous")
    if w.perm is not None:
        x = x.index_select(1, w.perm)
    if x.stride(1) != 1 or x.stride(0) % 2 or x.data_ptr() % 4:
        x = x.contiguous()
    if add_to is not None:
        if out is not None:
            raise ValueError("add_to is the output itself: no out beside it")
        out = add_to
    elif out is None:
        out = torch.empty(m, n // 2 if swiglu else n, dtype=x.dtype, device=x.device)
    else:
        _expect(out, (m, n // 2 if swiglu else n), x.dtype, "out", rows_strided=True)
    grid = (
        n // (2 * BLOCK_COLS) if swiglu or rope is not None else blocks // (2 if pair else 1)
    ) * row_chunks
    warps = default[0] if warps is None else warps
    unroll = 1 if swiglu or pair or rope is not None else default[1] if unroll is None else unroll
    fold = default[2] if fold is None else fold
    pdl = pdl_on(x) if pdl is None else pdl
    bn = 8 if m <= 8 else PROGRAM_ROWS
    # an epilogue adding into the stream would take 8 warps of two chunks a step past 128 registers a thread and two
    # programs an SM; held to 128 they spill 16 bytes, outside the K loop
    regs = {"maxnreg": 128} if add_to is not None and warps == 8 and unroll == 2 and bn == 8 else {}
    prefetch = _backend.W4A16_PREFETCH if prefetch is None else prefetch
    # gate_up with SwiGLU asking ahead: ptxas takes 130 registers (three programs an SM against four); 120 hold it
    # unspilled
    if prefetch > 0 and swiglu and bn == 8:
        regs = {"maxnreg": 128}
    if max_registers is not None:
        regs = {"maxnreg": max_registers}
    nxt = (next_norm.weight, next_norm.normed, next_norm.sumsq) if next_norm is not None else (out, out, out)
    _w4a16_mma_kernel[(grid,)](
        x, w.qweight, w.scales, w.zeros, bias if bias is not None else out, out, nxt[0], nxt[1],
        norm.sumsq if norm is not None else out, nxt[2],
        m, n, k, x.stride(0) // 2, out.stride(0), norm.eps if norm is not None else 0.0, row_chunks,
        *_rope_args(rope, out),
        GROUP=w.group_size, ZERO_IS_OFFSET=w.zero_is_offset,
        FOLD=fold and not w.zero_is_offset, FP16=x.dtype == torch.float16,
        HAS_BIAS=bias is not None, W=warps, Q=w.chunk // 64, U=unroll, BN=bn, SWIGLU=swiglu, PAIR=pair,
        NORM=norm is not None, ADD=add_to is not None, NB=k // BLOCK_COLS if norm is not None else 1,
        NBP=triton.next_power_of_2(k // BLOCK_COLS) if norm is not None else 1, ROPE=rope is not None,
        HALF=rope.head_dim // 2 if rope is not None else 0,
        BLOCK_SIZE=rope.kv_cache.shape[2] if rope is not None else 1, PDL=pdl,
        EARLY=bn == 8, SPLIT_ROWS=row_chunks > 1, launch_pdl=pdl,
        PF=prefetch,
        num_warps=warps,
        **regs,
        **_layouts(warps, w.chunk // 64, bn),
    )  # fmt: skip
    return out


def _rope_args(rope: RopeWrite | None, out: torch.Tensor) -> tuple[Any, ...]:
    """The kernel's rope arguments: pointers, sizes and strides (any tensor and zeros without rope)."""
    if rope is None:
        return (out, out, out, out, 0, 1, 0, 0, 0, 0, 0, 0)
    c = rope.kv_cache
    return (
        rope.positions, rope.cos_sin_cache, c, rope.slot_mapping, rope.cos_sin_cache.stride(0),
        rope.cos_sin_cache.shape[0], rope.num_heads, rope.num_kv_heads, c.stride(0), c.stride(1), c.stride(2),
        c.stride(3),
    )  # fmt: skip


def check_fused(
    x: torch.Tensor,
    w: Int4Weight,
    norm: NormedInput | None,
    add_to: torch.Tensor | None,
    next_norm: NextNorm | None,
    swiglu: bool,
) -> None:
    """A clear error for a norm or a stream that does not fit the GEMM (shapes, dtypes, layout)."""
    m, k = x.shape
    n = w.out_features
    if norm is not None:
        _expect(norm.sumsq, (m, k // BLOCK_COLS), torch.float32, "the norm's sumsq")
    if (add_to is None) != (next_norm is None):
        raise ValueError("add_to and next_norm go together")
    if add_to is None or next_norm is None:
        return
    if swiglu or n % BLOCK_COLS:
        raise ValueError(f"add_to takes a product of whole column blocks and no swiglu, not {n} columns")
    _expect(add_to, (m, n), x.dtype, "add_to")
    _expect(next_norm.weight, (n,), x.dtype, "the next norm's weight")
    _expect(next_norm.normed, (m, n), x.dtype, "the next norm's input")
    _expect(next_norm.sumsq, (m, n // BLOCK_COLS), torch.float32, "the next norm's sumsq")


def _expect(
    t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, what: str, rows_strided: bool = False
) -> None:
    """A clear error unless t has this shape and dtype and is contiguous (rows_strided: its last dimension is)."""
    laid = t.stride(-1) == 1 if rows_strided else t.is_contiguous()
    if t.shape != shape or t.dtype != dtype or not laid:
        contiguous = "rows contiguous" if rows_strided else "contiguous"
        raise ValueError(f"{what}: {tuple(t.shape)} {t.dtype}, expected {shape} {dtype}, {contiguous}")


def w4a16_mma_reference(
    x: torch.Tensor,
    w: Int4Weight,
    bias: torch.Tensor | None = None,
    swiglu: bool = False,
    norm: NormedInput | None = None,
    add_to: torch.Tensor | None = None,
    next_norm: NextNorm | None = None,
    rope: RopeWrite | None = None,
) -> torch.Tensor:
    """w4a16_mma in fp32 torch, rounded where it rounds: the dequantized weights' product (times 1 / rms with a
    norm, plus the bias; then silu(gate) * up with swiglu) in fp32, or with add_to that product added into add_to
    (and next_norm's outputs). With rope the product rounded to x's dtype, its query heads rotated in place and
    its key and value heads written into the cache (rotary_kv_write's reference)."""
    from kernels.rotary_kv_write import rotary_kv_write_reference
    from kernels.w4a16_gemm import w4a16_gemm_reference

    out = w4a16_gemm_reference(x.float(), w)
    if norm is not None:
        out = out * torch.rsqrt(norm.sumsq.sum(-1, keepdim=True) / x.shape[1] + norm.eps)
    if bias is not None:
        out = out + bias.float()
    if swiglu:
        gate, up = out.to(x.dtype).float().chunk(2, dim=-1)
        out = torch.nn.functional.silu(gate).to(x.dtype).float() * up
    if rope is not None:
        out = out.to(x.dtype)
        heads, kvh, d = rope.num_heads, rope.num_kv_heads, rope.head_dim
        q, k, v = out.split([heads * d, kvh * d, kvh * d], dim=-1)
        rotary_kv_write_reference(
            q.view(-1, heads, d), k.view(-1, kvh, d), v.view(-1, kvh, d), rope.positions, rope.cos_sin_cache,
            rope.kv_cache, rope.slot_mapping,
        )  # fmt: skip
        return out
    if add_to is None or next_norm is None:
        return out
    h = (out.to(x.dtype).float() + add_to.float()).to(x.dtype)
    add_to.copy_(h)
    normed, sumsq = norm_input_reference(h, next_norm.weight)
    next_norm.normed.copy_(normed)
    next_norm.sumsq.copy_(sumsq)
    return add_to
