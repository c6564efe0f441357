"""W4A16 GEMM for decode batches and small prefills (MIN_ROWS..MAX_ROWS rows of x) on Hopper's warpgroup MMA, over
the same fragment-laid int4 weights as kernels/w4a16_mma.py (kernels/int4_dequant.py: to_fragments).

The product is taken transposed, out^T = W x^T, so that the dequantized weights are the MMA's A operand, which
wgmma takes from registers, and x's rows are its N (B comes only from shared memory):
- A program has WG warpgroups and owns 64 * WG output columns: warp w takes column block pid * 4 * WG + w, whose
  words (16 bytes a lane a 64-row quad) are already the A fragments of its 16 rows. The nibbles go under the
  16-bit magic exponent and the zero comes off by one FMA a register (q - z, exact), as in kernels/w4a16_mma.py;
  a word is dequantized once for all BM rows of x of the program, where the mma.sync kernel does it once per 16.
- The TMA unit streams each chunk (64 or 128 of K) of x's (BM, chunk) tile and of the program's words into a ring
  of STAGES slots, one mbarrier a slot; the words go through registers (one 16-byte shared load a lane a quad)
  and x's tile is the wgmma's K-major B. Inside a chunk the fragment layout permutes K; x is gathered into that
  order once a call (`chunk_order`, composed with GPTQ's act-order permutation), so its tiles are plain boxes.
- Each chunk's product is taken fresh and scaled per column (a chunk lies in one group), added into fp32 sums. A
  slot is refilled once every warp is past it (one CTA barrier a chunk).
- Split-K where the column tiles alone leave SMs idle: each split writes fp32 partials, and _sum_splits adds them
  in split order (deterministic), adds the bias and writes x's dtype.
Measured against the mma.sync kernel, dequantize + cuBLAS and bf16 by `python3 -m bench.quant_int4 --chunked`.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.experimental.gluon as gluon
import triton.experimental.gluon.language as gl
import triton.language as tl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kernels import _backend
from kernels._backend import num_sms
from kernels.int4_dequant import Int4Weight
from kernels.w4a16_mma import _index, _slices, folded_a

# rows of x this kernel takes: below, kernels/w4a16_mma.py is faster (one or two 16-row programs a column block);
# above, dequantizing once for cuBLAS is (bench.quant_int4 --chunked)
MIN_ROWS, MAX_ROWS = 33, 256
STAGES = 3  # chunks in flight a program: more cost programs an SM their shared memory


@gluon.jit
def _dequant(P, z0, z1, FP16: gl.constexpr, W: gl.constexpr, Q: gl.constexpr, A_L: gl.constexpr):
    """(W * 16, Q * 64) A operand of q - z in the 16-bit type from one chunk's words (W, Q, 4, 8, 4) and the zeros
    of columns g and g + 8 of each block (W, 1, 1, 8, 1): the mma.sync kernel's fragments, its W warps' 16 rows
    stacked as wgmma's 64 (or 128)."""
    A = gl.reshape(folded_a(P, z0, z1, FP16, W, Q), (W * 16, Q * 64))
    return gl.convert_layout(A, A_L, assert_trivial=True)


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
    """(K,) int64: the column of x that position p of the fragment layout's K order reads. Inside each chunk of
    Q * 64, p = ((kb * 2 + r1) * 4 + t) * 2 + h holds column t * Q * 16 + kb * 4 + r1 * 2 + h."""
    q = chunk // 64
    p = torch.arange(chunk)
    h, t, r1, kb = p % 2, (p // 2) % 4, (p // 8) % 2, p // 16
    inside = t * (q * 16) + kb * 4 + r1 * 2 + h
    return (torch.arange(0, k, chunk).unsqueeze(1) + inside).reshape(-1).to(device)


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


def config(m: int, n: int, k: int, chunk: int, device: torch.device) -> tuple[int, int, int]:
    """(rows of x a program, warpgroups a program, K splits) from a sweep of a Llama-3-8B layer at 32-256 rows (H100):
    64 rows a program up to 64, else 128; two warpgroups (128 columns, x's tile read once for both) where one-group
    programs of one row tile would be two waves or more (gate_up); K split so that about two programs share each SM,
    each split at least 4 chunks."""
    bm = 64 if m <= 64 else 128
    sms = num_sms(device)
    wg = 2 if m <= 64 and triton.cdiv(n, 64) >= 2 * sms else 1
    tiles = triton.cdiv(n, 64 * wg) * triton.cdiv(m, bm)
    split = max(1, min(k // chunk // 4, round(2 * sms / tiles)))
    return bm, wg, split


@gluon.jit
def _w4a16_wgmma_kernel(
    x_desc, w_desc, s_ptr, z_ptr, bias_ptr, out_ptr, M, N, K, stride_om, chunks_per_split,
    GROUP: gl.constexpr, FP16: gl.constexpr, HAS_BIAS: gl.constexpr, Q: gl.constexpr, BM: gl.constexpr,
    WG: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr, MMA: gl.constexpr, WL: gl.constexpr,
    PL: gl.constexpr, P3: gl.constexpr, P0: gl.constexpr, C0: gl.constexpr, C1: gl.constexpr,
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
    ws = gl.allocate_shared_memory(gl.int32, [STAGES, W, Q * 128], w_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()
    NBYTES: gl.constexpr = BM * BK * 2 + W * Q * 512
    for i in gl.static_range(STAGES):
        ok = i < n
        mbarrier.expect(bars.index(i), NBYTES, pred=ok)
        tma.async_copy_global_to_shared(
            x_desc, [pid_m * BM, (ch0 + i) * BK], bars.index(i), xs.index(i), pred=ok
        )
        tma.async_copy_global_to_shared(
            w_desc, [pid_n * W, (ch0 + i) * (Q * 128)], bars.index(i), ws.index(i), pred=ok
        )
    # (W, 1, 1, 8, 1): columns g of each block, whose zeros fold into its registers (g + 8: the other half)
    zc = (pid_n * W + _index(W, 0, 5, P0)) * 16 + _index(8, 3, 5, P3)
    cols = pid_n * (W * 16) + _index(W * 16, 0, 2, C0)  # (W * 16, 1) in the accumulator's layout
    cmask = cols < N
    total = gl.zeros([W * 16, BM], gl.float32, MMA)
    zero = gl.zeros([W * 16, BM], gl.float32, MMA)
    for j in range(0, n):
        grp = ((ch0 + j) * BK) // GROUP
        z0 = gl.load(z_ptr + grp * N + zc, mask=zc < N, other=0)
        z1 = gl.load(z_ptr + grp * N + zc + 8, mask=zc + 8 < N, other=0)
        s = gl.load(s_ptr + grp * N + cols, mask=cmask, other=0.0).to(gl.float32)
        st = j % STAGES
        mbarrier.wait(bars.index(st), (j // STAGES) & 1)
        words = ws.index(st).load(WL)  # (W, Q * 128): lane g * 4 + t's four words of each quad
        P = gl.permute(gl.reshape(words, (W, Q, 8, 4, 4)), (0, 1, 4, 2, 3))
        P = gl.convert_layout(P, PL, assert_trivial=True)
        A = _dequant(P, z0, z1, FP16, W, Q, A_L)
        acc = warpgroup_mma(A, xs.index(st).permute((1, 0)), zero, use_acc=False)
        gl.thread_barrier()  # every warp is done with this stage: refill it
        fence_async_shared()
        ok = j + STAGES < n
        mbarrier.expect(bars.index(st), NBYTES, pred=ok)
        nk = ch0 + j + STAGES
        tma.async_copy_global_to_shared(x_desc, [pid_m * BM, nk * BK], bars.index(st), xs.index(st), pred=ok)
        tma.async_copy_global_to_shared(
            w_desc, [pid_n * W, nk * (Q * 128)], bars.index(st), ws.index(st), pred=ok
        )
        total += acc * s
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
    on = pid_m * BM + _index(BM, 1, 2, C1)  # (1, BM)
    omask = cmask & (on < M)
    if SPLIT > 1:  # fp32 partials (SPLIT, M, N), summed by _sum_splits
        gl.store(out_ptr + (split * M + on) * N + cols, total, mask=omask)
    else:
        if HAS_BIAS:
            total += gl.load(bias_ptr + cols, mask=cmask, other=0.0).to(gl.float32)
        gl.store(out_ptr + on * stride_om + cols, total.to(DT), mask=omask)


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
    block_m: int | None = None,  # these three: config() by default
    warpgroups: int | None = None,
    split: int | None = None,
    stages: int = STAGES,
) -> torch.Tensor:
    """(M, K) 16-bit x of MIN_ROWS..MAX_ROWS rows against fragment-laid int4 weights with integer zeros: (M, N) in
    x's dtype."""
    if not applies(x, w):
        raise ValueError(
            f"w4a16_wgmma takes fragment-laid weights with integer zeros and {MIN_ROWS}..{MAX_ROWS} rows of 16-bit x "
            "on a Hopper GPU"
        )
    m, k = x.shape
    n = w.out_features
    bk = w.chunk
    q = bk // 64
    order = chunk_order(k, bk, x.device)
    if w.perm is not None:
        order = w.perm[order]
    xo = x.index_select(1, order)
    bm, wg, sp = config(m, n, k, bk, x.device)
    bm, wg, sp = block_m or bm, warpgroups or wg, split or sp
    per = triton.cdiv(k // bk, sp)
    sp = triton.cdiv(k // bk, per)  # no split left empty
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    dst = torch.empty(sp, m, n, dtype=torch.float32, device=x.device) if sp > 1 else out
    gdt = gl.float16 if x.dtype == torch.float16 else gl.bfloat16
    x_desc = TensorDescriptor.from_tensor(xo, [bm, bk], gl.NVMMASharedLayout.get_default_for([bm, bk], gdt))
    w_desc = TensorDescriptor.from_tensor(
        w.qweight.view(w.qweight.shape[0], -1), [4 * wg, q * 128],
        gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2),
    )  # fmt: skip
    _w4a16_wgmma_kernel[(triton.cdiv(n, 64 * wg), triton.cdiv(m, bm), sp)](
        x_desc, w_desc, w.scales, w.zeros, bias if bias is not None else out, dst, m, n, k, out.stride(0), per,
        GROUP=w.group_size, FP16=x.dtype == torch.float16, HAS_BIAS=bias is not None, Q=q, BM=bm, WG=wg,
        STAGES=stages, SPLIT=sp, num_warps=4 * wg, **_layouts(q, bm, wg),
    )  # fmt: skip
    if sp > 1:
        block = 1024
        _sum_splits[(triton.cdiv(m * n, block),)](
            dst, bias if bias is not None else out, out, m, n, out.stride(0), SPLIT=sp, HAS_BIAS=bias is not None,
            BLOCK=block,
        )  # fmt: skip
    return out
