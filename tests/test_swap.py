"""The swap space without a model: exact block ids, ref counts, hashes and bytes through swap-out and swap-in
(a shared prefix copied once each way), how preemption picks swap or recompute, and a scheduler thrashing a
tiny pool whose every step checks that each request's cached KV is still its own tokens'."""

from __future__ import annotations

import pytest
import torch

from engine import swap as swap_module
from engine.block_hash import extra_keys
from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.preemption import Preemption, SwapCosts
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from engine.swap import SwapSpace, copy_blocks

BS = 4


def seq(tokens, rid, max_tokens=4):
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=max_tokens), BS, extra_keys("m"))


def admit(bm, s):
    hits = bm.match_prefix(s)
    bm.allocate_prefix(s, hits)
    assert bm.allocate(s, s.num_tokens)
    s.num_computed_tokens = s.num_tokens
    bm.cache_computed_blocks(s)
    return hits


def pool(num_blocks, dtype=torch.float32):
    # (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim), random bytes per block
    return torch.randn(2, 2, num_blocks, BS, 1, 3).to(dtype)


def bits(t):
    return t.view({1: torch.uint8, 4: torch.int32}[t.element_size()])


def evict_all(bm, gpu):
    """Another request takes every free block (evicting cached ones) and overwrites them, then ends."""
    filler = seq(range(500, 500 + BS * bm.num_free_blocks), "filler")
    assert bm.allocate(filler, filler.num_tokens)
    bits(gpu)[:, :, filler.block_table] = 0
    bm.free(filler)


def restore(bm, swap, s):
    """What the scheduler does when it admits a swapped-out request: prefix hits first, then the swap-in."""
    hits = bm.match_prefix(s)
    bm.allocate_prefix(s, hits)
    swap.swap_in(s)
    swap.flush()
    return hits


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])  # fp8 blocks move as bytes too
def test_round_trip_keeps_bytes_hashes_and_ref_counts(dtype):
    gpu = pool(8, dtype)
    bm = BlockManager(8, BS)
    swap = SwapSpace([gpu], 6, bm)
    a = seq(range(10), "a")
    admit(bm, a)
    assert a.block_table == [0, 1, 2]
    hashes, kv = list(a.block_hashes), gpu[:, :, [0, 1, 2]].clone()
    swap.swap_out(a)
    swap.flush()
    assert a.block_table == [] and swap.holds(a) and swap.cpu.num_free == 3
    assert swap.cpu_pools[0].dtype == dtype and torch.equal(
        bits(swap.cpu_pools[0][:, :, [0, 1, 2]]), bits(kv)
    )
    assert bm.num_free_blocks == 8 and bm.cached == {hashes[0]: 0, hashes[1]: 1}  # still a prefix cache
    # free queue now [2, 3, 4, 5, 6, 7, 1, 0]: the unhashed tail first, the cached blocks last
    evict_all(bm, gpu)  # takes them in that order and frees them tail first: the same order again
    assert bm.cached == {}
    assert restore(bm, swap, a) == []
    assert a.block_table == [2, 3, 4] and a.num_computed_tokens == 10
    assert torch.equal(bits(gpu[:, :, [2, 3, 4]]), bits(kv))
    assert bm.cached == {hashes[0]: 2, hashes[1]: 3}  # the restored full blocks carry their hashes again
    assert [bm.blocks[b].ref_count for b in a.block_table] == [1, 1, 1]
    assert not swap.holds(a) and swap.cpu.num_free == 6 and swap.cpu.by_hash == {}
    assert (swap.stats.out_blocks, swap.stats.in_blocks) == (3, 3)
    assert swap.stats.out_bytes == 3 * swap.block_nbytes == 3 * 2 * 2 * BS * 3 * dtype.itemsize


