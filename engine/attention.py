"""Paged attention for the model: write this step's K/V, then attend over the pages.

The kernels pick Triton on CUDA and their torch reference elsewhere; this module only routes, and says
what a CUDA graph of a decode step needs from the decode kernel (`decode_graph_plan`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.attention_metadata import AttentionMetadata
from kernels import _backend
from kernels.decode_reduce import decode_workspace_size
from kernels.kv_cache_write import kv_cache_write
from kernels.paged_decode_attention import paged_decode_attention, plan_num_splits
from kernels.paged_prefill_attention import paged_prefill_attention


@dataclass(frozen=True)
class DecodeGraphPlan:
    num_splits: int  # split-KV partitions, fixed for every replay
    workspace_numel: int  # fp32 elements of the split workspace (0 when unsplit)


def decode_graph_plan(
    num_seqs: int, max_seq_len: int, num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device
) -> DecodeGraphPlan:
    """What a captured decode batch of `num_seqs` rows passes the decode kernel on every replay: the split
    count planned for the longest context it may see (the kernel's partitions come from max_seq_len, which
    is fixed too) and the workspace those splits need. Sequences shorter than that leave the later splits
    idle; the result is the same."""
    splits = plan_num_splits(num_seqs, num_kv_heads, max_seq_len, device)
    numel = decode_workspace_size(num_seqs, num_heads, splits, head_dim, num_kv_heads) if splits > 1 else 0
    return DecodeGraphPlan(splits, numel)


def graph_capturable(device: torch.device) -> bool:
    """Whether the attention ops on `device` can be captured: the Triton kernels can, the torch
    references cannot (they read sequence lengths on the host)."""
    return device.type == "cuda" and _backend.use_triton(torch.empty(0, device=device))


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
        k: torch.Tensor | None,  # (num_tokens, num_kv_heads, head_dim); None: already in kv_cache
        v: torch.Tensor | None,  # (num_tokens, num_kv_heads, head_dim)
        kv_cache: torch.Tensor,  # (2, num_blocks, block_size, num_kv_heads, head_dim)
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # (num_tokens, num_heads * head_dim)
        if (
            k is not None and v is not None
        ):  # the model writes them fused with RoPE (kernels/rotary_kv_write.py)
            kv_cache_write(k, v, kv_cache, meta.slot_mapping)
        if meta.is_decode_only:
            out = paged_decode_attention(
                q, kv_cache, meta.seq_lens, meta.block_tables, self.scale, max_seq_len=meta.max_seq_len,
                num_splits=meta.decode_num_splits, workspace=meta.decode_workspace,
            )  # fmt: skip
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
