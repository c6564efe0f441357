"""Paged decode attention: one query token per sequence over its paged K/V."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.paged_prefill_attention import gather_kv


def paged_decode_attention_reference(
    query: torch.Tensor,  # (num_seqs, num_heads, head_dim)
    kv_cache: torch.Tensor,  # (2, num_blocks, block_size, num_kv_heads, head_dim)
    seq_lens: torch.Tensor,  # (num_seqs,) int32
    block_tables: torch.Tensor,  # (num_seqs, max_blocks) int32
    scale: float,
) -> torch.Tensor:  # (num_seqs, num_heads, head_dim)
    num_heads = query.shape[1]
    num_kv_heads = kv_cache.shape[3]
    out = torch.empty_like(query)
    for i, seq_len in enumerate(seq_lens.tolist()):
        k, v = gather_kv(kv_cache, block_tables[i], seq_len)
        k = k.to(query.dtype).repeat_interleave(num_heads // num_kv_heads, dim=1)
        v = v.to(query.dtype).repeat_interleave(num_heads // num_kv_heads, dim=1)
        o = F.scaled_dot_product_attention(
            query[i].unsqueeze(1), k.transpose(0, 1), v.transpose(0, 1), scale=scale
        )  # (num_heads, 1, head_dim)
        out[i] = o.squeeze(1)
    return out


def paged_decode_attention(query, kv_cache, seq_lens, block_tables, scale, max_seq_len=None):
    return paged_decode_attention_reference(query, kv_cache, seq_lens, block_tables, scale)
