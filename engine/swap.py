"""Swap space: preempted requests' KV blocks in pinned CPU memory, copied out and back in one pass each way.

The CPU pool has the GPU pool's layout, one per GPU pool swapped (the target's; a draft model's is recomputed):

    cpu_pool[layer][0 = K | 1 = V][cpu_block][offset][kv_head][dim]     (num_cpu_blocks of them)

A swapped-out request keeps one CPU block per block of its table, in table order, and the count of its
computed tokens. A block with a prefix-cache hash is shared on the CPU as on the GPU: a prompt prefix that
several requests swap out is copied once and ref-counted (`CpuBlocks`). Swapping in, the scheduler first
matches the GPU prefix cache (blocks still there, shared or cached, come back under their own ids); only
the rest are copied back, into fresh blocks, and hashed again (BlockManager.cache_computed_blocks), so
block ids, ref counts and hashes end as if the request had never left.

Copies are queued as the scheduler swaps requests out and in, and `flush` (at the end of each schedule)
runs each run of same-direction copies as one pass over any set of ids: on CUDA the block-copy kernel
(kernels/kv_block_copy.py), which reads and writes the pinned pool through its device mapping, on a side
stream; elsewhere one index_select and one index_copy. On CUDA the side stream first waits for the work queued before it (a step in flight
may still write a victim's blocks, or read the blocks a swap-in overwrites), and the compute stream waits
for the copy before its next step (which may reuse the blocks swapped out). Where something besides the
compute stream writes the pool (a decode worker's KV receiver: BlockManager.hold_for is set), the blocks
copied out stay held until their copy is done (`poll`). Called from the engine's scheduling thread only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.block_hash import BlockHash
from engine.block_manager import BlockManager
from engine.sequence import Sequence
from engine.uploads import upload
from kernels import _backend

OUT, IN = "out", "in"
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class CpuBlocks:
    """Ref-counted CPU block ids; a block holding a hashed GPU block is found again by its hash."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.free = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self.ref = [0] * num_blocks
        self.by_hash: dict[BlockHash, int] = {}
        self.hash_of: dict[int, BlockHash] = {}

    @property
    def num_free(self) -> int:
        return len(self.free)

    def has(self, block_hash: BlockHash | None) -> bool:
        return block_hash is not None and block_hash in self.by_hash

    def take(self, block_hash: BlockHash | None) -> tuple[int, bool]:
        """A CPU block for one GPU block: the one already holding its hash (one more reference, nothing to
        copy) or a free one (to be copied into); True for a new one."""
        if block_hash is not None and (cpu_id := self.by_hash.get(block_hash)) is not None:
            self.ref[cpu_id] += 1
            return cpu_id, False
        cpu_id = self.free.pop()
        self.ref[cpu_id] = 1
        if block_hash is not None:
            self.by_hash[block_hash] = cpu_id
            self.hash_of[cpu_id] = block_hash
        return cpu_id, True

    def release(self, cpu_id: int) -> None:
        assert self.ref[cpu_id] > 0, f"CPU block {cpu_id} released twice"
        self.ref[cpu_id] -= 1
        if self.ref[cpu_id] == 0:
            block_hash = self.hash_of.pop(cpu_id, None)
            if block_hash is not None:
                del self.by_hash[block_hash]
            self.free.append(cpu_id)


@dataclass
class SwapStats:
    """Running totals, exported as the kv_swap_* counters (engine/engine_core.py: counters)."""

    out_blocks: int = 0
    in_blocks: int = 0
    out_bytes: int = 0
    in_bytes: int = 0
    out_seconds: float = 0.0
    in_seconds: float = 0.0

    def add(self, direction: str, blocks: int, nbytes: int, seconds: float) -> None:
        if direction == OUT:
            self.out_blocks, self.out_bytes = self.out_blocks + blocks, self.out_bytes + nbytes
            self.out_seconds += seconds
        else:
            self.in_blocks, self.in_bytes = self.in_blocks + blocks, self.in_bytes + nbytes
            self.in_seconds += seconds


@dataclass
class _Swapped:
    cpu_ids: list[int]  # one per block of the table, in order
    num_computed: int  # the tokens whose KV they hold


