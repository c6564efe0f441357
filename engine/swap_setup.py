"""The swap space at start-up: its size from `swap_space` (GiB of pinned CPU memory, each block as many bytes
as on the GPU), and the costs `auto` preemption weighs, measured here: the host link's bandwidth over a
round trip of real block copies, and the prefill rate of one prompt chunk."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from engine.block_manager import BlockManager
from engine.config import CacheConfig
from engine.preemption import Preemption, SwapCosts
from engine.swap import SwapSpace, SwapStats, block_nbytes

if TYPE_CHECKING:
    from engine.model_runner import ModelRunner

logger = logging.getLogger(__name__)

LINK_PROBE_BYTES = 256 * 2**20  # the measured round trip's size (CUDA); a few blocks on the CPU
PREFILL_PROBE_TOKENS = {"cuda": 2048, "cpu": 64}


def build_preemption(
    cache: CacheConfig, mode: str, runner: ModelRunner, block_manager: BlockManager, budget: int
) -> Preemption:
    """The scheduler's preemption: with swap space, a SwapSpace beside the target's GPU pool and, in auto
    mode, the measured costs. A draft model's cache is not swapped: a request swapped back in has new
    blocks, whose draft KV the draft computes again when it next drafts (engine/model_runner.py:
    DraftModel), so the swap space holds the target's blocks only."""
    if cache.swap_space == 0 or mode == "recompute":
        return Preemption(block_manager, mode)
    pools = [runner.kv_cache]
    nbytes = block_nbytes(pools)
    num_cpu_blocks = int(cache.swap_space * 2**30) // nbytes
    if num_cpu_blocks < 1:
        raise ValueError(f"swap_space {cache.swap_space:g} GiB holds no KV block of {nbytes} bytes")
    swap = SwapSpace(pools, num_cpu_blocks, block_manager)
    link = measure_link(swap)  # on CUDA this also compiles the copy kernel before the first preemption
    costs = SwapCosts(link, measure_prefill(runner, budget), nbytes) if mode == "auto" else None
    logger.info(
        "swap space: %d blocks of %d tokens (%.2f GiB%s), preemption_mode=%s; host link %.1f GB/s%s",
        num_cpu_blocks, runner.block_size, num_cpu_blocks * nbytes / 2**30, ", pinned" if swap.cuda else "",
        mode, link / 1e9, f", prefill {costs.prefill_tokens_per_s:.0f} tokens/s" if costs else "",
    )  # fmt: skip
    return Preemption(block_manager, mode, swap, costs)


def measure_link(swap: SwapSpace) -> float:
    """Bytes per second one way, over copies of real blocks out and back in (warmed first)."""
    n = min(swap.num_blocks, swap.block_manager.num_blocks)
    n = min(n, max(1, LINK_PROBE_BYTES // swap.block_nbytes) if swap.cuda else 4)
    ids = list(range(n))
    swap.round_trip(ids, ids)  # warm: the kernel compiles, the pages are touched
    seconds = min(swap.round_trip(ids, ids) for _ in range(2))
    swap.stats = SwapStats()  # start-up copies are not swaps
    return 2 * n * swap.block_nbytes / seconds


@torch.inference_mode()
def measure_prefill(runner: ModelRunner, budget: int) -> float:
    """Tokens per second of one prompt chunk's forward pass and sampling, over the pool's first blocks
    (nothing is stored yet)."""
    from engine.sampling_params import SamplingParams
    from engine.scheduler import ScheduledSeq, SchedulerOutput

    cuda = runner.device.type == "cuda"
    n = min(budget, runner.num_blocks * runner.block_size, PREFILL_PROBE_TOKENS["cuda" if cuda else "cpu"])
    table = list(range(-(-n // runner.block_size)))
    item = ScheduledSeq("profile-prefill", [0] * n, 0, table, True, SamplingParams(temperature=0.0), None)
    plan = SchedulerOutput([item], n, [])
    if cuda:
        runner.run(plan)  # warm
        torch.cuda.synchronize(runner.device)
    t0 = time.perf_counter()
    runner.run(plan)
    if cuda:
        torch.cuda.synchronize(runner.device)
    return n / (time.perf_counter() - t0)
