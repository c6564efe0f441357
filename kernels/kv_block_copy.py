"""Copy KV blocks between two pools in one pass: dst[:, :, dst_ids[i]] = src[:, :, src_ids[i]].

Pools are (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim) and contiguous, so one
(layer, K/V, block) is one contiguous row of block_size * num_kv_heads * head_dim elements. The
kernel moves rows as 4-byte words (bits only: any dtype), one program per (block pair, row group),
in contiguous chunks that Triton turns into 16-byte vector loads and stores. Unlike torch's
index_copy / index_select, any pattern of ids takes one pass over the data (no gather into a
staging buffer), and the destination may be another process's pool mapped over CUDA IPC.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from kernels import _backend

# words per loop step (32 KiB: a whole Llama-3-8B row, eight 16-byte vectors per thread at 8 warps), (layer,
# K/V) rows per program, warps: among the best of 36 configs timed on the H200 with random ids
# (bench/kvtransfer.py --sweep, bench/results/kvtransfer_copy_sweep.json: 1686 GB/s, the best 1725, 2048 / 4 / 4
# 1441)
DEFAULT_CONFIG = {"chunk": 8192, "rows_per_program": 1, "num_warps": 8}
LANDING_WAIT_S = 60.0  # GraphedBlockCopy: how long a call waits for its bucket's last copy to land


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
    count_ptr,  # HAS_COUNT: pairs past the int32 count there do nothing (a grid sized for more)
    WORDS: tl.constexpr,
    CHUNK: tl.constexpr,
    ROWS_PER_PROGRAM: tl.constexpr,
    HAS_COUNT: tl.constexpr,
):
    pair = tl.program_id(0)
    row0 = tl.program_id(1) * ROWS_PER_PROGRAM
    live = True
    if HAS_COUNT:
        live = pair < tl.load(count_ptr)
    if live:
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
    count: torch.Tensor | None = None,  # (1,) int32 on the device: copy only the first count[0] pairs
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
        count if count is not None else src_ids,
        WORDS=words,
        CHUNK=min(cfg["chunk"], triton.next_power_of_2(words)),
        ROWS_PER_PROGRAM=cfg["rows_per_program"],
        HAS_COUNT=count is not None,
        num_warps=cfg["num_warps"],
    )  # fmt: skip


class IdUploader:
    """Puts (src_ids, dst_ids) on the GPU as one int32 tensor [src..., dst...] with a single queued copy
    from a pinned buffer kept across calls. Allocating pinned memory per call (tensor.pin_memory()) cost
    more host time than the 512 MiB copy itself on the H200 machine (~270 us per copy_blocks call). The
    pinned buffer is rewritten only after the previous upload from it has completed (an
    event), and the device buffer is reused in stream order, so one uploader serves one stream."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._host = torch.empty(0, dtype=torch.int32)
        self._dev = torch.empty(0, dtype=torch.int32, device=device)
        self._done: torch.cuda.Event | None = None

    def upload(self, src_ids: Sequence[int], dst_ids: Sequence[int]) -> torch.Tensor:
        n = len(src_ids)
        if self._done is not None:
            self._done.synchronize()  # the last upload has read the pinned buffer
        if self._host.numel() < 2 * n:
            cap = max(2 * n, 1024)
            self._host = torch.empty(cap, dtype=torch.int32, pin_memory=True)
            self._dev = torch.empty(cap, dtype=torch.int32, device=self.device)
        host = self._host.numpy()
        host[:n] = np.asarray(src_ids, dtype=np.int32)
        host[n : 2 * n] = np.asarray(dst_ids, dtype=np.int32)
        ids = self._dev[: 2 * n]
        ids.copy_(self._host[: 2 * n], non_blocking=True)
        if self._done is None:
            self._done = torch.cuda.Event()
        self._done.record()
        return ids


