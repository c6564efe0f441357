"""Random paged batches for the kernel tests (CPU and GPU): a KV cache whose pages are shuffled,
so a sequence's blocks are neither contiguous nor in order, and block tables padded with 0."""

from __future__ import annotations

import torch


def make_paged_kv(
    seq_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    spare_blocks: int = 3,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return kv_cache (2, num_blocks, block_size, num_kv_heads, head_dim), block_tables
    (num_seqs, max_blocks) int32 and seq_lens (num_seqs,) int32."""
    per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(per_seq) + spare_blocks
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, device=device).to(dtype)
    perm = torch.randperm(num_blocks).tolist()
    width = max(max(per_seq, default=1), 1)
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    used = 0
    for i, n in enumerate(per_seq):
        tables[i, :n] = torch.tensor(perm[used : used + n], dtype=torch.int32)
        used += n
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    return kv_cache, tables.to(device), seq_lens_t.to(device)


def query_start_loc(query_lens: list[int], device: str | torch.device = "cpu") -> torch.Tensor:
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return torch.tensor(starts, dtype=torch.int32, device=device)
