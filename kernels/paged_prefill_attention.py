"""Paged "extend" attention: a chunk of new query tokens per sequence attends causally to the
sequence's cached prefix pages plus itself. Serves prefill, chunked prefill, prefix-cache hits
and speculative verification (see engine/attention_metadata.py for the layout)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gather_kv(
    kv_cache: torch.Tensor,  # (2, num_blocks, block_size, num_kv_heads, head_dim)
    block_table: torch.Tensor,  # (max_blocks,) int32
    seq_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return one sequence's contiguous K and V, each (seq_len, num_kv_heads, head_dim)."""
    block_size = kv_cache.shape[2]
    num_blocks = (seq_len + block_size - 1) // block_size
    ids = block_table[:num_blocks].long()
    k = kv_cache[0, ids].flatten(0, 1)[:seq_len]
    v = kv_cache[1, ids].flatten(0, 1)[:seq_len]
    return k, v


def paged_prefill_attention_reference(
    query: torch.Tensor,  # (num_tokens, num_heads, head_dim)
    kv_cache: torch.Tensor,  # (2, num_blocks, block_size, num_kv_heads, head_dim)
    query_start_loc: torch.Tensor,  # (num_seqs + 1,) int32
    seq_lens: torch.Tensor,  # (num_seqs,) int32
    block_tables: torch.Tensor,  # (num_seqs, max_blocks) int32
    scale: float,
) -> torch.Tensor:  # (num_tokens, num_heads, head_dim)
    num_heads = query.shape[1]
    num_kv_heads = kv_cache.shape[3]
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        q = query[starts[i] : starts[i + 1]]  # (q_len, num_heads, head_dim)
        q_len = q.shape[0]
        if q_len == 0:
            continue
        k, v = gather_kv(kv_cache, block_tables[i], seq_len)
        k = k.to(q.dtype).repeat_interleave(num_heads // num_kv_heads, dim=1)
        v = v.to(q.dtype).repeat_interleave(num_heads // num_kv_heads, dim=1)
        # query row r sits at position seq_len - q_len + r and sees keys 0..that position
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]  # (q_len, seq_len)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale
        )
        out[starts[i] : starts[i + 1]] = o.transpose(0, 1)
    return out


def paged_prefill_attention(query, kv_cache, query_start_loc, seq_lens, block_tables, scale, max_query_len=None):
    return paged_prefill_attention_reference(query, kv_cache, query_start_loc, seq_lens, block_tables, scale)
