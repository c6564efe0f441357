"""Copy KV blocks between two pools in one pass: dst[:, :, dst_ids[i]] = src[:, :, src_ids[i]].

Pools are (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim) and contiguous, so one
(layer, K/V, block) is one contiguous row of block_size * num_kv_heads * head_dim elements. The
kernel moves rows as 4-byte words (bits only: any dtype), one program per (block pair, row group),
in contiguous chunks that Triton turns into 16-byte vector loads and stores. Unlike torch's
index_copy / index_select, any pattern of ids takes one pass over the data (no gather into a
staging buffer), and the destination may be another process's pool mapped over CUDA IPC.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kernels import _backend

# words per loop step (8 KiB: four 16-byte vectors per thread at 4 warps), (layer, K/V) rows per program,
# warps: a first guess, not yet tuned (bench/kvtransfer.py --sweep times others)
DEFAULT_CONFIG = {"chunk": 2048, "rows_per_program": 4, "num_warps": 4}


@triton.jit
def _kv_block_copy_kernel(
    src_ptr,
    dst_ptr,
    src_ids_ptr,
    dst_ids_ptr,
    num_rows,
    stride_src_row,
    stride_src_block,
    stride_dst_row,
    stride_dst_block,
    WORDS: tl.constexpr,
    CHUNK: tl.constexpr,
    ROWS_PER_PROGRAM: tl.constexpr,
):
    pair = tl.program_id(0)
    row0 = tl.program_id(1) * ROWS_PER_PROGRAM
    s = tl.load(src_ids_ptr + pair).to(tl.int64)
    d = tl.load(dst_ids_ptr + pair).to(tl.int64)
    offs = tl.arange(0, CHUNK)
    for r in range(ROWS_PER_PROGRAM):
        row = row0 + r
        if row < num_rows:
            src = src_ptr + row.to(tl.int64) * stride_src_row + s * stride_src_block
            dst = dst_ptr + row.to(tl.int64) * stride_dst_row + d * stride_dst_block
            for w0 in range(0, WORDS, CHUNK):
                if WORDS % CHUNK == 0:
                    tl.store(dst + w0 + offs, tl.load(src + w0 + offs))
                else:
                    mask = w0 + offs < WORDS
                    tl.store(dst + w0 + offs, tl.load(src + w0 + offs, mask=mask), mask=mask)


def _words(pool: torch.Tensor) -> torch.Tensor:
    """The pool as (num_layers * 2, num_blocks, words): 4-byte words when a row divides into them."""
    assert pool.dim() == 6 and pool.shape[1] == 2 and pool.is_contiguous(), "pool layout"
    flat = pool.view(pool.shape[0] * 2, pool.shape[2], -1)
    row_bytes = flat.shape[2] * flat.element_size()
    for word in (torch.int32, torch.int16, torch.uint8):
        if row_bytes % word.itemsize == 0:
            return flat.view(word)
    raise AssertionError("unreachable: every row is a whole number of bytes")


def kv_block_copy_triton(
    src_pool: torch.Tensor,
    src_ids: torch.Tensor,  # (n,) int32/int64 on the pools' device
    dst_pool: torch.Tensor,
    dst_ids: torch.Tensor,  # (n,) int32/int64 on the pools' device; no repeats
    config: dict | None = None,  # DEFAULT_CONFIG's keys
) -> None:
    src, dst = _words(src_pool), _words(dst_pool)
    assert src.shape[0] == dst.shape[0] and src.shape[2] == dst.shape[2] and src.dtype == dst.dtype, (
        f"pools differ: {tuple(src_pool.shape)} {src_pool.dtype} vs {tuple(dst_pool.shape)} {dst_pool.dtype}"
    )
    assert src_ids.shape == dst_ids.shape and src_ids.dim() == 1, "one destination per source block"
    n = src_ids.shape[0]
    if n == 0:
        return
    cfg = {**DEFAULT_CONFIG, **(config or {})}
    num_rows, _, words = src.shape
    grid = (n, triton.cdiv(num_rows, cfg["rows_per_program"]))
    _kv_block_copy_kernel[grid](
        src, dst, src_ids, dst_ids, num_rows,
        src.stride(0), src.stride(1), dst.stride(0), dst.stride(1),
        WORDS=words,
        CHUNK=min(cfg["chunk"], triton.next_power_of_2(words)),
        ROWS_PER_PROGRAM=cfg["rows_per_program"],
        num_warps=cfg["num_warps"],
    )  # fmt: skip


def kv_block_copy_reference(
    src_pool: torch.Tensor, src_ids: Sequence[int], dst_pool: torch.Tensor, dst_ids: Sequence[int]
) -> None:
    for s, d in zip(src_ids, dst_ids, strict=True):
        dst_pool[:, :, d] = src_pool[:, :, s]


def kv_block_copy(
    src_pool: torch.Tensor, src_ids: Sequence[int], dst_pool: torch.Tensor, dst_ids: Sequence[int]
) -> None:
    if _backend.use_triton(src_pool):
        device = src_pool.device
        as_tensor = [torch.tensor(list(ids), dtype=torch.int32).to(device) for ids in (src_ids, dst_ids)]
        kv_block_copy_triton(src_pool, as_tensor[0], dst_pool, as_tensor[1])
    else:
        kv_block_copy_reference(src_pool, src_ids, dst_pool, dst_ids)
