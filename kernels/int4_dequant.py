"""Int4 weights in the kernels' layout, and their dequantization to a dense weight.

AWQ, GPTQ and GGUF Q4_0 / Q4_1 checkpoints are re-laid at load time (engine/layers/quant/) into one
layout that the W4A16 GEMM (kernels/w4a16_gemm.py) and this dequantizer read:

    qweight (K/8, N) int32   packed along K: bits 4j..4j+3 of qweight[r, n] hold q[8r + j, n], 0..15;
                             any strides: loaded layers hold it K-contiguous, stride (1, K/8), which
                             the small-batch GEMM reads fastest
    scales  (K/G, N) fp16    one scale per group of G input rows and output column
    zeros   (K/G, N) uint8   integer zero points:   w[k, n] = (q[k, n] - z[g, n]) * s[g, n]   (AWQ, GPTQ, Q4_0)
            (K/G, N) fp16    or float offsets:      w[k, n] = q[k, n] * s[g, n] + m[g, n]     (GGUF Q4_1)
    perm    (K,) int32       optional: row r of the layout is input feature perm[r] (GPTQ act order;
                             the rows are sorted so that every group is G consecutive rows)

with g = r // G. On a GPU, weights whose groups are a multiple of 64 rows (K too) are held instead in the MMA's
fragment order (layout "fragments", kernels/w4a16_mma.py), with the same scales, zeros and perm:

    qweight (ceil(N/16), K/64, 32, 4) int32   per 16-column block c, 64-row quad, lane (g, t) and word v, nibble
                             r + 4h of the word is column 16c + 8 (r & 1) + g, row ch * C + t * C/4 + kb * 4
                             + 2 (r >> 1) + h of chunk ch, where C (`chunk`, 64 or 128 rows: never more than a
                             group) holds C/64 quads and kb = (quad in chunk) * 4 + v; columns past N are zero

Products are exact in fp32 (a 4-bit integer times an fp16 scale), so the dense weight in
fp32 is bit for bit the one each format's own reference dequantization gives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import _backend

PACK = 8  # int4 values per int32


@dataclass(frozen=True)
class Int4Weight:
    qweight: torch.Tensor  # (K/8, N) int32
    scales: torch.Tensor  # (K/G, N) fp16
    zeros: torch.Tensor  # (K/G, N) uint8 zero points, or fp16 offsets
    group_size: int
    perm: torch.Tensor | None = None  # (K,) int32
    layout: str = "rows"  # or "fragments"
    chunk: int = 0  # rows of a fragment chunk (64 or 128), "fragments" only

    def __post_init__(self) -> None:
        if self.qweight.dtype != torch.int32:
            raise ValueError(f"qweight must be int32, got {self.qweight.dtype}")
        if self.layout == "fragments":
            k, n = self.scales.shape[0] * self.group_size, self.scales.shape[1]
            want = (-(-n // 16), k // 64, 32, 4)
            if (
                self.chunk not in (64, 128)
                or self.group_size % self.chunk
                or tuple(self.qweight.shape) != want
            ):
                raise ValueError(
                    f"fragment-laid qweight {tuple(self.qweight.shape)} in chunks of {self.chunk} must be {want} "
                    f"in chunks of 64 or 128 dividing the group size {self.group_size}"
                )
        elif self.layout == "rows":
            k8, n = self.qweight.shape
            k = k8 * PACK
        else:
            raise ValueError(f"unknown int4 layout {self.layout!r}: 'rows' or 'fragments'")
        if self.group_size <= 0 or self.group_size % PACK or k % self.group_size:
            raise ValueError(f"group size {self.group_size} must be a multiple of 8 dividing K={k}")
        groups = (k // self.group_size, n)
        if tuple(self.scales.shape) != groups or tuple(self.zeros.shape) != groups:
            raise ValueError(
                f"scales {tuple(self.scales.shape)} and zeros {tuple(self.zeros.shape)} must be {groups} "
                f"for qweight {tuple(self.qweight.shape)} in groups of {self.group_size}"
            )
        if self.zeros.dtype not in (torch.uint8, torch.float16) or self.scales.dtype != torch.float16:
            raise ValueError(
                f"scales must be fp16 and zeros uint8 or fp16, got {self.scales.dtype}, {self.zeros.dtype}"
            )
        if self.perm is not None and tuple(self.perm.shape) != (k,):
            raise ValueError(f"perm must be ({k},), got {tuple(self.perm.shape)}")

    @property
    def in_features(self) -> int:
        return self.scales.shape[0] * self.group_size

    @property
    def out_features(self) -> int:
        return self.scales.shape[1]

    @property
    def zero_is_offset(self) -> bool:
        return self.zeros.dtype == torch.float16


@triton.jit
def int4_values(packed, j: tl.constexpr):
    """Nibble j of every int32 as fp32 (0..15): the exponent trick (2^23 + q, minus 2^23), no int->float
    conversion instruction."""
    q = (packed >> (4 * j)) & 0xF
    return (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _int4_dequant_kernel(
    # pointers
    qw_ptr,
    s_ptr,
    z_ptr,
    perm_ptr,
    out_ptr,
    # sizes
    N,
    K,
    # strides
    stride_o,
    stride_qk,
    stride_qn,
    # meta
    GROUP: tl.constexpr,
    ZERO_IS_OFFSET: tl.constexpr,
    HAS_PERM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # (BLOCK_R,) packed rows
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < K // 8)[:, None] & (cols < N)[None, :]
    # (BLOCK_R, BLOCK_N)
    packed = tl.load(qw_ptr + rows[:, None] * stride_qk + cols[None, :] * stride_qn, mask=mask, other=0)
    groups = (rows * 8) // GROUP
    s = tl.load(s_ptr + groups[:, None] * N + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + groups[:, None] * N + cols[None, :], mask=mask, other=0).to(tl.float32)
    for j in tl.static_range(8):
        q = int4_values(packed, j)
        if ZERO_IS_OFFSET:
            w = q * s + z
        else:
            w = q * s - z * s
        k = rows * 8 + j
        if HAS_PERM:
            k = tl.load(perm_ptr + k, mask=rows < K // 8, other=0)
        tl.store(out_ptr + k[:, None] * stride_o + cols[None, :], w.to(out_ptr.dtype.element_ty), mask=mask)


def int4_dequant_triton(w: Int4Weight, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """The dense (K, N) weight in the checkpoint's input order (perm undone)."""
    k, n = w.in_features, w.out_features
    if out is None:
        out = torch.empty(k, n, dtype=dtype, device=w.qweight.device)
    assert out.shape == (k, n) and out.stride(1) == 1, f"out {tuple(out.shape)} for a ({k}, {n}) weight"
    if w.layout == "fragments":
        return _fragments_dequant_triton(w, out)
    block_r, block_n = 16, 128
    grid = (triton.cdiv(k // 8, block_r), triton.cdiv(n, block_n))
    perm = w.perm if w.perm is not None else w.qweight
    _int4_dequant_kernel[grid](
        w.qweight, w.scales, w.zeros, perm, out,
        n, k,
        out.stride(0), w.qweight.stride(0), w.qweight.stride(1),
        GROUP=w.group_size, ZERO_IS_OFFSET=w.zero_is_offset, HAS_PERM=w.perm is not None,
        BLOCK_R=block_r, BLOCK_N=block_n, num_warps=4,
    )  # fmt: skip
    return out


def pack_rows(q: torch.Tensor) -> torch.Tensor:
    """(K, N) values 0..15 -> (K/8, N) int32, packed as unpack_rows reads them."""
    k, n = q.shape
    pairs = q.to(torch.uint8).reshape(k // 8, 4, 2, n)  # rows 8r + 2b + h
    words = pairs[:, :, 0] | (pairs[:, :, 1] << 4)  # (K/8, 4, N): byte b of word (r, n)
    return words.permute(0, 2, 1).contiguous().view(torch.int32).squeeze(-1)


def unpack_rows(qweight: torch.Tensor) -> torch.Tensor:  # (K/8, N) int32 -> (K, N) uint8
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qweight.device)
    q = (qweight.unsqueeze(1) >> shifts[None, :, None]) & 0xF  # (K/8, 8, N)
    return q.reshape(-1, qweight.shape[1]).to(torch.uint8)


def int4_dequant_reference(w: Int4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(N, K) contiguous, in the checkpoint's input order: the layout a dense layer's weight has, so that
    F.linear over it computes what the dense model computes."""
    if w.layout == "fragments":
        w = fragments_to_rows(w)
    k, n, g = w.in_features, w.out_features, w.group_size
    words = w.qweight.t().contiguous().view(torch.uint8)  # (N, K/2): byte b of a word = rows 2b, 2b + 1
    q = torch.empty(n, k // 2, 2, dtype=torch.uint8, device=words.device)
    torch.bitwise_and(words, 0xF, out=q[..., 0])
    torch.bitwise_right_shift(words, 4, out=q[..., 1])
    dense = q.view(n, k // g, g).float()  # (N, K/G, G)
    s = w.scales.t().float().unsqueeze(2)  # (N, K/G, 1)
    if w.zero_is_offset:
        dense.mul_(s).add_(w.zeros.t().float().unsqueeze(2))
    else:
        dense.mul_(s).sub_(w.zeros.t().float().unsqueeze(2) * s)  # exact products in fp32
    dense = dense.view(n, k)
    if w.perm is not None:
        dense = torch.empty_like(dense).index_copy_(1, w.perm.long(), dense)
    return dense.to(dtype)


def int4_dequant(w: Int4Weight, dtype: torch.dtype) -> torch.Tensor:
    """The dense weight (N, K), as a dense layer holds it: contiguous from the reference, a transposed view
    of the kernel's (K, N) output on the Triton path (F.linear takes either)."""
    if _backend.use_triton(w.qweight):
        return int4_dequant_triton(w, dtype).t()
    return int4_dequant_reference(w, dtype)


# the fragment layout (see the module's docstring): what kernels/w4a16_mma.py reads
FRAGMENT_BLOCKS = 4  # 16-column blocks a dequantizing program owns: 128-byte rows of 64 bf16 columns


def fragment_chunk(w: Int4Weight) -> int:
    """The chunk rows the fragment layout would take for w (128 or 64), or 0 where it cannot hold w: groups must
    be a multiple of 64 rows."""
    for chunk in (128, 64):
        if w.group_size % chunk == 0:
            return chunk
    return 0


def layout_order(k: int, chunk: int, device: torch.device) -> torch.Tensor:
    """(K,) int64: layout_column of every position, the torch form."""
    q = chunk // 64
    p = torch.arange(chunk)
    h, t, r1, kb = p % 2, (p // 2) % 4, (p // 8) % 2, p // 16
    inside = t * (q * 16) + kb * 4 + r1 * 2 + h
    return (torch.arange(0, k, chunk).unsqueeze(1) + inside).reshape(-1).to(device)


@triton.jit
def layout_column(p, CHUNK: tl.constexpr):
    """The column of x that position p of the fragment layout's K order holds, in chunks of CHUNK (64 or 128) rows:
    inside a chunk, p = ((kb * 2 + r1) * 4 + t) * 2 + h holds column t * CHUNK / 4 + kb * 4 + r1 * 2 + h (a lane's
    x values one contiguous run; layout_order is its torch form). What a kernel that makes a
    wgmma GEMM's x reads from to write it in that order, so that the GEMM need not gather it."""
    inside = p % CHUNK
    h = inside % 2
    t = (inside // 2) % 4
    r1 = (inside // 8) % 2
    kb = inside // 16
    return p - inside + t * (CHUNK // 4) + kb * 4 + r1 * 2 + h


def to_fragments(w: Int4Weight) -> Int4Weight:
    """w re-laid in the MMA's fragment order; scales, zeros and perm as they are. ValueError where the layout
    cannot hold w (fragment_chunk is 0)."""
    if w.layout == "fragments":
        return w
    chunk = fragment_chunk(w)
    if not chunk:
        raise ValueError(f"the fragment layout takes groups of a multiple of 64 rows, not {w.group_size}")
    n, k, quads = w.out_features, w.in_features, chunk // 64
    blocks = -(-n // 16)
    q = torch.zeros(blocks * 16, k, dtype=torch.int32, device=w.qweight.device)
    q[:n] = unpack_rows(w.qweight).t()
    # (c, r0, g, ch, t, quad, v, r1, h) -> (c, ch, quad, g, t, v, h, r1, r0): word (c, ch * quads + quad, g * 4 + t,
    # v), nibble h * 4 + r1 * 2 + r0
    q = q.view(blocks, 2, 8, k // chunk, 4, quads, 4, 2, 2).permute(0, 3, 5, 2, 4, 6, 8, 7, 1)
    q = q.reshape(blocks, k // 64, 32, 4, 8)
    words = torch.zeros(q.shape[:-1], dtype=torch.int32, device=q.device)
    for j in range(8):
        words |= q[..., j] << (4 * j)  # wraps into the sign bit at j = 7, as int32 words do
    return Int4Weight(words, w.scales, w.zeros, w.group_size, w.perm, layout="fragments", chunk=chunk)


def fragments_to_rows(w: Int4Weight) -> Int4Weight:
    """The rows layout of fragment-laid w (torch; the CPU reference's way in)."""
    n, k, quads = w.out_features, w.in_features, w.chunk // 64
    blocks = w.qweight.shape[0]
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=w.qweight.device)
    q = (w.qweight.unsqueeze(-1) >> shifts) & 0xF  # (c, qd, lane, v, nibble)
    q = q.view(blocks, k // w.chunk, quads, 8, 4, 4, 2, 2, 2)  # (c, ch, quad, g, t, v, h, r1, r0)
    q = q.permute(0, 8, 3, 1, 4, 2, 5, 7, 6).reshape(blocks * 16, k)[:n]  # (c r0 g, ch t quad v r1 h)
    return Int4Weight(pack_rows(q.t()), w.scales, w.zeros, w.group_size, w.perm)


@triton.jit
def _fragments_dequant_kernel(
    qw_ptr, s_ptr, z_ptr, perm_ptr, out_ptr, N, K, stride_o,
    GROUP: tl.constexpr, ZERO_IS_OFFSET: tl.constexpr, HAS_PERM: tl.constexpr, QUADS: tl.constexpr,
    BLOCKS: tl.constexpr,
):  # fmt: skip
    """BLOCKS 16-column blocks x one chunk of the dense (K, N) weight: the words (block, quad, g, t, v), their
    nibbles regrouped in registers into (column, row) order, stored as 128-byte rows."""
    c0, ch = tl.program_id(0) * BLOCKS, tl.program_id(1)
    CHUNK: tl.constexpr = QUADS * 64
    b = tl.arange(0, BLOCKS)[:, None, None, None, None]
    quad = tl.arange(0, QUADS)[None, :, None, None, None]
    g = tl.arange(0, 8)[None, None, :, None, None]
    t = tl.arange(0, 4)[None, None, None, :, None]
    v = tl.arange(0, 4)[None, None, None, None, :]
    offs = (((c0 + b) * (K // 64) + ch * QUADS + quad) * 32 + g * 4 + t) * 4 + v
    words = tl.load(qw_ptr + offs, mask=(c0 + b) * 16 < N, other=0)
    low = tl.join(
        tl.join(int4_values(words, 0), int4_values(words, 1)),
        tl.join(int4_values(words, 2), int4_values(words, 3)),
    )
    high = tl.join(
        tl.join(int4_values(words, 4), int4_values(words, 5)),
        tl.join(int4_values(words, 6), int4_values(words, 7)),
    )
    nib = tl.join(low, high)  # (block, quad, g, t, v, r0, r1, h): nibble h * 4 + r1 * 2 + r0
    q = tl.reshape(tl.permute(nib, (0, 5, 2, 3, 1, 4, 6, 7)), (BLOCKS * 16, CHUNK))  # (b r0 g, t quad v r1 h)
    cols = c0 * 16 + tl.arange(0, BLOCKS * 16)
    rows = ch * CHUNK + tl.arange(0, CHUNK)
    mask = (cols < N)[:, None]
    s = tl.load(s_ptr + ((ch * CHUNK) // GROUP) * N + cols, mask=cols < N, other=0.0).to(tl.float32)[:, None]
    z = tl.load(z_ptr + ((ch * CHUNK) // GROUP) * N + cols, mask=cols < N, other=0).to(tl.float32)[:, None]
    if ZERO_IS_OFFSET:
        w = q * s + z
    else:
        w = q * s - z * s
    if HAS_PERM:
        rows = tl.load(perm_ptr + rows)
    tl.store(out_ptr + rows[None, :] * stride_o + cols[:, None], w.to(out_ptr.dtype.element_ty), mask=mask)


def _fragments_dequant_triton(w: Int4Weight, out: torch.Tensor) -> torch.Tensor:
    k, n = w.in_features, w.out_features
    grid = (triton.cdiv(w.qweight.shape[0], FRAGMENT_BLOCKS), k // w.chunk)
    perm = w.perm if w.perm is not None else w.qweight
    _fragments_dequant_kernel[grid](
        w.qweight, w.scales, w.zeros, perm, out, n, k, out.stride(0), GROUP=w.group_size,
        ZERO_IS_OFFSET=w.zero_is_offset, HAS_PERM=w.perm is not None, QUADS=w.chunk // 64, BLOCKS=FRAGMENT_BLOCKS,
        num_warps=4,
    )  # fmt: skip
    return out