class GraphedBlockCopy:
    """kv_block_copy between two fixed CUDA pools as one CUDA graph replay on the current stream.

    An eager copy_blocks call spends its host time in torch's id upload and Triton's launch (~0.4 ms of
    the ~0.8 ms fixed cost of an eagerly copied cuda_ipc transfer on the H200 hosts, by the sender's stage
    marks). Here the ids go into a pinned buffer with numpy, and one
    graph launch runs both the upload (a host-to-device copy node reading that buffer) and the kernel.
    The kernel's grid is sized for a bucket of pairs (the power of two >= n, at least MIN_BUCKET);
    programs past n, read from the device, do nothing. One graph per bucket, captured on first use (on a
    side stream, capture_error_mode="thread_local": other threads' CUDA calls go on meanwhile). A
    bucket's pinned buffer is rewritten only after its last replay has read it (an event; with a
    landing cell, that replay's number there).

    With `landing` (one int64 in page-locked host memory, e.g. a cuda_ipc landing cell), each call also
    takes a number `seq`, which travels up with the ids and is copied down into `landing` after the
    kernel, in the same graph: when the host sees it there, the blocks have landed."""

    MIN_BUCKET = 16

    def __init__(
        self,
        src_pool: torch.Tensor,
        dst_pool: torch.Tensor,
        config: dict | None = None,
        landing: torch.Tensor | None = None,
    ) -> None:
        assert src_pool.is_cuda and dst_pool.device == src_pool.device, "both pools on one CUDA device"
        assert landing is None or (
            landing.dtype == torch.int64 and landing.numel() == 1 and landing.is_pinned()
        )
        self.src_pool, self.dst_pool, self.config, self.landing = src_pool, dst_pool, config, landing
        self._landed = landing.numpy() if landing is not None else None  # read without a CUDA call
        self._last_seq: dict[int, int] = {}  # bucket -> the number its last replay lands
        # bucket -> (graph, pinned [n, src..., dst..., pad, seq as int64], its numpy view, event after the
        # last replay)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, np.ndarray, torch.cuda.Event]] = {}

    def bucket(self, n: int) -> int:
        return max(self.MIN_BUCKET, 1 << max(n - 1, 0).bit_length())  # the power of two >= n, in plain Python

    def __call__(
        self, src_ids: Sequence[int] | np.ndarray, dst_ids: Sequence[int] | np.ndarray, seq: int | None = None
    ) -> None:
        n = len(src_ids)
        assert (seq is None) == (self.landing is None), "seq goes with a landing cell, and only with one"
        if n == 0 and seq is None:
            return
        b = self.bucket(n)
        entry = self._graphs.get(b)
        if entry is None:
            entry = self._graphs[b] = self._capture(b)
        graph, _, host, done = entry
        # The last replay's upload must have read the buffer: with a landing cell, its number there says
        # so without a CUDA call (the common case: that replay ended long ago); else its event does.
        if self._landed is None:
            done.synchronize()  # at once when none ran yet
        elif self._landed[0] < self._last_seq.get(b, 0):
            self._wait_landed(self._last_seq[b])
        host[0] = n
        host[1 : 1 + n] = src_ids
        host[1 + b : 1 + b + n] = dst_ids
        if seq is not None:
            host.view(np.int64)[1 + b] = seq  # int32 words 2 + 2b, 3 + 2b: 8-byte aligned
            self._last_seq[b] = seq
        graph.replay()
        if self._landed is None:
            done.record()

    def _wait_landed(self, seq: int, timeout: float = LANDING_WAIT_S) -> None:
        assert self._landed is not None
        deadline = time.monotonic() + timeout
        while self._landed[0] < seq:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the block copy numbered {seq} did not land within {timeout:g} s")
            os.sched_yield()  # releases the GIL; time.sleep(0) would sleep ~80 us (timer slack)

    def _capture(self, b: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, np.ndarray, torch.cuda.Event]:
        device = self.src_pool.device
        pinned = torch.zeros(4 + 2 * b, dtype=torch.int32, pin_memory=True)
        ids = torch.zeros(4 + 2 * b, dtype=torch.int32, device=device)  # count 0: a launch copies nothing

        def launch() -> None:
            kv_block_copy_triton(
                self.src_pool,
                ids[1 : 1 + b],
                self.dst_pool,
                ids[1 + b : 1 + 2 * b],
                self.config,
                count=ids[:1],
            )

        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            launch()  # compiles the kernel outside the capture
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                ids.copy_(pinned, non_blocking=True)
                launch()
                if self.landing is not None:
                    self.landing.copy_(ids[2 + 2 * b :].view(torch.int64), non_blocking=True)
            finally:
                graph.capture_end()
        torch.cuda.current_stream(device).wait_stream(side)
        done = torch.cuda.Event()
        return graph, pinned, pinned.numpy(), done


_uploaders: dict[tuple[int, int], IdUploader] = {}
_uploaders_lock = threading.Lock()


def upload_ids(src_ids: Sequence[int], dst_ids: Sequence[int], device: torch.device) -> torch.Tensor:
    """(src_ids, dst_ids) as one int32 tensor [src..., dst...] on `device`: on CUDA queued on the current
    stream (IdUploader); on CPU (the kernel under TRITON_INTERPRET) a plain tensor."""
    if device.type != "cuda":
        return torch.tensor([*src_ids, *dst_ids], dtype=torch.int32)
    stream = torch.cuda.current_stream(device)
    key = (stream.device_index, stream.cuda_stream)
    with _uploaders_lock:
        uploader = _uploaders.get(key)
        if uploader is None:
            uploader = _uploaders[key] = IdUploader(device)
    return uploader.upload(src_ids, dst_ids)


def kv_block_copy_reference(
    src_pool: torch.Tensor, src_ids: Sequence[int], dst_pool: torch.Tensor, dst_ids: Sequence[int]
) -> None:
    for s, d in zip(src_ids, dst_ids, strict=True):
        dst_pool[:, :, d] = src_pool[:, :, s]


def kv_block_copy(
    src_pool: torch.Tensor, src_ids: Sequence[int], dst_pool: torch.Tensor, dst_ids: Sequence[int]
) -> None:
    if _backend.use_triton(src_pool):
        ids = upload_ids(src_ids, dst_ids, src_pool.device)
        n = len(src_ids)
        kv_block_copy_triton(src_pool, ids[:n], dst_pool, ids[n:])
    else:
        kv_block_copy_reference(src_pool, src_ids, dst_pool, dst_ids)
