from __future__ import annotations

import torch
from torch import nn

from kernels.silu_and_mul import silu_and_mul


class SiluAndMul(nn.Module):
    """SwiGLU: (gate | up) -> silu(gate) * up (kernels/silu_and_mul.py)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (n, 2 * d) -> (n, d)
        return silu_and_mul(x)
