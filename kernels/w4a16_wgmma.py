"""W4A16 GEMM for decode batches and small prefills (MIN_ROWS..MAX_ROWS rows of x) on Hopper's warpgroup MMA, over
the same fragment-laid int4 weights as kernels/w4a16_mma.py (kernels/int4_dequant.py: to_fragments).

The product is taken transposed, out^T = W x^T, so that the dequantized weights are the MMA's A operand, which
wgmma takes from registers, and x's rows are its N (B comes only from shared memory):
- A program has WG warpgroups, each owning MB tiles of 64 output columns: in tile t, warp w takes a column block whose
  words (16 bytes a lane a 64-row quad) are already the A fragments of its 16 rows. The nibbles go under the 16-bit
  magic exponent, the zero comes off by one FMA a register (q - z, exact), and the scale goes on in two more
  (_scaled_a), so each weight is the dense layer's 16-bit weight, rounded once; a word is dequantized once for all BM
  rows of x of the program, where the mma.sync kernel does it once per 16.
- The TMA unit streams each chunk (64 or 128 of K) of x's (BM, chunk) tile and of the program's words into a ring
  of STAGES slots, one mbarrier a slot; the words go through registers (one 16-byte shared load a lane a quad)
  and x's tile is the wgmma's K-major B. Inside a chunk the fragment layout permutes K; x is gathered into that
  order once a call (`x_order`: `chunk_order`, composed once a weight with GPTQ's act-order permutation), so its
  tiles are plain boxes, unless the kernel that made x wrote it in that order (`ordered`).
- The MMAs accumulate in place, one fp32 accumulator a tile, issued asynchronously and kept in flight across chunks:
  each tile's MMA runs while the other tile's words are dequantized (with one tile a warpgroup, or overlap=False,
  each chunk's MMAs are waited for before the next chunk's dequant). A slot is refilled once its chunk's last MMA is
  retired and every warp is past it (one CTA barrier a chunk).
- Split-K where the column tiles alone leave SMs idle: each split writes fp32 partials, and _sum_splits adds them
  in split order (deterministic), adds the bias and writes x's dtype.
Measured against the mma.sync kernel, dequantize + cuBLAS and bf16 by `python3 -m bench.quant_int4 --chunked`; its
configs by `--sweep-wgmma`.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
import triton
import triton.experimental.gluon as gluon
import triton.experimental.gluon.language as gl
import triton.language as tl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kernels import _backend
from kernels._backend import num_sms
from kernels.int4_dequant import Int4Weight, layout_order
from kernels.w4a16_mma import _a_order, _halves, _index, _slices

# rows of x this kernel takes: below, kernels/w4a16_mma.py is faster (one or two 16-row programs a column block);
# above, dequantizing once for cuBLAS is (bench.quant_int4 --chunked)
MIN_ROWS, MAX_ROWS = 33, 256


def _scaled_asm(kind: str, one: int, magic: int) -> str:
    """(q - z) * s per register of two 16-bit values: the nibbles of $1 under the magic exponent, less the zero's $3
    by one FMA (exact), times the scale's rest $5 (exact), then one FMA with the rounded scale $7 (_scaled_a)."""
    return (
        f"{{ .reg .b32 t, one, nz, d; mov.b32 one, {one:#010x}; mov.b32 nz, 0x80008000; "
        f"lop3.b32 t, $1, 0x000F000F, {magic:#010x}, 0xEA; fma.rn.{kind} t, t, one, $3; "
        f"fma.rn.{kind} d, t, $5, nz; fma.rn.{kind} $0, t, $7, d; }}"
    )


_SCALED_F16 = gl.constexpr(_scaled_asm("f16x2", 0x3C003C00, 0x64006400))
_SCALED_BF16 = gl.constexpr(_scaled_asm("bf16x2", 0x3F803F80, 0x43004300))
_SCALED_IO = gl.constexpr("=r,r,r,r,r,r,r,r,r")


@gluon.jit
def _split_scale(s, FP16: gl.constexpr):
    """A scale as (hi, lo) in x's 16-bit type, each repeated in both halves of an int32: hi the scale rounded, lo the
    rest, exact for fp16 or bf16 scales (at most 3 bits are left), so that (q - z) * lo is exact too."""
    DT: gl.constexpr = gl.float16 if FP16 else gl.bfloat16
    hi = s.to(DT)
    lo = (s - hi.to(gl.float32)).to(DT)
    h = hi.to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
    l16 = lo.to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
    return h | (h << 16), l16 | (l16 << 16)


