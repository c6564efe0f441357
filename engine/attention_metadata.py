"""The one object that carries a forward pass's paged-attention layout.

The batch is flattened: the new tokens of every scheduled sequence sit back to back
(`num_tokens` rows), sequence i owning rows query_start_loc[i]:query_start_loc[i+1].
Those rows are the *last* q_len_i positions of a context of seq_lens[i] tokens, so a
decode step is q_len 1, a prefill chunk is q_len n over a cached prefix, and a
speculative verification is q_len k+1: one layout serves them all.

KV cache of one layer: (2, num_blocks, block_size, num_kv_heads, head_dim),
[0] holding K and [1] holding V. Token t of a sequence lives in block
block_tables[i, t // block_size] at offset t % block_size; its flat slot is
block_id * block_size + offset, the value slot_mapping carries for each new token; a negative
slot writes nothing (the padded rows of a CUDA graph's batch, which also have seq_len 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.uploads import upload


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (num_tokens,) int64: where each new token's K/V is written
    query_start_loc: torch.Tensor  # (num_seqs + 1,) int32: cumulative new-token counts
    seq_lens: torch.Tensor  # (num_seqs,) int32: context length after this step (cached + new)
    block_tables: torch.Tensor  # (num_seqs, max_blocks_per_seq) int32, padded with 0
    max_query_len: int
    max_seq_len: int  # bounds every seq_lens entry; a CUDA graph's is max_model_len
    # decode under a CUDA graph (engine/cuda_graph.py): a fixed split-KV count and its preallocated
    # workspace (engine/attention.py: decode_graph_plans); None: the kernel plans per call
    decode_num_splits: int | None = None
    decode_workspace: torch.Tensor | None = None
    # the leading sequences that run one new token each (the scheduler puts decode rows first): in a step
    # that also runs longer chunks, attention reads these with the decode kernel, which shares each kv
    # head's pages across its query heads, instead of a prefill tile that would use one of its rows
    num_decode_seqs: int = 0
    # query_start_loc, seq_lens and block_tables of the sequences after the decode rows, uploaded on their
    # own when a step has both kinds: a slice [num_decode_seqs:] of the tensors above starts 4 bytes a row
    # in, and Triton compiles a kernel again for each pointer that is not 16-byte aligned, which stalls the
    # first step to meet each such layout for seconds
    chunks: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def chunk_layout(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(query_start_loc, seq_lens, block_tables) of the sequences after the decode rows."""
        if self.chunks is not None:
            return self.chunks
        nd = self.num_decode_seqs
        return self.query_start_loc[nd:], self.seq_lens[nd:], self.block_tables[nd:]

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Build the metadata from plain lists (the scheduler's view of the batch)."""
        slots: list[int] = []
        for q_len, s_len, table in zip(query_lens, seq_lens, block_tables):
            for pos in range(s_len - q_len, s_len):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        starts = [0]
        for q_len in query_lens:
            starts.append(starts[-1] + q_len)
        width = max((len(t) for t in block_tables), default=1) or 1
        padded = [t + [0] * (width - len(t)) for t in block_tables]
        nd = next((i for i, q in enumerate(query_lens) if q != 1), len(query_lens))
        chunks = None
        if 0 < nd < len(query_lens):
            chunks = (
                upload(torch.tensor(starts[nd:], dtype=torch.int32), device),
                upload(torch.tensor(seq_lens[nd:], dtype=torch.int32), device),
                upload(torch.tensor(padded[nd:], dtype=torch.int32), device),
            )
        return cls(
            slot_mapping=upload(torch.tensor(slots, dtype=torch.int64), device),
            query_start_loc=upload(torch.tensor(starts, dtype=torch.int32), device),
            seq_lens=upload(torch.tensor(seq_lens, dtype=torch.int32), device),
            block_tables=upload(torch.tensor(padded, dtype=torch.int32), device),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            num_decode_seqs=nd,
            chunks=chunks,
        )
