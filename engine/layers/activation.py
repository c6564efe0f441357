from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """SwiGLU: (gate | up) -> silu(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (n, 2 * d) -> (n, d)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