def test_blocks_still_cached_on_the_gpu_come_back_under_their_own_ids():
    gpu = pool(8)
    bm = BlockManager(8, BS)
    swap = SwapSpace([gpu], 6, bm)
    a = seq(range(10), "a")
    admit(bm, a)
    tail = gpu[:, :, 2].clone()
    swap.swap_out(a)
    swap.flush()
    gpu[:, :, 2] = 0.0  # the freed tail block is rewritten by someone else
    assert restore(bm, swap, a) == [0, 1]
    assert a.block_table == [0, 1, 2] and a.num_computed_tokens == 10
    assert torch.equal(gpu[:, :, 2], tail)
    assert swap.stats.in_blocks == 1  # only the tail was copied back


def test_a_shared_prefix_is_copied_once_each_way(monkeypatch):
    gpu = pool(8)
    bm = BlockManager(8, BS)
    swap = SwapSpace([gpu], 6, bm)
    a, b = seq(range(10), "a"), seq([*range(8), 50, 51, 52], "b")
    admit(bm, a)
    assert admit(bm, b) == [0, 1] and b.block_table == [0, 1, 3]
    kv_a, kv_b = gpu[:, :, [0, 1, 2]].clone(), gpu[:, :, [0, 1, 3]].clone()
    passes = []
    monkeypatch.setattr(swap_module, "copy_blocks", lambda *a: passes.append(a[1]) or copy_blocks(*a))
    swap.swap_out(a)
    assert [bm.blocks[i].ref_count for i in (0, 1)] == [1, 1]
    swap.swap_out(b)
    swap.flush()
    assert passes == [[0, 1, 2, 3]]  # a's three blocks and b's own one, in one pass
    assert swap.stats.out_blocks == 4  # b's prefix blocks were on the CPU already
    assert swap.cpu.ref[:4] == [2, 2, 1, 1] and bm.num_free_blocks == 8
    evict_all(bm, gpu)
    restore(bm, swap, a)
    assert restore(bm, swap, b) == a.block_table[:2]  # b's prefix: a's restored blocks, shared again
    assert swap.stats.in_blocks == 4
    assert torch.equal(gpu[:, :, a.block_table], kv_a) and torch.equal(gpu[:, :, b.block_table], kv_b)
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    assert bm.blocks[b.block_table[2]].ref_count == 1
    assert swap.cpu.num_free == 6 and swap.cpu.ref == [0] * 6


def test_a_request_that_ends_swapped_out_frees_its_cpu_blocks():
    bm = BlockManager(8, BS)
    swap = SwapSpace([pool(8)], 6, bm)
    a = seq(range(10), "a")
    admit(bm, a)
    swap.swap_out(a)
    swap.forget(a)
    assert swap.cpu.num_free == 6 and not swap.holds(a) and bm.num_free_blocks == 8


def test_the_mode_each_victim_takes():
    bm = BlockManager(8, BS)
    swap = SwapSpace([pool(8)], 2, bm)
    small, big, fresh = seq(range(6), "small"), seq(range(100, 110), "big"), seq(range(200, 203), "fresh")
    admit(bm, small)
    admit(bm, big)
    assert bm.allocate(fresh, 3)  # admitted, nothing computed yet: nothing to swap
    assert Preemption(bm, "recompute", swap).choose(small) == "recompute"
    assert Preemption(bm, "swap", swap).choose(small) == "swap"
    assert Preemption(bm, "swap", swap).choose(big) == "recompute"  # 3 blocks, the CPU pool holds 2
    assert Preemption(bm, "swap", swap).choose(fresh) == "recompute"
    cheap_link = SwapCosts(link_bytes_per_s=1e12, prefill_tokens_per_s=1e3, bytes_per_block=swap.block_nbytes)
    slow_link = SwapCosts(link_bytes_per_s=1e3, prefill_tokens_per_s=1e9, bytes_per_block=swap.block_nbytes)
    assert Preemption(bm, "auto", swap, cheap_link).choose(small) == "swap"
    assert Preemption(bm, "auto", swap, slow_link).choose(small) == "recompute"
    assert Preemption(bm, "auto", None).choose(small) == "recompute"  # no swap space
    p = Preemption(bm, "swap", swap)
    assert p.preempt(small) == "swap" and p.preempt(big) == "recompute"
    assert p.counts == {"swap": 1, "recompute": 1} and bm.num_free_blocks == 7  # fresh holds 1
    with pytest.raises(ValueError, match="preemption_mode"):
        Preemption(bm, "sometimes")


