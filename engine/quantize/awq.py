"""AWQ (activation-aware weight quantization, Lin et al. 2023): scale each input channel of a linear
layer by s before quantizing, s = mean|x|^a / mean|w|^(1 - a) with the exponent a searched on calibration
inputs, and fold 1 / s into the operation before it (an RMSNorm's weight, or the rows of the linear that
feeds it), so the float model computes the same thing and the channels that see large activations keep
more precision. Then a clipping search: per output row and group, the largest |w| kept, shrunk by up to
half where that lowers the output error. Both minimise the linear's output error on the inputs given.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.quantize.grid import Grid

N_GRID = 20  # exponents tried: 0, 1/20, ..., 19/20
MAX_SHRINK = 0.5  # clipping keeps at least half of each group's largest |w|


def _sample(x: torch.Tensor, max_tokens: int) -> torch.Tensor:
    if x.shape[0] <= max_tokens:
        return x
    return x[torch.linspace(0, x.shape[0] - 1, max_tokens, device=x.device).long()]


def _weight_mean(w: torch.Tensor, grid: Grid) -> torch.Tensor:  # (N, K) -> (K,)
    groups = w.abs().reshape(-1, grid.group_size)
    return (groups / (groups.amax(1, keepdim=True) + 1e-6)).reshape(w.shape).mean(0)


def _best_scales(
    x_mean: torch.Tensor, w_mean: torch.Tensor, error: Callable[[torch.Tensor], float]
) -> torch.Tensor:
    """The candidate s = x_mean^a / w_mean^(1 - a) (normalised) with the least error."""
    best, best_err = torch.ones_like(x_mean), float("inf")
    for i in range(N_GRID):
        a = i / N_GRID
        s = (x_mean.pow(a) / (w_mean.pow(1 - a) + 1e-4)).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        err = error(s)
        if err < best_err:
            best, best_err = s, err
    return best


@torch.no_grad()
def search_scales(x: torch.Tensor, w: torch.Tensor, grid: Grid, max_tokens: int = 1024) -> torch.Tensor:
    """x (T, K) inputs, w (N, K): the per-input-channel scales (K,) minimising ||x w^T - (x / s) Q(w s)^T||."""
    x = _sample(x, max_tokens)
    reference = x @ w.t()

    def error(s: torch.Tensor) -> float:
        return (reference - x @ (grid.fake_quant(w * s) / s).t()).pow(2).mean().item()

    return _best_scales(x.abs().mean(0), _weight_mean(w, grid), error)


@torch.no_grad()
def search_shared_scales(
    x: torch.Tensor, linears: list[tuple[torch.Tensor, torch.Tensor]], grid: Grid, max_tokens: int = 1024
) -> torch.Tensor:
    """One scale (K,) for several linears that read x (T, K), each on some of its rows (a MoE layer's experts on
    the tokens routed to them): linears [(x_i (T_i, K), w_i (N_i, K))], minimising the summed squared error of
    their outputs. mean|x| is x's, mean|w| over every w_i's rows."""
    pairs = [(_sample(xi, max_tokens), wi) for xi, wi in linears if xi.shape[0]]
    references = [xi @ wi.t() for xi, wi in pairs]
    count = sum(ref.numel() for ref in references)
    rows = sum(w.shape[0] for _, w in linears)
    w_mean = torch.stack([_weight_mean(w, grid) * w.shape[0] for _, w in linears]).sum(0) / rows

    def error(s: torch.Tensor) -> float:
        total = sum(
            (ref - xi @ (grid.fake_quant(wi * s) / s).t()).pow(2).sum().item()
            for ref, (xi, wi) in zip(references, pairs, strict=True)
        )
        return total / max(count, 1)

    return _best_scales(_sample(x, max_tokens).abs().mean(0), w_mean, error)


@torch.no_grad()
def search_clip(x: torch.Tensor, w: torch.Tensor, grid: Grid, max_tokens: int = 256) -> torch.Tensor:
    """The clipped weight: each (row, group) limited to the fraction of its max |w| with the least output
    error of that group's partial dot products over the sampled inputs."""
    x = _sample(x, max_tokens)
    n, k = w.shape
    g = grid.group_size
    xg = x.reshape(x.shape[0], k // g, g)  # (T, groups, G)
    wg = w.reshape(n, k // g, g)
    reference = torch.einsum("tgj,ngj->ntg", xg, wg)
    top = wg.abs().amax(-1, keepdim=True)  # (N, groups, 1)
    best, best_err = top.clone(), torch.full(top.shape[:2], float("inf"), device=w.device)
    for i in range(int(MAX_SHRINK * N_GRID)):
        limit = top * (1 - i / N_GRID)
        clipped = torch.maximum(torch.minimum(wg, limit), -limit)
        q = grid.fake_quant(clipped.reshape(n, k)).reshape(n, k // g, g)
        err = (torch.einsum("tgj,ngj->ntg", xg, q) - reference).pow(2).mean(1)  # (N, groups)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better[..., None], limit, best)
    return torch.maximum(torch.minimum(wg, best), -best).reshape(n, k)
