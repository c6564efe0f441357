"""Paged attention for the model: write this step's K/V, then attend over the pages.

The kernels pick Triton on CUDA and their torch reference elsewhere; this module only routes.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.attention_metadata import AttentionMetadata
from kernels.kv_cache_write import kv_cache_write
from kernels.paged_decode_attention import paged_decode_attention
from kernels.paged_prefill_attention import paged_prefill_attention


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = (
            num_heads,
            num_kv_heads,
            head_dim,
            scale,
        )

    def forward(
        self,
        q: torch.Tensor,  # (num_tokens, num_heads, head_dim)
        k: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
        v: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
        kv_cache: torch.Tensor,  # (2, num_blocks, block_size, num_kv_heads, head_dim)
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # (num_tokens, num_heads * head_dim)
        kv_cache_write(k, v, kv_cache, meta.slot_mapping)
        if meta.is_decode_only:
            out = paged_decode_attention(
                q, kv_cache, meta.seq_lens, meta.block_tables, self.scale, max_seq_len=meta.max_seq_len
            )
        else:
            out = paged_prefill_attention(
                q,
                kv_cache,
                meta.query_start_loc,
                meta.seq_lens,
                meta.block_tables,
                self.scale,
                max_query_len=meta.max_query_len,
            )
        return out.reshape(out.shape[0], self.num_heads * self.head_dim)
