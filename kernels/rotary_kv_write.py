"""Rotary embedding of q and k fused with the paged KV-cache write, one launch per layer.

Neox-style RoPE (rotate_half, as transformers' Llama applies it) from a cos/sin cache with one
row per position; every RoPE variant (default, llama3 scaling) differs only in that cache:

    cos_sin_cache (max_positions, head_dim), row p:
    +--------------------------------+--------------------------------+
    | cos(p f_0) .. cos(p f_{d/2-1}) | sin(p f_0) .. sin(p f_{d/2-1}) |
    +--------------------------------+--------------------------------+

    x = [x1 | x2] (halves of head_dim) -> [x1 cos - x2 sin | x2 cos + x1 sin]

q is rotated in place (or into q_out); k is rotated and written with v into the cache at
slot_mapping (a negative slot writes nothing), so the rotated k never goes back to memory. An fp8 cache
stores both quantized with the layer's scales (kernels/kv_quant.py). With `HeadNorms` (Qwen3's q_norm and k_norm)
each q and k head is RMS-normed first, rounded where the RMSNorm kernel rounds (x * rstd, then times the weight),
so a layer takes one launch where it took three.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import _backend
from kernels.fused_add_rmsnorm import rms_norm_reference
from kernels.kv_cache_write import kv_cache_write_reference
from kernels.kv_quant import load_scales, scale_args, store_quantized
from kernels.pdl import pdl, pdl_entry, pdl_launch


def all_kv_heads_from(device: torch.device) -> int:
    """The token count from which a program writes all of a token's kv heads (fewer tokens: one head a program,
    so that the grid still fills the SMs)."""
    return _backend.num_sms(device)


@dataclass(frozen=True)
class HeadNorms:
    """RMSNorm weights applied to each q head and each k head alone before RoPE (Qwen3's q_norm, k_norm)."""

    q_weight: torch.Tensor  # (head_dim,)
    k_weight: torch.Tensor  # (head_dim,)
    eps: float


@triton.jit
def _rotate_store(
    src, dst, mask, cos, sin, HALF: tl.constexpr, scale, FP8: tl.constexpr, w1, w2, eps, NORM: tl.constexpr
):  # fmt: skip
    """Rows of neox halves at src (pointers to the first half) -> rotated rows at dst (FP8: quantized). NORM: each
    row RMS-normed first, with weight halves w1, w2 (1, BLOCK_HALF) fp32."""
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + HALF, mask=mask, other=0.0)
    if NORM:  # rounded as the RMSNorm kernel rounds: x * rstd, then times the weight
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        rstd = tl.rsqrt((tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)) / (2 * HALF) + eps)[:, None]
        x1 = ((a * rstd).to(x1.dtype).to(tl.float32) * w1).to(x1.dtype)
        x2 = ((b * rstd).to(x2.dtype).to(tl.float32) * w2).to(x2.dtype)
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    store_quantized(dst, x1 * cos - x2 * sin, mask, scale, FP8)
    store_quantized(dst + HALF, x2 * cos + x1 * sin, mask, scale, FP8)


