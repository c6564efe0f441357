"""Packing int4 values into int32 the way each format does.

    rows (GPTQ qweight, the kernels' layout):  packed[r, n]  bits 4j..4j+3 = q[8r + j, n]
    cols (AWQ qweight/qzeros, GPTQ qzeros):    packed[r, c]  bits 4i..4i+3 = q[r, 8c + order[i]]

GPTQ packs its zero points in natural order; AWQ packs weights and zero points in AWQ_ORDER (AutoAWQ's
`order_map` for its GEMM kernel), which AWQ_REVERSE_ORDER undoes.
"""

from __future__ import annotations

import torch

from kernels.int4_dequant import pack_rows as kernel_pack_rows
from kernels.int4_dequant import unpack_rows

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
NATURAL_ORDER = tuple(range(8))
__all__ = [
    "AWQ_ORDER",
    "AWQ_REVERSE_ORDER",
    "NATURAL_ORDER",
    "pack_cols",
    "pack_rows",
    "unpack_cols",
    "unpack_rows",
]


def _check_nibbles(q: torch.Tensor) -> None:
    if q.numel() and (int(q.min()) < 0 or int(q.max()) > 15):
        raise ValueError(f"int4 values must lie in 0..15, got {int(q.min())}..{int(q.max())}")


def _words(slots: torch.Tensor) -> torch.Tensor:
    """(..., 8) values 0..15 -> (...) int32 with slot i in bits 4i..4i+3 (bytes in memory order: the
    little-endian hosts torch runs on)."""
    slots = slots.to(torch.uint8)
    pairs = slots[..., 0::2] | (slots[..., 1::2] << 4)  # (..., 4): byte b holds slots 2b, 2b + 1
    return pairs.contiguous().view(torch.int32).squeeze(-1)


def _slots(words: torch.Tensor) -> torch.Tensor:  # (...) int32 -> (..., 8) uint8
    data = words.contiguous().view(torch.uint8).view(*words.shape, 4)
    return torch.stack([data & 0xF, data >> 4], dim=-1).flatten(-2)


def pack_rows(q: torch.Tensor, check: bool = True) -> torch.Tensor:  # (K, N) -> (K/8, N) int32
    if check:
        _check_nibbles(q)
    if q.shape[0] % 8:
        raise ValueError(f"{q.shape[0]} rows do not pack into int32 words of 8")
    return kernel_pack_rows(q)


def pack_cols(q: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:  # (R, N) -> (R, N/8) int32
    _check_nibbles(q)
    r, n = q.shape
    if n % 8:
        raise ValueError(f"{n} columns do not pack into int32 words of 8")
    return _words(q.reshape(r, n // 8, 8)[:, :, list(order)])  # slot i holds column 8c + order[i]


def unpack_cols(packed: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:  # (R, N/8) -> (R, N) uint8
    inverse = [order.index(j) for j in range(8)]  # column 8c + j sits in slot order.index(j)
    return _slots(packed)[:, :, inverse].reshape(packed.shape[0], -1)
