"""Random paged batches for the kernel tests (CPU and GPU): a KV cache whose pages are shuffled,
so a sequence's blocks are neither contiguous nor in order, and block tables padded with 0."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kv_quant import fp8_pairs_as_fp16


def make_paged_kv(
    seq_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    spare_blocks: int = 3,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return kv_cache (2, num_blocks, block_size, num_kv_heads, head_dim), block_tables
    (num_seqs, max_blocks) int32 and seq_lens (num_seqs,) int32."""
    per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(per_seq) + spare_blocks
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, device=device).to(dtype)
    perm = torch.randperm(num_blocks).tolist()
    width = max(max(per_seq, default=1), 1)
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    used = 0
    for i, n in enumerate(per_seq):
        tables[i, :n] = torch.tensor(perm[used : used + n], dtype=torch.int32)
        used += n
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    return kv_cache, tables.to(device), seq_lens_t.to(device)


def query_start_loc(query_lens: list[int], device: str | torch.device = "cpu") -> torch.Tensor:
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return torch.tensor(starts, dtype=torch.int32, device=device)


@triton.jit
def _fp8_pairs_kernel(words_ptr, lo_ptr, hi_ptr, n, BLOCK: tl.constexpr, CUDA: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    lo, hi = fp8_pairs_as_fp16(tl.load(words_ptr + offs, mask=offs < n, other=0), CUDA)
    tl.store(lo_ptr + offs, lo, mask=offs < n)
    tl.store(hi_ptr + offs, hi, mask=offs < n)


def every_fp8_pair(device: str | torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """All 65,536 16-bit words as two e4m3 bytes: the words' bytes as torch converts them to fp16 (low, then
    high), against kernels/kv_quant.py's fp8_pairs_as_fp16 on them (the interpreter's bit operations on CPU,
    the inline assembly on CUDA), each (65536, 2) fp16."""
    words = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).to(device)
    as_bytes = words.view(torch.float8_e4m3fn).view(-1, 2)  # little-endian: the low byte first
    want = as_bytes.to(torch.float16)
    lo, hi = torch.empty_like(words, dtype=torch.float16), torch.empty_like(words, dtype=torch.float16)
    _fp8_pairs_kernel[(triton.cdiv(words.numel(), 1024),)](
        words, lo, hi, words.numel(), BLOCK=1024, CUDA=words.is_cuda
    )  # fmt: skip
    return want, torch.stack([lo, hi], 1)
