"""kernels/kv_block_copy.py against its reference, under Triton's interpreter on CPU: bit-exact copies
of KV blocks between pools for any id pattern, dtypes whose rows are not whole 4-byte words included."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything here imports triton

import random

import pytest
import torch

from kernels.kv_block_copy import kv_block_copy_reference, kv_block_copy_triton


def pool(layers: int, blocks: int, block: int, heads: int, dim: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(
        -(2**15), 2**15, (layers, 2, blocks, block, heads, dim), generator=g, dtype=torch.int32
    )
    return bits.to(torch.int16).view(torch.bfloat16).to(dtype) if dtype != torch.int8 else bits.to(torch.int8)


@pytest.mark.parametrize(
    "shape, dtype",
    [
        ((3, 16, 2, 64), torch.bfloat16),  # 4-byte words, rows of 1024 words (one chunk)
        ((2, 16, 3, 64), torch.float16),  # 1536 words: a masked chunk
        ((5, 4, 1, 3), torch.int8),  # 12-byte rows: 4-byte words, 3 of them
        ((2, 3, 1, 3), torch.int8),  # 9-byte rows: byte words
        ((1, 2, 5, 2600), torch.float32),  # rows longer than one chunk
    ],
)
@pytest.mark.parametrize("pattern", ["contiguous", "scattered", "random", "one", "none"])
def test_copy_equals_reference(shape, dtype, pattern):
    layers, block, heads, dim = shape
    rng = random.Random(f"{shape}{pattern}")
    src = pool(layers, 12, block, heads, dim, dtype, 1)
    dst = pool(layers, 20, block, heads, dim, dtype, 2)
    n = {"one": 1, "none": 0}.get(pattern, 7)
    src_ids = list(range(2, 2 + n)) if pattern != "random" else rng.sample(range(12), n)
    dst_ids = list(range(10, 10 + n)) if pattern == "contiguous" else rng.sample(range(20), n)
    want = dst.clone()
    kv_block_copy_reference(src, src_ids, want, dst_ids)
    kv_block_copy_triton(
        src, torch.tensor(src_ids, dtype=torch.int32), dst, torch.tensor(dst_ids, dtype=torch.int64)
    )
    assert torch.equal(dst.view(torch.uint8), want.view(torch.uint8))
    if n:  # the blocks not named are untouched and the named ones did change
        assert not torch.equal(want, pool(layers, 20, block, heads, dim, dtype, 2))


@pytest.mark.parametrize("n", [0, 1, 5, 8])
def test_count_limits_a_larger_grid_to_the_first_pairs(n):
    """The graphed copy's kernel runs a grid sized for a bucket of pairs and reads how many are real from
    the device: pairs past the count copy nothing, though their id slots hold valid-looking ids."""
    src = pool(2, 12, 4, 2, 8, torch.float32, 3)
    dst = pool(2, 20, 4, 2, 8, torch.float32, 4)
    rng = random.Random(n)
    src_ids, dst_ids = rng.sample(range(12), 8), rng.sample(range(20), 8)  # 8 slots: the bucket
    want = dst.clone()
    kv_block_copy_reference(src, src_ids[:n], want, dst_ids[:n])
    kv_block_copy_triton(
        src,
        torch.tensor(src_ids, dtype=torch.int32),
        dst,
        torch.tensor(dst_ids, dtype=torch.int32),
        count=torch.tensor([n], dtype=torch.int32),
    )
    assert torch.equal(dst.view(torch.uint8), want.view(torch.uint8))  # bitwise: the pools hold NaNs
