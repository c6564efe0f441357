"""Paged attention for the model: write this step's K/V, then attend over the pages.

The kernels pick Triton on CUDA and their torch reference elsewhere; this module only routes, and says
what a CUDA graph of a decode step needs from the decode kernel (`decode_graph_plans`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.attention_metadata import AttentionMetadata
from kernels import _backend
from kernels.decode_reduce import decode_workspace_size
from kernels.kv_cache_write import kv_cache_write
from kernels.paged_decode_attention import (
    MIN_PARTITION,
    paged_decode_attention,
    plan_num_splits,
    split_target,
)
from kernels.paged_prefill_attention import paged_prefill_attention

# contexts up to this many keys are short: the kernel's own plan never splits them
# (kernels/paged_decode_attention.py: plan_num_splits), a graph's short class may
SHORT_CONTEXT = 2 * MIN_PARTITION
# a graph's short class splits short contexts into partitions of SHORT_PARTITION keys (one 64-key tile)
# when the batch leaves the GPU idle: a program walking its pages one tile after another pays two memory
# latencies per tile (block table, then K/V), so at batch 1 the unsplit kernel takes ~9 us for 300 keys
# at Llama-3-8B heads (8 x 128) whatever the bandwidth. Splitting gains at every head width measured on
# the H200: 238 against 232 tok/s at Llama-3-8B's 8 x 128, 1,260 against 1,148 at SmolLM2's 3 x 64
SHORT_SPLIT: bool | None = None  # None: split; True / False force it (bench.latency's A-B)
SHORT_PARTITION = 64


def splits_short() -> bool:
    return SHORT_SPLIT is not False


@dataclass(frozen=True)
class DecodeGraphPlan:
    max_seq_len: int  # the longest context a batch replayed with this plan may hold
    num_splits: int  # split-KV partitions, fixed for every replay
    workspace_numel: int  # fp32 elements of the split workspace (0 when unsplit)


def decode_graph_plans(
    num_seqs: int,
    max_model_len: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    device: torch.device,
    fp8: bool = False,
) -> list[DecodeGraphPlan]:
    """What a captured decode batch of `num_seqs` rows passes the decode kernel on every replay, by the
    longest context in the batch, shortest class first. A batch big enough to fill the GPU unsplit has
    one plan, unsplit. Smaller batches have two: contexts up to SHORT_CONTEXT keys, split into as many
    SHORT_PARTITION-key partitions as fill the GPU (`splits_short`); longer ones, the split count planned for
    max_model_len (the partitions come from the plan's max_seq_len, fixed too, so shorter sequences leave
    later splits idle). Each with the workspace its splits need. fp8: an fp8 cache, whose long contexts split
    into more, smaller programs (kernels/paged_decode_attention.py: plan_num_splits)."""
    splits = plan_num_splits(num_seqs, num_kv_heads, max_model_len, device, fp8)
    if splits == 1:
        return [DecodeGraphPlan(max_model_len, 1, 0)]
    # splits > 1: max_model_len > SHORT_CONTEXT, and (sequence, kv head) programs leave the GPU idle
    target = split_target(device)  # the short class's 64-key partitions were measured with 2-warp programs
    short = max(1, min(SHORT_CONTEXT // SHORT_PARTITION, target // (num_seqs * num_kv_heads)))
    short = short if splits_short() else 1

    def numel(s: int) -> int:
        return decode_workspace_size(num_seqs, num_heads, s, head_dim) if s > 1 else 0

    return [
        DecodeGraphPlan(SHORT_CONTEXT, short, numel(short)),
        DecodeGraphPlan(max_model_len, splits, numel(splits)),
    ]


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
        # [k_scale, v_scale] of this layer's fp8 KV cache (engine/kv_scales.py sets them in place, so a
        # captured graph reads the new values); unused by other caches. A plain attribute, not a buffer:
        # model.to(bfloat16) must not round it
        self.kv_scale = torch.ones(2, dtype=torch.float32)

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
            kv_cache_write(k, v, kv_cache, meta.slot_mapping, self.kv_scale)
        if meta.is_decode_only:
            out = paged_decode_attention(
                q, kv_cache, meta.seq_lens, meta.block_tables, self.scale, max_seq_len=meta.max_seq_len,
                num_splits=meta.decode_num_splits, workspace=meta.decode_workspace, kv_scale=self.kv_scale,
            )  # fmt: skip
        else:  # the leading one-token rows by the decode kernel, the chunks after them by the prefill one
            nd = meta.num_decode_seqs
            out = paged_prefill_attention(
                q, kv_cache, *meta.chunk_layout(), self.scale, max_query_len=meta.max_query_len,
                kv_scale=self.kv_scale,
            )  # fmt: skip
            if nd:  # rows 0..nd-1 are the decode sequences' tokens, one each
                out[:nd] = paged_decode_attention(
                    q[:nd], kv_cache, meta.seq_lens[:nd], meta.block_tables[:nd], self.scale,
                    max_seq_len=meta.max_seq_len, kv_scale=self.kv_scale,
                )  # fmt: skip
        return out.reshape(out.shape[0], self.num_heads * self.head_dim)
