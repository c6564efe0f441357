"""Gumbel-max sampling over counter-based noise: a pure function of (seed, position, vocab index).

`gumbel_argmax` is the op (greedy rows, temperature, a per-row cutoff and the noise in one pass over the
logits, then the argmax of each row's per-block bests); `gumbel_noise` materializes the noise itself.

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
ARGMAX_BLOCK_V = 4096  # vocab entries per program of the fused sampling kernel


@triton.jit
def _mix(x):
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB
    return x ^ (x >> 31)


@triton.jit
def _noise(seed, position, offs):
    """Gumbel noise (float64) of vocab entries `offs` for one row's (seed, position)."""
    key = _mix(_mix(seed.to(tl.uint64)) + (position.to(tl.uint64) + 1) * 0x9E3779B97F4A7C15)
    h = _mix(key + (offs.to(tl.uint64) + 1) * 0x9E3779B97F4A7C15)
    u = ((h >> 11).to(tl.float64) + 0.5) * 1.1102230246251565e-16  # 2**-53
    return -tl.log(-tl.log(u))


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
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    noise = _noise(tl.load(seeds_ptr + row), tl.load(positions_ptr + row), offs)
    tl.store(out_ptr + row.to(tl.int64) * stride_out_row + offs, noise.to(tl.float32), mask=offs < vocab)


# per-row knobs are slices of one packed upload, whose offsets' alignment changes with the batch's rows; each is
# read once a program, so alignment buys nothing (kernels/_backend.py: compiled_variants)
@triton.jit(do_not_specialize_on_alignment=["temperature_ptr", "threshold_ptr", "seeds_ptr", "positions_ptr"])
def _gumbel_argmax_kernel(
    # pointers
    logits_ptr,
    temperature_ptr,
    threshold_ptr,
    seeds_ptr,
    positions_ptr,
    best_value_ptr,
    best_index_ptr,
    # sizes
    vocab,
    num_blocks,
    # strides
    stride_logits_row,
    # meta
    BLOCK: tl.constexpr,
    GREEDY: tl.constexpr,  # every row greedy: the per-row knobs are never read
):
    """Each program: the best (score, index) of one row's block of the vocabulary."""
    row = tl.program_id(0)
    block = tl.program_id(1)
    offs = block * BLOCK + tl.arange(0, BLOCK)
    live = offs < vocab
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_logits_row + offs, mask=live, other=float("-inf"))
    x = x.to(tl.float32)
    if not GREEDY:
        temperature = tl.load(temperature_ptr + row)
        if temperature > 0:
            scaled = tl.math.div_rn(x, temperature)  # IEEE division: the bits torch computes the cutoffs from
            noise = _noise(tl.load(seeds_ptr + row), tl.load(positions_ptr + row), offs).to(tl.float32)
            keep = live & (scaled >= tl.load(threshold_ptr + row))
            x = tl.where(keep, scaled + noise, float("-inf"))
    value, index = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(best_value_ptr + row * num_blocks + block, value)
    tl.store(best_index_ptr + row * num_blocks + block, block * BLOCK + index.to(tl.int64))


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


def _check_rows(logits: torch.Tensor, *per_row: torch.Tensor) -> None:
    assert logits.dim() == 2 and logits.stride(1) == 1, f"logits {tuple(logits.shape)} rows not contiguous"
    for t in per_row:
        assert t.shape[0] == logits.shape[0] and t.numel() == logits.shape[0], "one value per row"
        assert t.device == logits.device, "per-row values on the logits' device"


def _blocked_argmax(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    threshold: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    greedy: bool,
) -> torch.Tensor:  # (rows,) int64
    """Each row's best of its blocks' bests: ties go to the lowest index, within a block by the kernel's
    tie-break and across blocks by torch's argmax (the first maximal value), as torch.argmax breaks them."""
    rows, vocab = logits.shape
    num_blocks = triton.cdiv(vocab, ARGMAX_BLOCK_V)
    best_value = torch.empty(rows, num_blocks, dtype=torch.float32, device=logits.device)
    best_index = torch.empty(rows, num_blocks, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return best_index[:, 0]
    _gumbel_argmax_kernel[(rows, num_blocks)](
        logits, temperature, threshold, seeds, positions,
        best_value, best_index,
        vocab, num_blocks,
        logits.stride(0),
        BLOCK=ARGMAX_BLOCK_V,
        GREEDY=greedy,
        num_warps=8,
    )  # fmt: skip
    return best_index.gather(1, best_value.argmax(dim=1, keepdim=True)).squeeze(1)


def gumbel_argmax_triton(
    logits: torch.Tensor,  # (rows, vocab) float32/bf16/fp16
    temperature: torch.Tensor,  # (rows,) or (rows, 1) float32; 0: greedy
    threshold: torch.Tensor,  # (rows,) or (rows, 1) float32: the smallest logits / temperature kept
    seeds: torch.Tensor,  # (rows,) int64
    positions: torch.Tensor,  # (rows,) int64
) -> torch.Tensor:  # (rows,) int64
    _check(seeds, positions)
    _check_rows(logits, temperature, threshold, seeds)
    return _blocked_argmax(
        logits, temperature.contiguous(), threshold.contiguous(), seeds.contiguous(), positions.contiguous(),
        greedy=False,
    )  # fmt: skip


def greedy_argmax_triton(logits: torch.Tensor) -> torch.Tensor:  # (rows, vocab) -> (rows,) int64
    assert logits.dim() == 2 and logits.stride(1) == 1, f"logits {tuple(logits.shape)} rows not contiguous"
    return _blocked_argmax(logits, logits, logits, logits, logits, greedy=True)


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """(rows,) int64: torch.argmax(logits, dim=-1), ties to the first index. On CUDA one program per row and
    4,096-entry block, then an argmax over the blocks' bests: torch's own argmax of one long row runs in
    one block of threads (27 us for Llama-3-8B's 128,256 entries on the H200, 1.3% of an int4 batch-1 step)."""
    if logits.dim() == 2 and logits.stride(1) == 1 and _backend.use_triton(logits):
        return greedy_argmax_triton(logits)
    return logits.argmax(dim=-1)


def gumbel_argmax_reference(
    logits: torch.Tensor,  # (rows, vocab)
    temperature: torch.Tensor,  # (rows,) or (rows, 1) float32; 0: greedy
    threshold: torch.Tensor,  # (rows,) or (rows, 1) float32
    seeds: torch.Tensor,  # (rows,) int64
    positions: torch.Tensor,  # (rows,) int64
) -> torch.Tensor:  # (rows,) int64
    _check(seeds, positions)
    _check_rows(logits, temperature, threshold, seeds)
    logits = logits.float()
    temperature, threshold = temperature.reshape(-1, 1), threshold.reshape(-1, 1)
    scaled = logits / torch.where(temperature > 0, temperature, 1.0)
    noise = gumbel_noise_reference(seeds, positions, logits.shape[1])
    scores = torch.where(scaled >= threshold, scaled + noise, float("-inf"))
    return torch.where(temperature.squeeze(1) > 0, scores.argmax(dim=1), logits.argmax(dim=1))


def gumbel_argmax(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    threshold: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """(rows,) int64: a row of temperature 0 takes the argmax of its logits; any other the argmax of
    logits / temperature + noise over the entries at or above its threshold, which samples
    softmax(logits / temperature) restricted to them."""
    if _backend.use_triton(logits):
        return gumbel_argmax_triton(logits, temperature, threshold, seeds, positions)
    return gumbel_argmax_reference(logits, temperature, threshold, seeds, positions)
