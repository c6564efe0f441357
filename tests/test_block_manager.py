"""BlockManager: exact block ids, ref counts, prefix hits and LRU eviction order."""

import itertools
import random

import numpy as np
import pytest

from engine.block_hash import NONE_HASH, LazyBlockHashes, extra_keys, hash_block, hash_prompt_blocks
from engine.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

BS = 4


def seq(tokens, rid="r", salt=None):
    return Sequence(rid, list(tokens), SamplingParams(), BS, extra_keys("m", salt))


def admit(bm, s):
    hits = bm.match_prefix(s)
    bm.allocate_prefix(s, hits)
    assert bm.allocate(s, s.num_tokens)
    return hits


def compute_all(bm, s):
    s.num_computed_tokens = s.num_tokens
    bm.cache_computed_blocks(s)


def test_allocate_and_free_returns_every_block():
    bm = BlockManager(8, BS)
    a = seq(range(10))
    assert admit(bm, a) == []
    assert a.block_table == [0, 1, 2]
    assert bm.num_free_blocks == 5
    bm.free(a)
    assert bm.num_free_blocks == 8
    assert a.block_table == []


def test_allocation_fails_whole_when_short():
    bm = BlockManager(2, BS)
    a = seq(range(12))
    assert not bm.allocate(a, 12)
    assert a.block_table == [] and bm.num_free_blocks == 2


def test_prefix_hit_shares_computed_blocks_only():
    bm = BlockManager(10, BS)
    a = seq(range(10), "a")
    admit(bm, a)
    b = seq(range(10), "b")
    assert bm.match_prefix(b) == []  # a's blocks are not computed yet: nothing to share
    compute_all(bm, a)
    assert bm.match_prefix(b) == [0, 1]  # two full blocks; the partial tail is never shared
    admit(bm, b)
    assert b.block_table == [0, 1, 3] and b.num_computed_tokens == 8
    assert bm.blocks[0].ref_count == 2


def test_full_prompt_hit_leaves_one_token_to_compute():
    bm = BlockManager(10, BS)
    a = seq(range(8), "a")
    admit(bm, a)
    compute_all(bm, a)
    b = seq(range(8), "b")
    assert bm.match_prefix(b) == [0]  # block 1 would leave nothing to compute


def test_prefix_match_hashes_only_as_far_as_it_hits_and_warm_hashes_the_rest():
    """A prompt the cache does not hold is hashed one block deep before it is admitted; a partial hit is
    hashed at most twice as deep as it hits; warm_hashes (run while the step computes) hashes every full
    block, to the same chain as hashing them at once."""
    bm = BlockManager(64, BS, enable_prefix_caching=True)
    a = seq(range(40), "a")
    admit(bm, a)
    compute_all(bm, a)
    miss = seq(range(100, 140), "miss")
    assert bm.match_prefix(miss) == [] and len(miss._hashes) == 1
    partial = seq(list(range(12)) + list(range(200, 228)), "partial")  # 3 blocks hit, 10 full blocks
    assert bm.match_prefix(partial) == a.block_table[:3]
    assert 4 <= len(partial._hashes) <= 8
    bm.warm_hashes(partial)
    assert partial._hashes == hash_prompt_blocks(partial.all_token_ids, BS, extra_keys("m", None))
    whole = seq(range(40), "whole")
    assert bm.match_prefix(whole) == a.block_table[:9]  # the last full block would leave nothing to compute


def test_different_salt_never_shares():
    bm = BlockManager(10, BS)
    a = seq(range(8), "a", salt="tenant-1")
    admit(bm, a)
    compute_all(bm, a)
    assert bm.match_prefix(seq(range(9), "b", salt="tenant-2")) == []
    assert bm.match_prefix(seq(range(9), "c", salt="tenant-1")) == [0, 1]


