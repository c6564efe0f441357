"""Token embedding and LM head, split by vocabulary rows across tensor-parallel ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from engine.layers.linear import ColumnParallelLinear, copy_checked, set_weight_loader
from engine.tp.heads import vocab_rows_per_rank
from kernels.gemv import dense_linear


class VocabParallelEmbedding(nn.Module):
    """Rank r holds vocabulary rows [r * R, (r + 1) * R), R = ceil(V / tp) (rows past V are zero padding);
    other ids embed to 0 and are all-reduced in."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.num_embeddings = num_embeddings
        self.rows_per_rank = vocab_rows_per_rank(num_embeddings, tp_size)
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
        rows = max(0, min(self.rows_per_rank, self.num_embeddings - self.vocab_start))
        copy_checked(param.data[:rows], loaded_weight.narrow(0, self.vocab_start, rows))
        param.data[rows:].zero_()  # padding rows past the vocabulary

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
        return gather_vocab(dense_linear(hidden, self.weight), self.tp_size, self.num_embeddings)


class QuantizedLMHead(ColumnParallelLinear):
    """The LM head of a checkpoint that quantizes it (GPTQ's lm_head=true): a column-parallel linear with
    the checkpoint's method, whose ranks' logits are gathered as ParallelLMHead's are. Never tied to the
    embedding, which stays dense."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp_rank: int = 0, tp_size: int = 1):
        super().__init__(embedding_dim, num_embeddings, False, tp_rank, tp_size)
        self.num_embeddings = num_embeddings

    def forward(
        self, hidden: torch.Tensor, ordered: bool = False
    ) -> torch.Tensor:  # (n, hidden) -> (n, vocab)
        return gather_vocab(self.matmul(hidden, None, ordered), self.tp_size, self.num_embeddings)


def gather_vocab(logits: torch.Tensor, tp_size: int, vocab_size: int) -> torch.Tensor:
    """Every rank's (n, rows) logits side by side, cut at the vocabulary: (n, vocab) on every rank."""
    if tp_size == 1:
        return logits
    parts = [torch.empty_like(logits) for _ in range(tp_size)]
    dist.all_gather(parts, logits)
    full = torch.cat(parts, dim=-1)  # (n, tp_size * rows)
    return full if full.shape[1] == vocab_size else full[:, :vocab_size].contiguous()
