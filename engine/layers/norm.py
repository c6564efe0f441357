"""RMSNorm, optionally fused with the residual add that precedes it (kernels/fused_add_rmsnorm.py)."""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.linear import default_weight_loader, set_weight_loader
from kernels.fused_add_rmsnorm import fused_add_rmsnorm, rms_norm


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        set_weight_loader(self.weight, default_weight_loader)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, order: int = 0
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x), or with a residual: (norm(x + residual), x + residual), written over x and residual. order: the
        normed row in the K order the next GEMM reads x in (LinearBase.input_order; 0: column order). x may be a MoE
        layer's (num_tokens, k, hidden) weighted choices (SparseMoeBlock.forward), summed here before the add; the
        normed rows are then a new tensor."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps, order)
        return fused_add_rmsnorm(x, residual, self.weight, self.eps, order)
