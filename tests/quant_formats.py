"""AWQ and GPTQ checkpoint tensors packed and unpacked the way the public tools do, written here from
their code and independent of engine/: AutoAWQ's WQLinear_GEMM.from_linear (order_map [0, 2, 4, 6, 1, 3,
5, 7]) and awq/utils/packing_utils.py (reverse order, (q - z) * s); AutoGPTQ's QuantLinear.pack (int32
words along input rows, zero points minus one) and its torch forward (zeros + 1, scales[g_idx]).
Everything in numpy int64, one nibble at a time, so that no packing trick is shared with the engine."""

from __future__ import annotations

import numpy as np
import torch

ORDER_MAP = [0, 2, 4, 6, 1, 3, 5, 7]


def _int32(words: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(words.astype(np.uint32).view(np.int32).copy())


def awq_pack(q: np.ndarray) -> torch.Tensor:
    """(R, N) nibbles -> (R, N / 8) int32: column col's nibble i is q[:, col * 8 + ORDER_MAP[i]]."""
    r, n = q.shape
    out = np.zeros((r, n // 8), dtype=np.uint64)
    for col in range(n // 8):
        for i in range(8):
            out[:, col] |= q[:, col * 8 + ORDER_MAP[i]].astype(np.uint64) << np.uint64(4 * i)
    return _int32(out)


def awq_unpack(packed: torch.Tensor) -> np.ndarray:  # (R, N / 8) -> (R, N)
    words = packed.numpy().view(np.uint32).astype(np.uint64)
    r, c = words.shape
    out = np.zeros((r, c * 8), dtype=np.int64)
    for col in range(c):
        for i in range(8):
            out[:, col * 8 + ORDER_MAP[i]] = (words[:, col] >> np.uint64(4 * i)) & np.uint64(15)
    return out


def awq_tensors(q: np.ndarray, zeros: np.ndarray, scales: np.ndarray) -> dict[str, torch.Tensor]:
    """q (K, N), zeros (K/G, N), scales (K/G, N) -> the checkpoint's qweight, qzeros, scales."""
    return {
        "qweight": awq_pack(q),
        "qzeros": awq_pack(zeros),
        "scales": torch.from_numpy(scales.astype(np.float16)),
    }


def awq_dense(t: dict[str, torch.Tensor], group: int) -> torch.Tensor:  # (N, K) fp32
    q, z = awq_unpack(t["qweight"]), awq_unpack(t["qzeros"])
    s = t["scales"].float().numpy()
    w = (q - np.repeat(z, group, axis=0)).astype(np.float32) * np.repeat(s, group, axis=0)
    return torch.from_numpy(w.T.copy())


def gptq_tensors(
    q: np.ndarray, zeros: np.ndarray, scales: np.ndarray, g_idx: np.ndarray
) -> dict[str, torch.Tensor]:
    """q (K, N), zeros (K/G, N) in 1..16, scales (K/G, N), g_idx (K,) -> qweight, qzeros, scales, g_idx."""
    k, n = q.shape
    qweight = np.zeros((k // 8, n), dtype=np.uint64)
    for row in range(k // 8):
        for j in range(8):
            qweight[row] |= q[row * 8 + j].astype(np.uint64) << np.uint64(4 * j)
    stored = (zeros - 1).astype(np.uint64)
    qzeros = np.zeros((zeros.shape[0], n // 8), dtype=np.uint64)
    for col in range(n // 8):
        for j in range(8):
            qzeros[:, col] |= stored[:, col * 8 + j] << np.uint64(4 * j)
    return {
        "qweight": _int32(qweight),
        "qzeros": _int32(qzeros),
        "scales": torch.from_numpy(scales.astype(np.float16)),
        "g_idx": torch.from_numpy(g_idx.astype(np.int32)),
    }


def gptq_dense(t: dict[str, torch.Tensor]) -> torch.Tensor:  # (N, K) fp32
    words = t["qweight"].numpy().view(np.uint32).astype(np.uint64)
    k8, n = words.shape
    q = np.stack([(words >> np.uint64(4 * j)) & np.uint64(15) for j in range(8)], axis=1).reshape(k8 * 8, n)
    zw = t["qzeros"].numpy().view(np.uint32).astype(np.uint64)
    z = (
        np.stack([(zw >> np.uint64(4 * j)) & np.uint64(15) for j in range(8)], axis=2).reshape(
            zw.shape[0], -1
        )
        + 1
    )
    g = t["g_idx"].numpy().astype(np.int64)
    s = t["scales"].float().numpy()
    w = (q.astype(np.int64) - z[g]).astype(np.float32) * s[g]
    return torch.from_numpy(w.T.copy())


def random_grid(k: int, n: int, group: int, rng: np.random.Generator, zero_low: int = 0):
    """Random nibbles, zero points and positive fp16 scales."""
    q = rng.integers(0, 16, (k, n))
    zeros = rng.integers(zero_low, 16, (k // group, n))
    scales = (rng.random((k // group, n)) * 0.02 + 0.001).astype(np.float16).astype(np.float32)
    return q, zeros, scales