# ---- a scheduler over a fake model whose KV is the token ids -------------------------------------------


def token_at(rid: str, pos: int) -> int:
    return (sum(map(ord, rid)) * 31 + pos * 7) % 997 + 1


class KVChecker:
    """Runs steps as a model would, with K = V = the token id at each position: before writing a step's
    tokens it checks that every earlier position of each scheduled request reads back its own token."""

    def __init__(self, num_blocks: int, num_cpu_blocks: int, mode: str, prefix_caching: bool) -> None:
        self.gpu = torch.zeros(1, 2, num_blocks, BS, 1, 1)
        self.bm = BlockManager(num_blocks, BS, prefix_caching)
        self.swap = SwapSpace([self.gpu], num_cpu_blocks, self.bm)
        cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=64)
        # auto: copying a block out and back costs 1 s, recomputing a token 1/3.5 s: by victim, either
        costs = SwapCosts(64.0, 3.5, self.swap.block_nbytes) if mode == "auto" else None
        self.sched = Scheduler(cfg, self.bm, {-1}, preemption=Preemption(self.bm, mode, self.swap, costs))
        self.checked = 0

    def step(self) -> None:
        out = self.sched.schedule()
        sampled = {}
        for item in out.scheduled:
            s = self.sched.seqs[item.request_id]
            for pos in range(item.start_pos):  # the cached context
                b, off = item.block_table[pos // BS], pos % BS
                assert self.gpu[0, :, b, off].flatten().tolist() == [s.all_token_ids[pos]] * 2, (
                    item.request_id
                )
                self.checked += 1
            for j, tok in enumerate(item.token_ids):  # this step's K/V
                pos = item.start_pos + j
                self.gpu[0, :, item.block_table[pos // BS], pos % BS] = float(tok)
            if item.sample:
                sampled[item.request_id] = [token_at(item.request_id, item.seq_len)]
        self.sched.postprocess(out, sampled)


@pytest.mark.parametrize("mode,num_cpu_blocks", [("swap", 64), ("swap", 3), ("auto", 64)])
@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix_caching", "no_prefix_caching"])
def test_thrashing_scheduler_keeps_every_request_kv(mode, num_cpu_blocks, prefix_caching):
    run = KVChecker(12, num_cpu_blocks, mode, prefix_caching)
    shared = list(range(300, 309))  # a 9-token prefix the first four prompts share
    reqs = [seq([*shared, i], f"r{i}", max_tokens=20) for i in range(4)]
    reqs += [seq(range(40 * i, 40 * i + 5 + i), f"s{i}", max_tokens=20) for i in range(1, 4)]
    for s in reqs:
        run.sched.add(s)
    for _ in range(500):
        if not run.sched.has_unfinished():
            break
        run.step()
    assert not run.sched.has_unfinished()
    for s in reqs:
        assert s.output_token_ids == [token_at(s.request_id, s.num_prompt_tokens + k) for k in range(20)]
    counts = run.sched.preemption.counts
    if num_cpu_blocks == 3 or mode == "auto":  # victims the CPU pool cannot hold, or cheaper to recompute
        assert counts["swap"] > 0 and counts["recompute"] > 0
    else:
        assert counts["swap"] >= 10 and counts["recompute"] == 0
    assert run.bm.num_free_blocks == run.bm.num_blocks and run.swap.cpu.num_free == num_cpu_blocks
    assert run.swap.num_swapped == 0 and run.swap.cpu.by_hash == {}
