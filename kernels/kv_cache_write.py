"""Write new K/V rows into a layer's paged KV cache through the slot mapping."""

from __future__ import annotations

import torch


def kv_cache_write_reference(
    key: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    value: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    kv_cache: torch.Tensor,  # (2, num_blocks, block_size, num_kv_heads, head_dim)
    slot_mapping: torch.Tensor,  # (num_tokens,) int64; a negative slot means "skip"
) -> None:
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    flat = kv_cache.view(2, num_blocks * block_size, *kv_cache.shape[3:])
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    flat[0].index_copy_(0, slots, key[keep].to(kv_cache.dtype))
    flat[1].index_copy_(0, slots, value[keep].to(kv_cache.dtype))


def kv_cache_write(key, value, kv_cache, slot_mapping) -> None:
    kv_cache_write_reference(key, value, kv_cache, slot_mapping)