@triton.jit
def _rotary_kv_write_kernel(
    # pointers
    q_ptr,
    k_ptr,
    v_ptr,
    q_out_ptr,
    positions_ptr,
    cos_sin_ptr,
    kv_cache_ptr,
    slot_mapping_ptr,
    kv_scale_ptr,  # FP8: [k_scale, v_scale]
    qn_ptr,  # NORM: q heads' RMSNorm weight (head_dim,)
    kn_ptr,  # NORM: k heads'
    # sizes
    num_heads,
    num_kv_heads,
    query_group,
    max_position,
    eps,
    # strides
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_qo_tok,
    stride_qo_head,
    stride_cs_pos,
    stride_c_kv,
    stride_c_block,
    stride_c_off,
    stride_c_head,
    # meta
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_HEADS: tl.constexpr,
    BLOCK_KV: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    FP8: tl.constexpr,
    NORM: tl.constexpr,  # q and k heads RMS-normed before RoPE
    PDL: tl.constexpr,  # launched as a programmatic dependent (kernels/pdl.py)
):
    """Program (token, j): kv heads j * KV_HEADS .. + KV_HEADS of one token and their query heads."""
    pdl_entry(PDL)
    token = tl.program_id(0).to(tl.int64)
    kv0 = tl.program_id(1) * KV_HEADS
    pos = tl.load(positions_ptr + token).to(tl.int64)
    pos = tl.minimum(tl.maximum(pos, 0), max_position - 1)  # in bounds whatever the caller passes
    dims = tl.arange(0, BLOCK_HALF)
    dmask = dims < HALF
    cs = cos_sin_ptr + pos * stride_cs_pos + dims
    cos = tl.load(cs, mask=dmask, other=0.0).to(tl.float32)[None, :]  # (1, BLOCK_HALF)
    sin = tl.load(cs + HALF, mask=dmask, other=0.0).to(tl.float32)[None, :]
    qw1, qw2, kw1, kw2 = cos, cos, cos, cos  # unread without NORM
    if NORM:
        qw1 = tl.load(qn_ptr + dims, mask=dmask, other=0.0).to(tl.float32)[None, :]
        qw2 = tl.load(qn_ptr + HALF + dims, mask=dmask, other=0.0).to(tl.float32)[None, :]
        kw1 = tl.load(kn_ptr + dims, mask=dmask, other=0.0).to(tl.float32)[None, :]
        kw2 = tl.load(kn_ptr + HALF + dims, mask=dmask, other=0.0).to(tl.float32)[None, :]

    q_heads = kv0 * query_group + tl.arange(0, BLOCK_Q)
    q_end = tl.minimum((kv0 + KV_HEADS) * query_group, num_heads)
    q_mask = (q_heads < q_end)[:, None] & dmask[None, :]  # (BLOCK_Q, BLOCK_HALF)
    q_src = q_ptr + token * stride_q_tok + q_heads[:, None] * stride_q_head + dims[None, :]
    q_dst = q_out_ptr + token * stride_qo_tok + q_heads[:, None] * stride_qo_head + dims[None, :]
    _rotate_store(q_src, q_dst, q_mask, cos, sin, HALF, 1.0, False, qw1, qw2, eps, NORM)

    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    kv_heads = kv0 + tl.arange(0, BLOCK_KV)
    # slot >= 0 as a block: the interpreter cannot mask with a block & scalar mix
    kv_rows = (kv_heads < num_kv_heads) & (kv_heads < kv0 + KV_HEADS) & (slot + tl.zeros_like(kv_heads) >= 0)
    kv_mask = kv_rows[:, None] & dmask[None, :]  # (BLOCK_KV, BLOCK_HALF)
    dst = kv_cache_ptr + (slot // BLOCK_SIZE) * stride_c_block + (slot % BLOCK_SIZE) * stride_c_off
    dst += kv_heads[:, None] * stride_c_head + dims[None, :]
    k_scale, v_scale = load_scales(kv_scale_ptr, FP8)
    k_src = k_ptr + token * stride_k_tok + kv_heads[:, None] * stride_k_head + dims[None, :]
    _rotate_store(k_src, dst, kv_mask, cos, sin, HALF, k_scale, FP8, kw1, kw2, eps, NORM)
    v_src = v_ptr + token * stride_v_tok + kv_heads[:, None] * stride_v_head + dims[None, :]
    v1 = tl.load(v_src, mask=kv_mask).to(tl.float32)
    store_quantized(dst + stride_c_kv, v1, kv_mask, v_scale, FP8)
    store_quantized(
        dst + stride_c_kv + HALF, tl.load(v_src + HALF, mask=kv_mask).to(tl.float32), kv_mask, v_scale, FP8
    )


def _check(q, k, v, positions, cos_sin_cache, kv_cache, slot_mapping, q_out, norms: HeadNorms | None) -> None:
    num_tokens, num_heads, head_dim = q.shape
    if norms is not None:
        for name, w in (("q", norms.q_weight), ("k", norms.k_weight)):
            assert w.shape == (head_dim,) and w.stride(0) == 1, f"{name} heads' norm weight {tuple(w.shape)}"
    num_kv_heads = k.shape[1]
    assert k.shape == v.shape == (num_tokens, num_kv_heads, head_dim), (
        f"k {k.shape}, v {v.shape}, q {q.shape}"
    )
    assert head_dim % 2 == 0 and num_heads % num_kv_heads == 0, (
        f"heads {num_heads}/{num_kv_heads}, {head_dim}"
    )
    assert cos_sin_cache.dim() == 2 and cos_sin_cache.shape[1] == head_dim, f"cache {cos_sin_cache.shape}"
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, f"kv_cache shape {tuple(kv_cache.shape)}"
    assert kv_cache.shape[3:] == (num_kv_heads, head_dim), "kv_cache heads/head_dim differ from k"
    assert positions.shape == slot_mapping.shape == (num_tokens,), "positions/slot_mapping per token"
    assert q_out.shape == q.shape, f"q_out {tuple(q_out.shape)} vs q {tuple(q.shape)}"
    for name, t in (("q", q), ("k", k), ("v", v), ("q_out", q_out), ("kv_cache", kv_cache)):
        assert t.stride(-1) == 1, f"{name}: head_dim not contiguous"
    assert cos_sin_cache.stride(1) == 1, "cos_sin_cache rows not contiguous"


def _num_warps(elems: int) -> int:
    return 1 if elems <= 1024 else 2 if elems <= 2048 else 4 if elems <= 8192 else 8


def rotary_kv_write_triton(
    q: torch.Tensor,  # (num_tokens, num_heads, head_dim), strided views of the qkv projection allowed
    k: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    v: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    positions: torch.Tensor,  # (num_tokens,) int32/int64, each < cos_sin_cache.shape[0]
    cos_sin_cache: torch.Tensor,  # (max_positions, head_dim): cos | sin
    kv_cache: torch.Tensor,  # (2, num_blocks, block_size, num_kv_heads, head_dim)
    slot_mapping: torch.Tensor,  # (num_tokens,) int32/int64; a negative slot means "skip"
    q_out: torch.Tensor | None = None,  # (num_tokens, num_heads, head_dim); None: rotate q in place
    kv_heads_per_program: int | None = None,  # None: 1 for small batches (more programs), else all
    kv_scale: torch.Tensor | None = None,  # (2,) fp32 [k_scale, v_scale]: an fp8 cache's, else unused
    head_norms: HeadNorms | None = None,  # q and k heads RMS-normed before RoPE
) -> torch.Tensor:  # q_out (q itself when in place)
    q_out = q if q_out is None else q_out
    _check(q, k, v, positions, cos_sin_cache, kv_cache, slot_mapping, q_out, head_norms)
    scale_ptr, fp8 = scale_args(kv_cache, kv_scale)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if num_tokens == 0:
        return q_out
    if kv_heads_per_program is None:
        kv_heads_per_program = 1 if num_tokens < all_kv_heads_from(q.device) else num_kv_heads
    per_prog = min(kv_heads_per_program, num_kv_heads)
    group = num_heads // num_kv_heads
    block_q, block_kv = triton.next_power_of_2(per_prog * group), triton.next_power_of_2(per_prog)
    block_half = triton.next_power_of_2(head_dim // 2)
    grid = (num_tokens, triton.cdiv(num_kv_heads, per_prog))
    on = pdl(q)
    qn, kn, eps = (head_norms.q_weight, head_norms.k_weight, head_norms.eps) if head_norms else (q, q, 0.0)
    _rotary_kv_write_kernel[grid](
        q, k, v, q_out, positions, cos_sin_cache, kv_cache, slot_mapping, scale_ptr, qn, kn,
        num_heads, num_kv_heads, group, cos_sin_cache.shape[0], eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        q_out.stride(0), q_out.stride(1), cos_sin_cache.stride(0),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        HALF=head_dim // 2, BLOCK_HALF=block_half, BLOCK_SIZE=kv_cache.shape[2],
        KV_HEADS=per_prog, BLOCK_KV=block_kv, BLOCK_Q=block_q, FP8=fp8, NORM=head_norms is not None, PDL=on,
        num_warps=_num_warps((block_q + 2 * block_kv) * 2 * block_half), **pdl_launch(on),
    )  # fmt: skip
    return q_out


def _rotate_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x in place, rounding as transformers' x * cos + rotate_half(x) * sin does."""
    x1, x2 = x.chunk(2, dim=-1)
    x2_sin, x1_sin = x2 * sin, x1 * sin
    x1.mul_(cos).sub_(x2_sin)
    x2.mul_(cos).add_(x1_sin)
    return x


def rotary_kv_write_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,  # (num_tokens,) int64
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # (num_tokens,) int64
    q_out: torch.Tensor | None = None,
    kv_scale: torch.Tensor | None = None,
    head_norms: HeadNorms | None = None,
) -> torch.Tensor:
    cos, sin = cos_sin_cache.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)  # (n, 1, d / 2)
    if q_out is None:
        q_out = q
    k = k.clone()
    if head_norms is not None:  # each head alone, as RMSNorm over (tokens * heads, head_dim) rows
        q = rms_norm_reference(q.reshape(-1, q.shape[2]), head_norms.q_weight, head_norms.eps).view(q.shape)
        k = rms_norm_reference(k.reshape(-1, k.shape[2]), head_norms.k_weight, head_norms.eps).view(k.shape)
    if q_out is not q:
        q_out.copy_(q)
    _rotate_(q_out, cos, sin)
    kv_cache_write_reference(_rotate_(k, cos, sin), v, kv_cache, slot_mapping, kv_scale)
    return q_out


def rotary_kv_write(
    q, k, v, positions, cos_sin_cache, kv_cache, slot_mapping, kv_scale=None, head_norms: HeadNorms | None = None
) -> torch.Tensor:  # fmt: skip
    """Rotate q in place and write rotated k and v into kv_cache (quantized with kv_scale when fp8); returns q. With
    head_norms each q and k head is RMS-normed first."""
    if _backend.use_triton(q):
        return rotary_kv_write_triton(
            q,
            k,
            v,
            positions,
            cos_sin_cache,
            kv_cache,
            slot_mapping,
            kv_scale=kv_scale,
            head_norms=head_norms,
        )
    return rotary_kv_write_reference(
        q, k, v, positions, cos_sin_cache, kv_cache, slot_mapping, kv_scale=kv_scale, head_norms=head_norms
    )
