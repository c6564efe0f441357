"""Write new K/V rows into a layer's paged KV cache through the slot mapping (quantized for an fp8 cache,
kernels/kv_quant.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import _backend
from kernels.kv_quant import as_stored, load_scales, scale_args, store_quantized


@triton.jit
def _kv_cache_write_kernel(
    # pointers
    key_ptr,
    value_ptr,
    kv_cache_ptr,
    slot_mapping_ptr,
    kv_scale_ptr,  # FP8: [k_scale, v_scale]
    # sizes
    num_kv_heads,
    head_dim,
    # strides
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_c_kv,
    stride_c_block,
    stride_c_off,
    stride_c_head,
    # meta
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < head_dim)
    # (BLOCK_H, BLOCK_D) tiles of one token's rows; head_dim is contiguous (checked by the launcher)
    k = tl.load(key_ptr + token * stride_k_tok + heads[:, None] * stride_k_head + dims[None, :], mask=mask)
    v = tl.load(value_ptr + token * stride_v_tok + heads[:, None] * stride_v_head + dims[None, :], mask=mask)
    dst = (slot // BLOCK_SIZE) * stride_c_block + (slot % BLOCK_SIZE) * stride_c_off
    dst += heads[:, None] * stride_c_head + dims[None, :]
    k_scale, v_scale = load_scales(kv_scale_ptr, FP8)
    store_quantized(kv_cache_ptr + dst, k.to(tl.float32), mask, k_scale, FP8)
    store_quantized(kv_cache_ptr + stride_c_kv + dst, v.to(tl.float32), mask, v_scale, FP8)


def kv_cache_write_triton(
    key: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    value: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    kv_cache: torch.Tensor,  # (2, num_blocks, block_size, num_kv_heads, head_dim)
    slot_mapping: torch.Tensor,  # (num_tokens,) int32/int64; a negative slot means "skip"
    kv_scale: torch.Tensor | None = None,  # (2,) fp32 [k_scale, v_scale]: an fp8 cache's, else unused
) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape, f"key {tuple(key.shape)} vs value {tuple(value.shape)}"
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, f"kv_cache shape {tuple(kv_cache.shape)}"
    assert kv_cache.shape[3:] == (num_kv_heads, head_dim), "kv_cache heads/head_dim differ from key"
    assert slot_mapping.shape == (num_tokens,), f"slot_mapping {tuple(slot_mapping.shape)}"
    assert key.stride(2) == 1 and value.stride(2) == 1 and kv_cache.stride(4) == 1, "head_dim not contiguous"
    scale_ptr, fp8 = scale_args(kv_cache, kv_scale)
    if num_tokens == 0:
        return
    block_size = kv_cache.shape[2]
    _kv_cache_write_kernel[(num_tokens,)](
        key, value, kv_cache, slot_mapping, scale_ptr,
        num_kv_heads, head_dim,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        BLOCK_SIZE=block_size,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        FP8=fp8,
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )  # fmt: skip


def kv_cache_write_reference(
    key: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    value: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    kv_cache: torch.Tensor,  # (2, num_blocks, block_size, num_kv_heads, head_dim)
    slot_mapping: torch.Tensor,  # (num_tokens,) int64; a negative slot means "skip"
    kv_scale: torch.Tensor | None = None,  # (2,) fp32 [k_scale, v_scale]: an fp8 cache's, else unused
) -> None:
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    flat = kv_cache.view(2, num_blocks * block_size, *kv_cache.shape[3:])
    if flat.dtype.itemsize == 1:  # index_copy_ has no fp8 kernel on the CPU: copy the bytes
        flat = flat.view(torch.uint8)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    for i, x in enumerate((key, value)):
        scale = kv_scale[i] if kv_scale is not None else None
        flat[i].index_copy_(0, slots, as_stored(x[keep], kv_cache, scale).view(flat.dtype))


def kv_cache_write(key, value, kv_cache, slot_mapping, kv_scale=None) -> None:
    if _backend.use_triton(key):
        kv_cache_write_triton(key, value, kv_cache, slot_mapping, kv_scale)
    else:
        kv_cache_write_reference(key, value, kv_cache, slot_mapping, kv_scale)
