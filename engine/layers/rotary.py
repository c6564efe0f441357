"""Rotary position embedding, neox style (rotate_half), as transformers' Llama applies it.

cos/sin are computed from the positions each step in fp32, with the same operations as
transformers (positions * inv_freq, then cos/sin), so fp32 results match it exactly.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from engine.model_config import Llama3RopeScaling


def default_inv_freq(head_dim: int, base: float) -> torch.Tensor:  # (head_dim // 2,) fp32
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim))


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: Llama3RopeScaling) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, blend smoothly in between."""
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin  # (num_tokens, heads, head_dim)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, base: float, scaling: Llama3RopeScaling | None = None) -> None:
        super().__init__()
        inv_freq = default_inv_freq(head_dim, base)
        if scaling is not None:
            inv_freq = llama3_inv_freq(inv_freq, scaling)
        # a plain attribute, not a buffer: model.to(bfloat16) must not round the frequencies
        self.inv_freq = inv_freq  # (head_dim // 2,) fp32

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for each position, each (num_tokens, 1, head_dim): broadcast over heads."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions[:, None].float() * self.inv_freq  # (num_tokens, head_dim // 2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (num_tokens, head_dim)
        return emb.cos().to(dtype).unsqueeze(1), emb.sin().to(dtype).unsqueeze(1)