@gluon.jit
def _pairs(a, b, P):
    """Per-column values a (column g of each block) and b (g + 8), broadcast and joined as the words' halves are."""
    a, _ = gl.broadcast(a, P)
    b, _ = gl.broadcast(b, P)
    Z = gl.join(gl.join(a, a), gl.join(b, b))
    return gl.join(Z, Z)


@gluon.jit
def _scaled_a(words, z0, z1, s0, s1, FP16: gl.constexpr, W: gl.constexpr, Q: gl.constexpr, PL: gl.constexpr,
              A_L: gl.constexpr):  # fmt: skip
    """(W * 16, Q * 64) A operand of (q - z) * s in the 16-bit type, rounded once as the dense weights are, from one
    chunk's words (W, Q * 128) and the zeros and scales of columns g and g + 8 of each block (W, 1, 1, 8, 1): the
    mma.sync kernel's fragments, its W warps' 16 rows stacked as wgmma's 64 (or 128). Per register: the nibbles under
    the magic exponent, (magic + q) - (magic + z) by one FMA (exact), times the scale's rest (exact), then one FMA
    with the rounded scale, so the product is rounded once."""
    P = gl.permute(gl.reshape(words, (W, Q, 8, 4, 4)), (0, 1, 4, 2, 3))
    P = gl.convert_layout(P, PL, assert_trivial=True)
    J = _halves(P)
    NEG: gl.constexpr = 0xE400 if FP16 else 0xC300  # -(magic) in the 16-bit type; + z in its low bits
    za = z0.to(gl.int32) + NEG
    zb = z1.to(gl.int32) + NEG
    Z = _pairs(za | (za << 16), zb | (zb << 16), P)
    h0, l0 = _split_scale(s0, FP16)
    h1, l1 = _split_scale(s1, FP16)
    SH = _pairs(h0, h1, P)
    SL = _pairs(l0, l1, P)
    if FP16:
        A = gl.inline_asm_elementwise(
            _SCALED_F16, _SCALED_IO, [J, Z, SL, SH], dtype=gl.float16, is_pure=True, pack=2
        )
    else:
        A = gl.inline_asm_elementwise(
            _SCALED_BF16, _SCALED_IO, [J, Z, SL, SH], dtype=gl.bfloat16, is_pure=True, pack=2
        )
    A = gl.reshape(_a_order(A, W, Q), (W * 16, Q * 64))
    return gl.convert_layout(A, A_L, assert_trivial=True)


@triton.jit
def _gather_columns_kernel(x_ptr, idx_ptr, out_ptr, K, stride_xm, stride_xk, stride_om, BLOCK: tl.constexpr):
    """out[m, p] = x[m, idx[p]] for one row and BLOCK positions a program: the columns of a chunk lie within a few
    hundred bytes of each other, so the gathered loads stay in the lines one chunk's row fills."""
    row = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = p < K
    col = tl.load(idx_ptr + p, mask=mask, other=0)
    tl.store(
        out_ptr + row * stride_om + p,
        tl.load(x_ptr + row * stride_xm + col * stride_xk, mask=mask),
        mask=mask,
    )


