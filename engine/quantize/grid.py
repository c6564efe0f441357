"""Group-wise 4-bit grids: per output row and group of G input columns, a scale s (rounded to fp16, as it
is stored) and an integer zero point z, so that w ~ (q - z) * s with q in 0..15.

    asymmetric (default): the group's range [min(w, 0), max(w, 0)] in 15 steps, z = round(-min / s)
    symmetric:            s = 2 max|w| / 15, z = 8
    min_zero=1:           GPTQ's classic format stores z - 1 in 4 bits, so z = 0 is not storable: a group
                          that would take it gets s = max / 14 and z = 1 instead
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAXQ = 15


@dataclass(frozen=True)
class Grid:
    group_size: int
    sym: bool = False
    min_zero: int = 0

    def __post_init__(self) -> None:
        if self.group_size <= 0 or self.group_size % 8:
            raise ValueError(f"group size must be a positive multiple of 8, got {self.group_size}")

    def params(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(N, G * groups) -> scales (N, groups) fp32 holding fp16 values, zeros (N, groups) int64."""
        groups = w.reshape(w.shape[0], -1, self.group_size)
        top, bottom = groups.amax(-1).clamp(min=0), groups.amin(-1).clamp(max=0)
        if self.sym:
            top = torch.maximum(top, -bottom)
            scales = 2 * top / MAXQ
            zeros = torch.full_like(scales, (MAXQ + 1) // 2, dtype=torch.int64)
        else:
            scales = (top - bottom) / MAXQ
            scales = torch.where(scales > 0, scales, torch.ones_like(scales))
            zeros = torch.round(-bottom / scales).to(torch.int64)
            low = zeros < self.min_zero
            scales = torch.where(low, top / (MAXQ - self.min_zero), scales)
            zeros = torch.where(low, torch.full_like(zeros, self.min_zero), zeros)
        scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero group: q = z
        return scales.half().float(), zeros

    def quantize(self, w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
        """(N, K) -> q (N, K) int64 in 0..15, with (N, K / G) scales and zeros."""
        s = scales.repeat_interleave(self.group_size, dim=1)
        z = zeros.repeat_interleave(self.group_size, dim=1)
        return torch.clamp(torch.round(w / s) + z, 0, MAXQ).to(torch.int64)

    def dequantize(self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
        s = scales.repeat_interleave(self.group_size, dim=1)
        z = zeros.repeat_interleave(self.group_size, dim=1)
        return (q - z).float() * s  # exact in fp32

    def fake_quant(self, w: torch.Tensor) -> torch.Tensor:
        scales, zeros = self.params(w)
        return self.dequantize(self.quantize(w, scales, zeros), scales, zeros)


@dataclass
class QuantizedWeight:
    """One linear layer's result, in the dense weight's orientation: w[n, k] = (q[n, k] - z[n, g]) * s[n, g]
    with g = g_idx[k] (k // G without act order)."""

    q: torch.Tensor  # (N, K) int64, 0..15
    scales: torch.Tensor  # (N, K / G) fp32 holding fp16 values
    zeros: torch.Tensor  # (N, K / G) int64
    g_idx: torch.Tensor  # (K,) int64

    def dequantize(self) -> torch.Tensor:  # (N, K) fp32
        rows = torch.arange(self.q.shape[0], device=self.q.device)[:, None]
        s = self.scales[rows, self.g_idx[None, :]]
        z = self.zeros[rows, self.g_idx[None, :]]
        return (self.q - z).float() * s

    def rows(self, start: int, size: int) -> QuantizedWeight:
        return QuantizedWeight(
            self.q[start : start + size],
            self.scales[start : start + size],
            self.zeros[start : start + size],
            self.g_idx,
        )


def round_to_nearest(w: torch.Tensor, grid: Grid) -> QuantizedWeight:
    scales, zeros = grid.params(w)
    g_idx = torch.arange(w.shape[1], device=w.device) // grid.group_size
    return QuantizedWeight(grid.quantize(w, scales, zeros), scales, zeros, g_idx)
