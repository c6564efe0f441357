"""Token embedding and LM head, split by vocabulary rows across tensor-parallel ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from engine.layers.linear import copy_checked, divide, set_weight_loader


class VocabParallelEmbedding(nn.Module):
    """Rank r holds vocabulary rows [r * V/tp, (r + 1) * V/tp); other ids embed to 0 and are all-reduced in."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.num_embeddings = num_embeddings
        self.rows_per_rank = divide(num_embeddings, tp_size, "vocab size")
        self.vocab_start = tp_rank * self.rows_per_rank
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, embedding_dim), requires_grad=False)
        set_weight_loader(self.weight, self.weight_loader)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        if loaded_weight.shape[0] != self.num_embeddings:
            raise ValueError(
                f"shape mismatch: checkpoint has {tuple(loaded_weight.shape)}, model expects "
                f"({self.num_embeddings}, {param.shape[1]})"
            )
        copy_checked(param.data, loaded_weight.narrow(0, self.vocab_start, self.rows_per_rank))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # (num_tokens,) -> (num_tokens, hidden)
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.rows_per_rank)
        out = F.embedding(local.clamp(0, self.rows_per_rank - 1), self.weight) * mine.unsqueeze(1)
        dist.all_reduce(out)
        return out


class ParallelLMHead(VocabParallelEmbedding):
    """hidden -> logits over the vocabulary; each rank computes its rows, then they are gathered."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # (n, hidden) -> (n, vocab)
        logits = F.linear(hidden, self.weight)  # (n, vocab / tp_size)
        if self.tp_size == 1:
            return logits
        parts = [torch.empty_like(logits) for _ in range(self.tp_size)]
        dist.all_gather(parts, logits)
        return torch.cat(parts, dim=-1)
