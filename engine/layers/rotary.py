"""Rotary position embedding, neox style (rotate_half), as transformers' Llama applies it.

The module holds a cos/sin cache with one row per position (kernels/rotary_kv_write.py draws its
layout), computed once with transformers' operations (positions * inv_freq in fp32, cos/sin,
then the model dtype), so looking rows up gives the values transformers computes each step.
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


def cos_sin_cache(inv_freq: torch.Tensor, max_positions: int, dtype: torch.dtype) -> torch.Tensor:
    """(max_positions, head_dim): row p is cos(p * inv_freq) | sin(p * inv_freq), in `dtype`."""
    positions = torch.arange(max_positions, dtype=torch.int64, device=inv_freq.device)
    freqs = positions[:, None].float() * inv_freq  # (max_positions, head_dim // 2) fp32
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)


class RotaryEmbedding(nn.Module):
    def __init__(
        self, head_dim: int, base: float, max_positions: int, scaling: Llama3RopeScaling | None = None
    ) -> None:
        super().__init__()
        inv_freq = default_inv_freq(head_dim, base)
        if scaling is not None:
            inv_freq = llama3_inv_freq(inv_freq, scaling)
        # plain attributes, not buffers: model.to(bfloat16) must not round the frequencies
        self.inv_freq = inv_freq  # (head_dim // 2,) fp32
        self.max_positions = max_positions
        self._cache = cos_sin_cache(inv_freq, max_positions, torch.get_default_dtype())

    def cos_sin_cache(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The (max_positions, head_dim) cache in `dtype` on `device`; rebuilt only when either changes."""
        if self._cache.dtype != dtype or self._cache.device != device:
            self.inv_freq = self.inv_freq.to(device)
            self._cache = cos_sin_cache(self.inv_freq, self.max_positions, dtype)
        return self._cache
