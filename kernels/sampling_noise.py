"""Counter-based Gumbel noise for sampling: a pure function of (seed, position, vocab index).

Each row's noise comes from its (seed, position) alone, so a seeded request draws the same tokens whatever
else shares the batch, on CPU and GPU alike (integer hashing is exact on both; only the two float64 logs
may round differently in the last bit). The construction is SplitMix64 (Steele, Lea, Flood 2014), whose
outputs over consecutive counters pass BigCrush:

    key     = mix(mix(seed) + (position + 1) * GAMMA)          one stream per (seed, position)
    h[v]    = mix(key + (v + 1) * GAMMA)                       that stream's v-th output
    u[v]    = ((h[v] >> 11) + 0.5) * 2**-53                    uniform in (0, 1), never 0 or 1
    noise[v] = -log(-log(u[v]))                                Gumbel(0, 1), rounded to float32

mix is SplitMix64's finalizer; every operation is on 64-bit words modulo 2**64. argmax(logit / T + noise)
samples softmax(logit / T) (the Gumbel-max trick, equivalently argmax(p / Exp(1))).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import _backend

GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's increment: 2**64 / golden ratio, odd
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB
BLOCK_V = 1024


@triton.jit
def _mix(x):
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB
    return x ^ (x >> 31)


@triton.jit
def _gumbel_noise_kernel(
    # pointers
    seeds_ptr,
    positions_ptr,
    out_ptr,
    # sizes
    vocab,
    # strides
    stride_out_row,
    # meta
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    seed = tl.load(seeds_ptr + row).to(tl.uint64)
    position = tl.load(positions_ptr + row).to(tl.uint64)
    key = _mix(_mix(seed) + (position + 1) * 0x9E3779B97F4A7C15)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    h = _mix(key + (offs.to(tl.uint64) + 1) * 0x9E3779B97F4A7C15)
    u = ((h >> 11).to(tl.float64) + 0.5) * 1.1102230246251565e-16  # 2**-53
    noise = -tl.log(-tl.log(u))
    tl.store(out_ptr + row.to(tl.int64) * stride_out_row + offs, noise.to(tl.float32), mask=offs < vocab)


def _check(seeds: torch.Tensor, positions: torch.Tensor) -> None:
    assert seeds.dim() == 1 and seeds.shape == positions.shape, "one seed and one position per row"
    assert seeds.dtype == positions.dtype == torch.int64, "seeds and positions are int64"
    assert seeds.device == positions.device, "seeds and positions on one device"


def gumbel_noise_triton(
    seeds: torch.Tensor,  # (rows,) int64: 64-bit words, any bit pattern
    positions: torch.Tensor,  # (rows,) int64: the token position each row samples
    vocab: int,
) -> torch.Tensor:  # (rows, vocab) float32
    _check(seeds, positions)
    rows = seeds.shape[0]
    out = torch.empty(rows, vocab, dtype=torch.float32, device=seeds.device)
    if rows == 0 or vocab == 0:
        return out
    grid = (rows, triton.cdiv(vocab, BLOCK_V))
    _gumbel_noise_kernel[grid](
        seeds.contiguous(), positions.contiguous(), out,
        vocab,
        out.stride(0),
        BLOCK=BLOCK_V,
        num_warps=4,
    )  # fmt: skip
    return out


def _signed(word: int) -> int:
    """A 64-bit word as the int64 that holds the same bits."""
    return word - (1 << 64) if word >= 1 << 63 else word


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 words (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix_reference(x: torch.Tensor) -> torch.Tensor:
    x = (x ^ _shr(x, 30)) * _signed(MIX1)  # int64 products wrap modulo 2**64, as the words do
    x = (x ^ _shr(x, 27)) * _signed(MIX2)
    return x ^ _shr(x, 31)


def gumbel_noise_reference(
    seeds: torch.Tensor,  # (rows,) int64
    positions: torch.Tensor,  # (rows,) int64
    vocab: int,
) -> torch.Tensor:  # (rows, vocab) float32
    _check(seeds, positions)
    gamma = _signed(GAMMA)
    key = _mix_reference(_mix_reference(seeds) + (positions + 1) * gamma)  # (rows,)
    counters = (torch.arange(vocab, dtype=torch.int64, device=seeds.device) + 1) * gamma  # (vocab,)
    h = _mix_reference(key.unsqueeze(1) + counters)  # (rows, vocab)
    u = (_shr(h, 11).double() + 0.5) * 2.0**-53
    return (-torch.log(-torch.log(u))).float()


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    if _backend.use_triton(seeds):
        return gumbel_noise_triton(seeds, positions, vocab)
    return gumbel_noise_reference(seeds, positions, vocab)