def test_freed_cached_blocks_are_evicted_lru_tail_first():
    bm = BlockManager(6, BS)
    a = seq(range(12), "a")  # blocks 0,1,2 all full
    admit(bm, a)
    compute_all(bm, a)
    bm.free(a)  # tail first: free queue ... 2, 1, 0 at the end
    assert list(bm.free_queue) == [3, 4, 5, 2, 1, 0]
    c = seq(range(100, 120), "c")  # 5 blocks: takes 3, 4, 5, then evicts 2, then 1
    admit(bm, c)
    assert c.block_table == [3, 4, 5, 2, 1]
    assert len(bm.cached) == 1  # only block 0 (the prompt's first block) survives
    assert bm.match_prefix(seq(range(12), "d")) == [0]


def test_revived_block_leaves_free_queue():
    bm = BlockManager(4, BS)
    a = seq(range(8), "a")
    admit(bm, a)
    compute_all(bm, a)
    bm.free(a)
    b = seq(range(9), "b")
    admit(bm, b)
    assert b.block_table[:2] == [0, 1]
    assert 0 not in bm.free_queue and 1 not in bm.free_queue
    bm.free(b)
    assert bm.num_free_blocks == 4


def test_free_tail_keeps_prefix():
    bm = BlockManager(8, BS)
    a = seq(range(14), "a")
    admit(bm, a)
    bm.free_tail(a, 5)
    assert a.block_table == [0, 1] and bm.num_free_blocks == 6


def test_events_report_stored_and_removed_hashes():
    events = []
    bm = BlockManager(2, BS, on_event=lambda kind, hashes: events.append((kind, hashes)))
    a = seq(range(8), "a")
    admit(bm, a)
    compute_all(bm, a)
    chain = hash_prompt_blocks(list(range(8)), BS, extra_keys("m"))
    assert events == [("stored", chain)]
    bm.free(a)
    b = seq(range(50, 54), "b")
    admit(bm, b)  # evicts the tail block first
    assert events[-1] == ("removed", [chain[1]])


def test_double_free_is_caught():
    bm = BlockManager(4, BS)
    a = seq(range(4), "a")
    admit(bm, a)
    block = a.block_table[0]
    bm.free(a)
    with pytest.raises(AssertionError):
        bm._release(block)


@pytest.mark.parametrize("length", [0, 15, 16, 17, 100, 4099])
@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_hash_prompt_blocks_equals_the_chain_of_hash_block(length, salt):
    """The fast chain (one packed token buffer, copied hasher) must give hash_block's hashes exactly:
    the router and the workers' prefix caches compare them."""
    rng = random.Random(length)
    ids = [rng.randrange(2**32) for _ in range(length)]
    extra = extra_keys("m", salt)
    parent = hash_block(NONE_HASH, [1] * BS, extra)
    want, p = [], parent
    for start in range(0, length - BS + 1, BS):
        p = hash_block(p, ids[start : start + BS], extra)
        want.append(p)
    assert hash_prompt_blocks(ids, BS, extra, parent) == want
    with pytest.raises((OverflowError, ValueError)):
        hash_prompt_blocks([-1] * BS, BS, extra)


@pytest.mark.parametrize("length", [0, 15, 16, 100, 4099])
def test_lazy_block_hashes_equal_the_chain_and_hash_only_what_is_read(length):
    ids = np.array([random.Random(length).randrange(50_000) for _ in range(length)], dtype=np.int64)
    extra = extra_keys("m", "tenant-a")
    want = hash_prompt_blocks(ids, BS, extra)
    lazy = LazyBlockHashes(ids, BS, extra)
    assert len(lazy) == len(want)
    assert lazy._hashes == []  # nothing hashed until read
    if want:
        assert lazy[0] == want[0] and len(lazy._hashes) == 1
        assert lazy[-1] == want[-1]
    assert list(lazy) == want and lazy[1:] == want[1:]
    with pytest.raises(IndexError):
        lazy[len(want)]
    fresh = LazyBlockHashes(ids, BS, extra)
    read = list(itertools.islice(fresh, 5))  # iteration hashes in doubling chunks: 1, 2, 4, ...
    assert read == want[:5] and len(fresh._hashes) == min(len(want), 7)