def gather_columns(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """x.index_select(1, order), contiguous, in one Triton launch: 2.6 us a GEMM at 128 rows where torch's gather
    along the inner dimension took 6.6 (H100)."""
    m, k = x.shape
    out = torch.empty(m, k, dtype=x.dtype, device=x.device)
    block = 1024
    _gather_columns_kernel[(m, triton.cdiv(k, block))](
        x, order, out, k, x.stride(0), x.stride(1), out.stride(0), BLOCK=block
    )
    return out


@triton.jit
def _sum_splits(part_ptr, bias_ptr, out_ptr, M, N, stride_om, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                BLOCK: tl.constexpr):  # fmt: skip
    """out = sum over splits of the fp32 partials, in split order, plus the bias, in out's dtype."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < M * N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(SPLIT):
        acc += tl.load(part_ptr + s * M * N + i, mask=mask, other=0.0)
    col = i % N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + col, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + (i // N) * stride_om + col, acc.to(out_ptr.dtype.element_ty), mask=mask)


@functools.cache
def chunk_order(k: int, chunk: int, device: torch.device) -> torch.Tensor:
    """(K,) int64: the column of x that position p of the fragment layout's K order reads (layout_order), made once."""
    return layout_order(k, chunk, device)


_PERM_ORDERS: dict[int, torch.Tensor] = {}  # id of a weight's perm -> its x_order, dropped with the perm


def x_order(w: Int4Weight) -> torch.Tensor:
    """The columns of x in fragment-laid w's K order: chunk_order, read through GPTQ's act-order permutation, which
    is composed once a weight (an index launch a call otherwise), the first call made eagerly before any capture."""
    order = chunk_order(w.in_features, w.chunk, w.qweight.device)
    if w.perm is None:
        return order
    key = id(w.perm)
    got = _PERM_ORDERS.get(key)
    if got is None:
        got = _PERM_ORDERS[key] = w.perm[order]
        weakref.finalize(w.perm, _PERM_ORDERS.pop, key, None)
    return got


def chosen(x: torch.Tensor, w: Int4Weight) -> bool:
    """Whether the dispatch (kernels/w4a16_gemm.py, the engine's fused path) sends x to this kernel: it applies and
    PDSERVE_WGMMA is not 0."""
    return _backend.WGMMA and applies(x, w)


def applies(x: torch.Tensor, w: Int4Weight) -> bool:
    """Whether this kernel takes x against w: fragment-laid weights with integer zeros, 16-bit x of MIN_ROWS to
    MAX_ROWS rows on a Hopper GPU, the Triton path not forced off."""
    return (
        w.layout == "fragments" and not w.zero_is_offset and x.is_cuda and _backend.use_triton(x)
        and x.dtype in (torch.bfloat16, torch.float16) and MIN_ROWS <= x.shape[0] <= MAX_ROWS
        and torch.cuda.get_device_capability(x.device)[0] == 9
    )  # fmt: skip


def config(m: int, n: int, k: int, chunk: int, device: torch.device) -> tuple[int, int, int, int]:
    """(rows of x a program, warpgroups a program, 64-column tiles a warpgroup, K splits) from sweeps of a Llama-3-8B
    layer's GEMMs at 64-256 rows (`bench.quant_int4 --sweep-wgmma`): 64 rows a program up to 64, else 128; one
    warpgroup of two column tiles (128 columns: half the x tiles of one, and the second tile's dequant under the
    first's MMA; two warpgroups or 256 rows a program were slower); each split at least 4 chunks. At 128 rows a
    program, where the column tiles fit one wave, K is split to one program an SM, which then takes three stages
    (ring_stages); else to about two an SM (qkv and o 3-21% faster, down 2-3% slower, H100)."""
    bm = 64 if m <= 64 else 128
    sms = num_sms(device)
    tiles = triton.cdiv(n, 128) * triton.cdiv(m, bm)
    most = max(1, k // chunk // 4)
    if bm == 128 and tiles <= sms:
        return bm, 1, 2, min(most, sms // tiles)
    return bm, 1, 2, max(1, min(most, round(2 * sms / tiles)))


def ring_stages(block_m: int, programs: int, device: torch.device) -> int:
    """Ring slots for a launch of `programs` programs of block_m rows: three at 64 rows; at 128 three stages of
    128-row chunks take over half an SM's shared memory, so three only where the programs fit one a SM (two a SM at
    two stages were slower there; split so that a second wave runs, three stages were 12% slower than two)."""
    return 3 if block_m == 64 or block_m == 128 and programs <= num_sms(device) else 2


@gluon.jit
def _zeros_scales(z_ptr, s_ptr, grp, N, vp, W: gl.constexpr, P0: gl.constexpr, P3: gl.constexpr):
    """Zeros and scales (fp32) of one chunk's group for columns g and g + 8 of each of column tile vp's W blocks, each
    (W, 1, 1, 8, 1) in the words' layout."""
    zc = (vp * W + _index(W, 0, 5, P0)) * 16 + _index(8, 3, 5, P3)
    z0 = gl.load(z_ptr + grp * N + zc, mask=zc < N, other=0)
    z1 = gl.load(z_ptr + grp * N + zc + 8, mask=zc + 8 < N, other=0)
    s0 = gl.load(s_ptr + grp * N + zc, mask=zc < N, other=0.0).to(gl.float32)
    s1 = gl.load(s_ptr + grp * N + zc + 8, mask=zc + 8 < N, other=0.0).to(gl.float32)
    return z0, z1, s0, s1


@gluon.jit
def _store(total, bias_ptr, out_ptr, M, N, stride_om, pid_m, vp, split, W: gl.constexpr, BM: gl.constexpr,
           PARTIALS: gl.constexpr, HAS_BIAS: gl.constexpr, DT: gl.constexpr, C0: gl.constexpr, C1: gl.constexpr):  # fmt: skip
    """Column tile vp's sums: fp32 partials (splits, M, N) for _sum_splits, or plus the bias in x's dtype."""
    cols = vp * (W * 16) + _index(W * 16, 0, 2, C0)  # (W * 16, 1) in the accumulator's layout
    cmask = cols < N
    on = pid_m * BM + _index(BM, 1, 2, C1)  # (1, BM)
    omask = cmask & (on < M)
    if PARTIALS:
        gl.store(out_ptr + (split * M + on) * N + cols, total, mask=omask)
    else:
        if HAS_BIAS:
            total += gl.load(bias_ptr + cols, mask=cmask, other=0.0).to(gl.float32)
        gl.store(out_ptr + on * stride_om + cols, total.to(DT), mask=omask)


@gluon.jit
def _tile_mma(wtile, xtile, acc, z0, z1, s0, s1, FP16: gl.constexpr, W: gl.constexpr, Q: gl.constexpr,
              WL: gl.constexpr, PL: gl.constexpr, A_L: gl.constexpr):  # fmt: skip
    """Issue one column tile's MMA for a chunk, asynchronously, from its words (W, Q * 128) and x's (BM, Q * 64) in
    shared memory."""
    A = _scaled_a(wtile.load(WL), z0, z1, s0, s1, FP16, W, Q, PL, A_L)
    return warpgroup_mma(A, xtile.permute((1, 0)), acc, is_async=True)


@gluon.jit
def _w4a16_wgmma_kernel(
    x_desc, w_desc, s_ptr, z_ptr, bias_ptr, out_ptr, M, N, K, stride_om, chunks_per_split,
    GROUP: gl.constexpr, FP16: gl.constexpr, HAS_BIAS: gl.constexpr, Q: gl.constexpr, BM: gl.constexpr,
    WG: gl.constexpr, MB: gl.constexpr, STAGES: gl.constexpr, PARTIALS: gl.constexpr, OVERLAP: gl.constexpr,
    MMA: gl.constexpr,
    WL: gl.constexpr, PL: gl.constexpr, P3: gl.constexpr, P0: gl.constexpr, C0: gl.constexpr, C1: gl.constexpr,
):  # fmt: skip
    W: gl.constexpr = 4 * WG
    BK: gl.constexpr = Q * 64
    DT: gl.constexpr = gl.float16 if FP16 else gl.bfloat16
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    pid_n = gl.program_id(0)
    pid_m = gl.program_id(1)
    split = gl.program_id(2)
    n_chunks = K // BK
    ch0 = split * chunks_per_split
    n = gl.minimum(ch0 + chunks_per_split, n_chunks) - ch0
    xs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BM, BK], x_desc.layout)
    ws = gl.allocate_shared_memory(gl.int32, [STAGES, MB * W, Q * 128], w_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()
    NBYTES: gl.constexpr = BM * BK * 2 + MB * W * Q * 512
    for i in gl.static_range(STAGES):
        ok = i < n
        mbarrier.expect(bars.index(i), NBYTES, pred=ok)
        tma.async_copy_global_to_shared(
            x_desc, [pid_m * BM, (ch0 + i) * BK], bars.index(i), xs.index(i), pred=ok
        )
        tma.async_copy_global_to_shared(
            w_desc, [pid_n * MB * W, (ch0 + i) * (Q * 128)], bars.index(i), ws.index(i), pred=ok
        )
    # the program's column tiles: vp0 (and vp0 + 1 when MB is 2), W blocks of 16 columns each
    vp0 = pid_n * MB
    acc0 = gl.zeros([W * 16, BM], gl.float32, MMA)
    acc1 = gl.zeros([W * 16, BM], gl.float32, MMA)
    if OVERLAP:
        # each tile's MMA stays in flight while the other tile's words are dequantized, across chunks too: tile 1's
        # A operand is carried round the loop until its MMA is done, and a tile's next A is made only once its last
        # MMA is done, so it may take the same registers; the zeros and scales of the next chunk are loaded a chunk
        # ahead. (One tile cannot: its next A would be made while its last MMA reads the registers it takes.)
        last = gl.zeros([W * 16, Q * 64], DT, A_L)
        grp = (ch0 * BK) // GROUP
        z00, z01, s00, s01 = _zeros_scales(z_ptr, s_ptr, grp, N, vp0, W, P0, P3)
        z10, z11, s10, s11 = _zeros_scales(z_ptr, s_ptr, grp, N, vp0 + 1, W, P0, P3)
        for j in range(0, n):
            nxt = ((ch0 + gl.minimum(j + 1, n - 1)) * BK) // GROUP
            y00, y01, t00, t01 = _zeros_scales(z_ptr, s_ptr, nxt, N, vp0, W, P0, P3)
            y10, y11, t10, t11 = _zeros_scales(z_ptr, s_ptr, nxt, N, vp0 + 1, W, P0, P3)
            st = j % STAGES
            mbarrier.wait(bars.index(st), (j // STAGES) & 1)
            a0 = _scaled_a(ws.index(st).slice(0, W).load(WL), z00, z01, s00, s01, FP16, W, Q, PL, A_L)
            acc0 = warpgroup_mma(a0, xs.index(st).permute((1, 0)), acc0, is_async=True)
            # the MMAs of the chunk before are done: its slot is free
            acc0, acc1, last = warpgroup_mma_wait(1, deps=[acc0, acc1, last])
            gl.thread_barrier()
            fence_async_shared()
            pst = (j + STAGES - 1) % STAGES
            ok = (j > 0) & (j + STAGES - 1 < n)
            mbarrier.expect(bars.index(pst), NBYTES, pred=ok)
            nk = ch0 + j + STAGES - 1
            tma.async_copy_global_to_shared(
                x_desc, [pid_m * BM, nk * BK], bars.index(pst), xs.index(pst), pred=ok
            )
            tma.async_copy_global_to_shared(
                w_desc, [pid_n * MB * W, nk * (Q * 128)], bars.index(pst), ws.index(pst), pred=ok
            )
            a1 = _scaled_a(ws.index(st).slice(W, W).load(WL), z10, z11, s10, s11, FP16, W, Q, PL, A_L)
            acc1 = warpgroup_mma(a1, xs.index(st).permute((1, 0)), acc1, is_async=True)
            acc0, acc1, a0 = warpgroup_mma_wait(1, deps=[acc0, acc1, a0])
            last = a1
            z00, z01, s00, s01 = y00, y01, t00, t01
            z10, z11, s10, s11 = y10, y11, t10, t11
        acc0, acc1, last = warpgroup_mma_wait(0, deps=[acc0, acc1, last])
    else:
        for j in range(0, n):
            grp = ((ch0 + j) * BK) // GROUP
            z00, z01, s00, s01 = _zeros_scales(z_ptr, s_ptr, grp, N, vp0, W, P0, P3)
            if MB == 2:
                z10, z11, s10, s11 = _zeros_scales(z_ptr, s_ptr, grp, N, vp0 + 1, W, P0, P3)
            st = j % STAGES
            mbarrier.wait(bars.index(st), (j // STAGES) & 1)
            # MMAs issued asynchronously: the second tile's dequant runs under the first tile's MMA
            acc0 = _tile_mma(ws.index(st).slice(0, W), xs.index(st), acc0, z00, z01, s00, s01, FP16, W, Q, WL,
                             PL, A_L)  # fmt: skip
            if MB == 2:
                acc1 = _tile_mma(ws.index(st).slice(W, W), xs.index(st), acc1, z10, z11, s10, s11, FP16, W, Q, WL,
                                 PL, A_L)  # fmt: skip
                acc0, acc1 = warpgroup_mma_wait(0, deps=[acc0, acc1])
            else:
                acc0 = warpgroup_mma_wait(0, deps=[acc0])
            gl.thread_barrier()  # every warp is done with this stage: refill it
            fence_async_shared()
            ok = j + STAGES < n
            mbarrier.expect(bars.index(st), NBYTES, pred=ok)
            nk = ch0 + j + STAGES
            tma.async_copy_global_to_shared(
                x_desc, [pid_m * BM, nk * BK], bars.index(st), xs.index(st), pred=ok
            )
            tma.async_copy_global_to_shared(
                w_desc, [pid_n * MB * W, nk * (Q * 128)], bars.index(st), ws.index(st), pred=ok
            )
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
    _store(acc0, bias_ptr, out_ptr, M, N, stride_om, pid_m, vp0, split, W, BM, PARTIALS, HAS_BIAS, DT, C0, C1)
    if MB == 2:
        _store(acc1, bias_ptr, out_ptr, M, N, stride_om, pid_m, vp0 + 1, split, W, BM, PARTIALS, HAS_BIAS, DT, C0,
               C1)  # fmt: skip


@functools.cache
def _layouts(q: int, bm: int, wg: int) -> dict[str, Any]:
    w = 4 * wg
    mma = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[w, 1], instr_shape=[16, bm, 16])
    words = gl.BlockedLayout(
        size_per_thread=[1, q, 4, 1, 1], threads_per_warp=[1, 1, 1, 8, 4], warps_per_cta=[w, 1, 1, 1, 1],
        order=[2, 1, 4, 3, 0],
    )  # fmt: skip
    out: dict[str, Any] = {
        "MMA": mma,
        "WL": gl.BlockedLayout([1, 4], [1, 32], [w, 1], [1, 0]),
        "PL": words,
    }
    sl = _slices(words, 5)
    out["P0"], out["P3"] = sl[0], sl[3]
    c = _slices(mma, 2)
    out["C0"], out["C1"] = c[0], c[1]
    return out


def w4a16_wgmma(
    x: torch.Tensor,
    w: Int4Weight,
    bias: torch.Tensor | None = None,
    block_m: int | None = None,  # these four: config() by default; stages: ring_stages()
    warpgroups: int | None = None,
    column_tiles: int | None = None,
    split: int | None = None,
    stages: int | None = None,
    overlap: bool = True,
    ordered: bool = False,
) -> torch.Tensor:
    """(M, K) 16-bit x of MIN_ROWS..MAX_ROWS rows against fragment-laid int4 weights with integer zeros: (M, N) in
    x's dtype. overlap=False waits for each chunk's MMAs before the next chunk's dequant (the A-B; same products).
    ordered: x's columns already in the layout's K order (x_order without act order: the kernel that made x wrote
    them so), so that no gather runs."""
    if not applies(x, w):
        raise ValueError(
            f"w4a16_wgmma takes fragment-laid weights with integer zeros and {MIN_ROWS}..{MAX_ROWS} rows of 16-bit x "
            "on a Hopper GPU"
        )
    m, k = x.shape
    n = w.out_features
    bk = w.chunk
    q = bk // 64
    if ordered and w.perm is not None:
        raise ValueError(
            "w4a16_wgmma gathers x itself under act order: ordered x takes weights without a perm"
        )
    xo = x.contiguous() if ordered else gather_columns(x, x_order(w))
    bm, wg, mb, sp = config(m, n, k, bk, x.device)
    bm, wg, mb, sp = block_m or bm, warpgroups or wg, column_tiles or mb, split or sp
    if mb not in (1, 2):
        raise ValueError(f"w4a16_wgmma takes 1 or 2 column tiles a warpgroup, not {mb}")
    per = triton.cdiv(k // bk, sp)
    sp = triton.cdiv(k // bk, per)  # no split left empty
    grid = (triton.cdiv(n, 64 * wg * mb), triton.cdiv(m, bm), sp)
    st = stages or ring_stages(bm, grid[0] * grid[1] * sp, x.device)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    dst = torch.empty(sp, m, n, dtype=torch.float32, device=x.device) if sp > 1 else out
    gdt = gl.float16 if x.dtype == torch.float16 else gl.bfloat16
    x_desc = TensorDescriptor.from_tensor(xo, [bm, bk], gl.NVMMASharedLayout.get_default_for([bm, bk], gdt))
    w_desc = TensorDescriptor.from_tensor(
        w.qweight.view(w.qweight.shape[0], -1), [4 * wg * mb, q * 128],
        gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2),
    )  # fmt: skip
    _w4a16_wgmma_kernel[grid](
        x_desc, w_desc, w.scales, w.zeros, bias if bias is not None else out, dst, m, n, k, out.stride(0), per,
        GROUP=w.group_size, FP16=x.dtype == torch.float16, HAS_BIAS=bias is not None, Q=q, BM=bm, WG=wg,
        MB=mb, STAGES=st, PARTIALS=sp > 1, OVERLAP=overlap and mb == 2, num_warps=4 * wg,
        **_layouts(q, bm, wg),
    )  # fmt: skip
    if sp > 1:
        block = 1024
        _sum_splits[(triton.cdiv(m * n, block),)](
            dst, bias if bias is not None else out, out, m, n, out.stride(0), SPLIT=sp, HAS_BIAS=bias is not None,
            BLOCK=block,
        )  # fmt: skip
    return out
