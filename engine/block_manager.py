"""Paged KV block pool with ref counts and prefix caching.

Every block is in exactly one of three states:
  - in use:   ref_count > 0, listed in some sequence's block table;
  - cached:   ref_count == 0 with a hash, waiting in the free queue, reusable on a prefix hit;
  - free:     ref_count == 0 without a hash, in the free queue.
The free queue is LRU: allocation takes from its head, evicting a cached block's hash as it goes;
freed blocks join its tail (a sequence's blocks are freed tail-first, so a prompt's later blocks are
evicted before its earlier ones, which more requests share). `num_free_blocks` counts cached and free
blocks alike, so "no leaks" reads `num_free_blocks == num_blocks` once every request has ended.

Only blocks whose tokens have been computed carry a hash (`cache_computed_blocks`), so a prefix hit
never reads a block still being written. Called from the engine's one scheduling thread only.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from engine.block_hash import BlockHash, hashed_as_read
from engine.sequence import Sequence

# Called with the hashes a worker starts or stops holding (the router's KV events).
BlockEventSink = Callable[[str, list[BlockHash]], None]


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        on_event: BlockEventSink | None = None,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        # how often each block was taken from the free queue for new contents (a prefix hit keeps the
        # old ones): what another cache kept in the same block ids, a draft model's, is valid only while
        # the block's generation is the one it was written in
        self.generations = np.zeros(num_blocks, dtype=np.int64)
        self.cached: dict[BlockHash, int] = {}
        self.on_event = on_event
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found cached
        # while a step runs on the device with other writers of the pool (a KV receiver), the blocks freed
        # meanwhile wait for it (`hold_for`: the step's number) before anything can take them
        self.hold_for: int | None = None
        self._held: dict[int, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks the sequence needs to hold its first `num_tokens` tokens."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding the longest prefix of the prompt; at least one token is left to compute."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits: list[int] = []
        # the prompt's blocks are hashed only as far as they hit (in doubling runs): a prompt the cache does
        # not hold costs one hash before it runs, the rest are hashed while its step computes (`warm_hashes`)
        for block_hash in hashed_as_read(seq.hashes_upto, max_blocks):
            block_id = self.cached.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def warm_hashes(self, seq: Sequence) -> None:
        """Hash the sequence's full blocks now (the engine calls this while the GPU computes a step), so that
        caching them once computed costs no hashing after the step's tokens are back."""
        if self.enable_prefix_caching:
            seq.hashes_upto(seq.num_tokens // self.block_size)

    def allocate_prefix(self, seq: Sequence, hit_block_ids: list[int]) -> None:
        """Take the matched cached blocks into an empty block table (first admission or after preemption)."""
        assert not seq.block_table, "prefix blocks go into an empty block table"
        for block_id in hit_block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_queue[block_id]
            block.ref_count += 1
        seq.block_table = list(hit_block_ids)
        seq.num_computed_tokens = len(hit_block_ids) * self.block_size

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow the block table to hold `num_tokens` tokens; False (and nothing taken) if the pool is short."""
        need = self.blocks_needed(seq, num_tokens)
        if need > self.num_free_blocks:
            return False
        for _ in range(need):
            seq.block_table.append(self._take_free_block())
        return True

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Give a hash to every full block whose tokens are now computed, so later requests can share it."""
        if not self.enable_prefix_caching:
            return
        new_hashes: list[BlockHash] = []
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_hashes))
        for i in range(num_full):
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is not None:
                continue
            block_hash = seq.block_hashes[i]
            if block_hash in self.cached:
                continue  # another sequence computed the same block first: this copy stays private
            block.block_hash = block_hash
            self.cached[block_hash] = block.block_id
            new_hashes.append(block_hash)
        if new_hashes and self.on_event:
            self.on_event("stored", new_hashes)

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's hold on its blocks, tail first."""
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []
        seq.num_computed_tokens = 0

    def free_tail(self, seq: Sequence, num_tokens: int) -> None:
        """Keep only the blocks that hold the first `num_tokens` tokens (speculative rollback)."""
        keep = -(-num_tokens // self.block_size)
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())
        seq.num_computed_tokens = min(seq.num_computed_tokens, num_tokens)

    def record_prefix_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_query_tokens
        self.prefix_hits += num_hit_tokens

    def reset_prefix_cache(self) -> bool:
        """Forget every cached-but-unused block's hash; False if blocks are still in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        removed = list(self.cached)
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        if removed and self.on_event:
            self.on_event("removed", removed)
        return True

    def hold(self, block_ids: list[int]) -> None:
        """One more reference on each block (in use or cached), so freeing its sequence keeps it; `release`
        drops it. The prefill worker holds a finished prompt's blocks until they are sent."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_queue[block_id]
            block.ref_count += 1

    def release(self, block_ids: list[int]) -> None:
        for block_id in reversed(block_ids):
            self._release(block_id)

    def release_held(self, step: int) -> None:
        """The step is done on the device: what was freed while it ran becomes free."""
        for block_id in self._held.pop(step, []):
            self._release_now(block_id)

    def _release(self, block_id: int) -> None:
        if self.hold_for is not None:
            self._held.setdefault(self.hold_for, []).append(block_id)
            return
        self._release_now(block_id)

    def _release_now(self, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"block {block_id} freed twice"
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_queue[block_id] = None
            if block.block_hash is None:
                self.free_queue.move_to_end(block_id, last=False)  # nothing worth keeping: reuse first

    def _take_free_block(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            del self.cached[block.block_hash]
            if self.on_event:
                self.on_event("removed", [block.block_hash])
            block.block_hash = None
        block.ref_count = 1
        self.generations[block_id] += 1
        return block_id
