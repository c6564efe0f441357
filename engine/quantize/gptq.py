"""GPTQ (Frantar et al. 2022): quantize a linear layer's weight one input column at a time, and after each
column spread its rounding error over the columns not yet quantized, weighted by the inverse Hessian of
the layer's squared output error, H = 2 X^T X / T over the calibration inputs. Lazy batch updates over
blocks of 128 columns; group parameters from the (updated) weights when a group starts; with act order
(desc_act) the columns go in order of decreasing H diagonal and g_idx records each column's group.
"""

from __future__ import annotations

import torch

from engine.quantize.grid import Grid, QuantizedWeight

BLOCK = 128
DAMP = 0.01  # of the mean H diagonal, added to it


def hessian(x: torch.Tensor) -> torch.Tensor:  # (T, K) -> (K, K)
    x = x.double()
    return (2.0 / x.shape[0]) * (x.t() @ x)


@torch.no_grad()
def gptq(w: torch.Tensor, h: torch.Tensor, grid: Grid, desc_act: bool = False) -> QuantizedWeight:
    n, k = w.shape
    g = grid.group_size
    w, h = w.double().clone(), h.double().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    perm = torch.argsort(torch.diag(h), descending=True) if desc_act else torch.arange(k, device=w.device)
    w, h = w[:, perm], h[perm][:, perm]
    h += DAMP * torch.mean(torch.diag(h)) * torch.eye(k, dtype=h.dtype, device=h.device)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    q = torch.zeros(n, k, dtype=torch.int64, device=w.device)
    scales = torch.zeros(n, k // g, device=w.device)
    zeros = torch.zeros(n, k // g, dtype=torch.int64, device=w.device)
    for start in range(0, k, BLOCK):
        end = min(start + BLOCK, k)
        block, errors = w[:, start:end].clone(), torch.zeros(n, end - start, dtype=w.dtype, device=w.device)
        hblock = hinv[start:end, start:end]
        for i in range(end - start):
            col = start + i
            if col % g == 0:  # a new group: its parameters from the columns as they are now
                upcoming = torch.cat([block[:, i:], w[:, end:]], dim=1)[:, :g]
                s, z = grid.params(upcoming.float())
                scales[:, col // g], zeros[:, col // g] = s[:, 0], z[:, 0]
            s, z = scales[:, col // g].double(), zeros[:, col // g]
            qc = torch.clamp(torch.round(block[:, i] / s) + z, 0, 15).to(torch.int64)
            q[:, col] = qc
            err = (block[:, i] - (qc - z).double() * s) / hblock[i, i]
            block[:, i:] -= err[:, None] * hblock[i, i:][None, :]
            errors[:, i] = err
        w[:, end:] -= errors @ hinv[start:end, end:]
    inverse = torch.argsort(perm)
    g_idx = (torch.arange(k, device=w.device) // g)[inverse]  # column perm[j] is in group j // g
    return QuantizedWeight(q[:, inverse], scales, zeros, g_idx)
