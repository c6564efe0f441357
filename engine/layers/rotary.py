"""Rotary position embedding, neox style (rotate_half), as transformers' Llama applies it.

The module holds a cos/sin cache with one row per position (kernels/rotary_kv_write.py draws its
layout), computed once with transformers' operations (positions * inv_freq in fp32, cos/sin, times
YaRN's attention factor, then the model dtype), so looking rows up gives the values transformers
computes each step. Scalings: llama3, linear and yarn, with transformers' frequencies.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from engine.model_config import LinearRopeScaling, Llama3RopeScaling, RopeScaling, YarnRopeScaling


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


def yarn_inv_freq(head_dim: int, base: float, scaling: YarnRopeScaling) -> tuple[torch.Tensor, float]:
    """YaRN's frequencies and attention factor, as transformers computes them."""
    dim = head_dim

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor = scaling.factor
    attention = scaling.attention_factor
    if attention is None:
        if scaling.mscale and scaling.mscale_all_dim:
            attention = float(mscale(factor, scaling.mscale) / mscale(factor, scaling.mscale_all_dim))
        else:
            attention = mscale(factor)

    def correction_dim(rotations: float) -> float:
        original = scaling.original_max_position_embeddings
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1 - ramp  # the share of each frequency kept as it was trained
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, attention


def scaled_inv_freq(head_dim: int, base: float, scaling: RopeScaling | None) -> tuple[torch.Tensor, float]:
    """The frequencies (head_dim // 2,) fp32 and the factor cos and sin are scaled by, for any scaling."""
    if isinstance(scaling, YarnRopeScaling):
        return yarn_inv_freq(head_dim, base, scaling)
    inv_freq = default_inv_freq(head_dim, base)
    if isinstance(scaling, Llama3RopeScaling):
        inv_freq = llama3_inv_freq(inv_freq, scaling)
    elif isinstance(scaling, LinearRopeScaling):
        inv_freq = inv_freq / scaling.factor
    return inv_freq, 1.0


def cos_sin_cache(
    inv_freq: torch.Tensor, max_positions: int, dtype: torch.dtype, attention_factor: float = 1.0
) -> torch.Tensor:
    """(max_positions, head_dim): row p is cos(p * inv_freq) | sin(p * inv_freq), times attention_factor (YaRN's;
    1 otherwise) in fp32, in `dtype`."""
    positions = torch.arange(max_positions, dtype=torch.int64, device=inv_freq.device)
    freqs = positions[:, None].float() * inv_freq  # (max_positions, head_dim // 2) fp32
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    if attention_factor != 1.0:
        cache = cache * attention_factor
    return cache.to(dtype)


class RotaryEmbedding(nn.Module):
    def __init__(
        self, head_dim: int, base: float, max_positions: int, scaling: RopeScaling | None = None
    ) -> None:
        super().__init__()
        inv_freq, self.attention_factor = scaled_inv_freq(head_dim, base, scaling)
        # plain attributes, not buffers: model.to(bfloat16) must not round the frequencies
        self.inv_freq = inv_freq  # (head_dim // 2,) fp32
        self.max_positions = max_positions
        self._cache = cos_sin_cache(inv_freq, max_positions, torch.get_default_dtype(), self.attention_factor)

    def cos_sin_cache(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The (max_positions, head_dim) cache in `dtype` on `device`; rebuilt only when either changes."""
        if self._cache.dtype != dtype or self._cache.device != device:
            self.inv_freq = self.inv_freq.to(device)
            self._cache = cos_sin_cache(self.inv_freq, self.max_positions, dtype, self.attention_factor)
        return self._cache