class SwapSpace:
    def __init__(
        self, gpu_pools: list[torch.Tensor], num_cpu_blocks: int, block_manager: BlockManager
    ) -> None:
        if num_cpu_blocks < 1:
            raise ValueError(f"the swap space holds no block of {block_nbytes(gpu_pools)} bytes")
        self.gpu_pools = gpu_pools
        self.block_manager = block_manager
        self.cuda = gpu_pools[0].is_cuda
        # (num_layers, 2, num_cpu_blocks, block_size, num_kv_heads, head_dim) each, page-locked on CUDA hosts
        self.cpu_pools = [
            torch.empty(p.shape[0], 2, num_cpu_blocks, *p.shape[3:], dtype=p.dtype, pin_memory=self.cuda)
            for p in gpu_pools
        ]
        self.cpu = CpuBlocks(num_cpu_blocks)
        self.block_nbytes = block_nbytes(gpu_pools)
        self.stats = SwapStats()
        self._swapped: dict[str, _Swapped] = {}
        self._queue: list[tuple[str, list[int], list[int], list[int]]] = []  # (direction, src, dst, held)
        self._stream = torch.cuda.Stream(gpu_pools[0].device) if self.cuda else None
        # CUDA: copies not yet seen done: (direction, blocks, start, end events, GPU blocks held till then)
        self._pending: list[tuple[str, int, torch.cuda.Event, torch.cuda.Event, list[int]]] = []

    @property
    def num_blocks(self) -> int:
        return self.cpu.num_blocks

    @property
    def num_swapped(self) -> int:
        return len(self._swapped)

    @property
    def usage(self) -> float:
        return 1.0 - self.cpu.num_free / self.cpu.num_blocks

    def holds(self, seq: Sequence) -> bool:
        return seq.request_id in self._swapped

    def blocks_to_copy_out(self, seq: Sequence) -> int:
        """Blocks of the request's computed KV without a CPU copy yet (what swapping it out would copy)."""
        blocks = self.block_manager.blocks
        return sum(1 for b in self._computed_blocks(seq) if not self.cpu.has(blocks[b].block_hash))

    def can_swap_out(self, seq: Sequence) -> bool:
        return seq.num_computed_tokens > 0 and self.blocks_to_copy_out(seq) <= self.cpu.num_free

    def swap_out(self, seq: Sequence) -> None:
        """Copy the request's computed blocks to the CPU (each hashed block once) and free its GPU blocks."""
        assert self.can_swap_out(seq) and not self.holds(seq)
        bm = self.block_manager
        cpu_ids, src, dst = [], [], []
        for gpu_id in self._computed_blocks(seq):
            cpu_id, new = self.cpu.take(bm.blocks[gpu_id].block_hash)
            cpu_ids.append(cpu_id)
            if new:
                src.append(gpu_id)
                dst.append(cpu_id)
        self._swapped[seq.request_id] = _Swapped(cpu_ids, seq.num_computed_tokens)
        held = list(src) if self.cuda and bm.hold_for is not None else []
        bm.hold(held)  # until the copy has read them (poll): others write the pool meanwhile
        self._queue_copy(OUT, src, dst, held)
        bm.free(seq)

    def restorable_tokens(self, seq: Sequence) -> int:
        """The computed tokens a swap-in would bring back (0 for a request not swapped out)."""
        swapped = self._swapped.get(seq.request_id)
        return swapped.num_computed if swapped is not None else 0

    def swap_in(self, seq: Sequence) -> None:
        """Bring a swapped-out request's KV back, after its table took the GPU prefix-cache hits
        (BlockManager.allocate_prefix): the blocks past them are allocated and copied in, the CPU blocks
        released. The caller checked that the pool can hold them."""
        swapped = self._swapped.pop(seq.request_id, None)
        if swapped is None:
            return
        bm, have = self.block_manager, len(seq.block_table)
        if have * bm.block_size < swapped.num_computed:
            assert bm.allocate(seq, swapped.num_computed), "swap-in admitted without room"
            self._queue_copy(IN, swapped.cpu_ids[have:], seq.block_table[have:], [])
            seq.num_computed_tokens = swapped.num_computed
            bm.cache_computed_blocks(seq)
        for cpu_id in swapped.cpu_ids:
            self.cpu.release(cpu_id)

    def forget(self, seq: Sequence) -> None:
        """A swapped-out request ended: its CPU blocks are free (later copies queue after any still running)."""
        swapped = self._swapped.pop(seq.request_id, None)
        for cpu_id in swapped.cpu_ids if swapped is not None else []:
            self.cpu.release(cpu_id)

    def flush(self) -> None:
        """Run the queued copies, in order, each run of one direction as one pass."""
        queue, self._queue = self._queue, []
        for direction, src, dst, held in queue:
            self._copy(direction, src, dst, held)

    def poll(self) -> None:
        """Count the copies done since the last call and release the GPU blocks they held."""
        while self._pending and self._pending[0][3].query():
            direction, blocks, start, end, held = self._pending.pop(0)
            self.stats.add(direction, blocks, blocks * self.block_nbytes, start.elapsed_time(end) / 1e3)
            self.block_manager.release(held)

    def synchronize(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()
        self.poll()

    def round_trip(self, gpu_ids: list[int], cpu_ids: list[int]) -> float:
        """Seconds to copy these GPU blocks out to these CPU blocks and back, on the path swaps take (for
        start-up measurements and benchmarks: only where nothing is stored in them)."""
        if self.cuda:
            torch.cuda.synchronize(self.gpu_pools[0].device)
        t0 = time.perf_counter()
        self._queue_copy(OUT, gpu_ids, cpu_ids, [])
        self._queue_copy(IN, cpu_ids, gpu_ids, [])
        self.flush()
        self.synchronize()
        return time.perf_counter() - t0

    def _computed_blocks(self, seq: Sequence) -> list[int]:
        return seq.block_table[: -(-seq.num_computed_tokens // self.block_manager.block_size)]

    def _queue_copy(self, direction: str, src_ids: list[int], dst_ids: list[int], held: list[int]) -> None:
        if not src_ids:
            return
        if self._queue and self._queue[-1][0] == direction:  # one pass for this run of one direction
            _, src, dst, hold = self._queue[-1]
            src += src_ids
            dst += dst_ids
            hold += held
        else:
            self._queue.append((direction, list(src_ids), list(dst_ids), list(held)))

    def _copy(self, direction: str, src_ids: list[int], dst_ids: list[int], held: list[int]) -> None:
        if self._stream is None:
            t0 = time.perf_counter()
            self._copy_pools(direction, src_ids, dst_ids)
            n = len(src_ids)
            self.stats.add(direction, n, n * self.block_nbytes, time.perf_counter() - t0)
            return
        main = torch.cuda.current_stream(self.gpu_pools[0].device)
        self._stream.wait_stream(main)  # after every step queued so far: it may write or read these blocks
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self._stream):
            start.record()
            self._copy_pools(direction, src_ids, dst_ids)
            end.record()
        main.wait_event(end)  # the next step may reuse or read the blocks
        self._pending.append((direction, len(src_ids), start, end, held))

    def _copy_pools(self, direction: str, src_ids: list[int], dst_ids: list[int]) -> None:
        for gpu, cpu in zip(self.gpu_pools, self.cpu_pools):
            src, dst = (gpu, cpu) if direction == OUT else (cpu, gpu)
            copy_blocks(src, src_ids, dst, dst_ids)


def block_nbytes(pools: list[torch.Tensor]) -> int:
    """Bytes of one block across the pools: every layer's K and V."""
    return sum(p.shape[0] * 2 * p[0, 0, 0].numel() * p.element_size() for p in pools)


def copy_blocks(src: torch.Tensor, src_ids: list[int], dst: torch.Tensor, dst_ids: list[int]) -> None:
    """dst[:, :, dst_ids[i]] = src[:, :, src_ids[i]] in one pass: the block-copy kernel where one pool is on
    CUDA (the other pinned), else one index_select and one index_copy (as bytes: any dtype)."""
    gpu = src if src.is_cuda else dst
    if gpu.is_cuda and _backend.use_triton(gpu):
        from kernels.kv_block_copy import kv_block_copy_triton  # triton: only on this path

        n = len(src_ids)
        ids = upload(torch.tensor([*src_ids, *dst_ids], dtype=torch.int32), gpu.device)  # queued, no wait
        kv_block_copy_triton(src, ids[:n], dst, ids[n:])
        return
    word = _WORDS[dst.element_size()]  # bits only: index kernels need not know fp8
    rows = src.view(word).index_select(
        2, torch.tensor(src_ids, device=src.device)
    )  # (L, 2, n, bs, heads, dim)
    dst.view(word).index_copy_(2, torch.tensor(dst_ids, device=dst.device), rows.to(dst.device))
