"""CUDA graphs of decode-only steps: one graph per batch bucket, replayed with the batch padded to it.

An eager decode step launches every small op of the model from the host, one at a time; a graph replay
launches them all at once. What the graphs hold and how a step uses them:

- Buckets (`capture_sizes`): 1, 2, 4, then every multiple of 8 (vLLM's sizes) below
  min(max_num_seqs, 512), then that cap itself. A decode-only step of n rows replays the smallest bucket
  >= n; a speculative verification step replays them too, a row per verified position
  (engine/model_runner.py: _replay). Steps with prompt chunks and larger batches run eagerly.
- Static inputs (`StaticInputs`): one device buffer that every graph reads: token ids, positions, slot
  mapping, seq lens, query start offsets and block tables of ceil(max_model_len / block_size) columns.
  A step fills its pinned host twin and uploads the bucket's part in one copy, then replays, so no graph
  ever sees another step's inputs.
- Padded rows: token 0 at position 0, slot -1 (the KV write skips it: no block is touched) and seq_len 0
  (the decode kernel reads no page and writes zeros). Table columns past a sequence's own blocks keep
  whatever an earlier step left there: the kernels never read them.
- Attention: the attention backend gives each bucket one plan per context class (engine/attention.py:
  decode_graph_plans): small buckets have one graph for short contexts (split into one-tile partitions)
  and one for the rest (a split count planned for max_model_len); big buckets one, unsplit. One split
  workspace serves every graph and layer. A step replays the graph of the first class that holds its
  longest context.
- Capture: largest bucket first, into one memory pool, so the smaller graphs reuse its blocks.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import torch

from engine.attention import DecodeGraphPlan
from engine.attention_metadata import AttentionMetadata
from engine.scheduler import ScheduledSeq

logger = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 512

Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]
Replay = Callable[[], object]


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The batch buckets that get a graph, ascending."""
    cap = min(max_num_seqs, MAX_CAPTURE_SIZE)
    base = [1, 2, 4, *range(8, MAX_CAPTURE_SIZE + 1, 8)]
    return [s for s in base if s < cap] + [cap]


def bucket_for(num_seqs: int, sizes: Sequence[int]) -> int | None:
    """The smallest bucket that holds `num_seqs` rows; None when the largest is too small."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


class StaticInputs:
    """The inputs every graph reads, in one int32 buffer on the device and its twin on the host.

    A bucket of b rows and W block-table columns lays out, in int32 elements from 0:
        ids (b int64) | positions (b int64) | slots (b int64) | seq_lens (b) | query_start_loc (b + 1) | tables (b x W)
    Every bucket starts at 0, so a step uploads one prefix of the buffer."""

    def __init__(self, max_batch: int, width: int, block_size: int, device: torch.device) -> None:
        self.width, self.block_size = width, block_size
        numel = self.numel(max_batch)
        self.device_buf = torch.zeros(numel, dtype=torch.int32, device=device)
        self.host_buf = torch.zeros(numel, dtype=torch.int32, pin_memory=device.type == "cuda")
        self.host = self.host_buf.numpy()
        self._arange = np.arange(max_batch + 1, dtype=np.int32)
        self._uploaded = torch.cuda.Event() if device.type == "cuda" else None
        self._host_views: dict[int, tuple[np.ndarray, ...]] = {}
        self._copy_views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def numel(self, b: int) -> int:
        return 8 * b + 1 + b * self.width

    def device_views(self, b: int) -> tuple[torch.Tensor, ...]:
        """(ids, positions, slots, seq_lens, query_start_loc, block_tables) of bucket b on the device."""
        buf = self.device_buf
        i64 = [buf[k * 2 * b : (k + 1) * 2 * b].view(torch.int64) for k in range(3)]
        tables = buf[8 * b + 1 : self.numel(b)].view(b, self.width)
        return (*i64, buf[6 * b : 7 * b], buf[7 * b : 8 * b + 1], tables)

    def _views(self, b: int) -> tuple[np.ndarray, ...]:
        """(ids, positions, slots, seq_lens, query_start_loc, block_tables) of bucket b on the host."""
        if b not in self._host_views:
            h = self.host
            i64 = [h[k * 2 * b : (k + 1) * 2 * b].view(np.int64) for k in range(3)]
            tables = h[8 * b + 1 : self.numel(b)].reshape(b, self.width)
            self._host_views[b] = (*i64, h[6 * b : 7 * b], h[7 * b : 8 * b + 1], tables)
        return self._host_views[b]

    def fill(self, items: Sequence[ScheduledSeq], b: int) -> bool:
        """Write a decode batch (every item one token), padded to b rows, into the host buffer. False (and
        nothing to upload) when a block table is wider than the graphs' tables."""
        if any(len(it.block_table) > self.width for it in items):
            return False
        self._wait_for_last_upload()
        n, bs = len(items), self.block_size
        ids, pos, slots, seq_lens, starts, tables = self._views(b)
        ids[:n] = [it.token_ids[0] for it in items]
        pos[:n] = [it.start_pos for it in items]
        slots[:n] = [it.block_table[it.start_pos // bs] * bs + it.start_pos % bs for it in items]
        np.add(pos[:n], 1, out=seq_lens[:n], casting="unsafe")
        for i, it in enumerate(items):
            tables[i, : len(it.block_table)] = it.block_table
        ids[n:], pos[n:], slots[n:], seq_lens[n:] = 0, 0, -1, 0
        starts[:] = self._arange[: b + 1]
        return True

    def upload(self, b: int) -> None:
        """Queue the copy of bucket b's inputs to the device (pinned: the host does not wait)."""
        if b not in self._copy_views:
            k = self.numel(b)
            self._copy_views[b] = (self.device_buf[:k], self.host_buf[:k])
        dst, src = self._copy_views[b]
        dst.copy_(src, non_blocking=True)
        if self._uploaded is not None:
            self._uploaded.record()

    def _wait_for_last_upload(self) -> None:
        # the host buffer is rewritten only once the device has read it; a step that sampled already
        # waited for its results, so this wait is for steps that sampled nothing
        if self._uploaded is not None and not self._uploaded.query():
            self._uploaded.synchronize()


class Capturer(Protocol):
    def warmup(self, fn: Callable[[], torch.Tensor]) -> None: ...

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Replay, torch.Tensor]: ...


class CudaGraphCapturer:
    """Captures into one memory pool shared by every graph it makes."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def warmup(self, fn: Callable[[], torch.Tensor]) -> None:
        # on a side stream, as torch asks: lazy initialisations stay out of the capture
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream(self.device).wait_stream(stream)

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Replay, torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        return graph.replay, out


class EagerCapturer:
    """Stands in for CUDA graphs where there are none (the CPU tests): a "replay" runs the function again
    over the same static buffers and copies its result into the captured output, so the static inputs,
    the padding and the bucket choice are exercised exactly as a graph sees them."""

    def warmup(self, fn: Callable[[], torch.Tensor]) -> None:
        fn()

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Replay, torch.Tensor]:
        out = fn()
        return (lambda: out.copy_(fn())), out


GraphKey = tuple[int, int]  # (bucket, index of its plan)


class DecodeGraphs:
    """The decode graphs of one model over one KV cache (`forward` closes over both)."""

    def __init__(
        self,
        forward: Forward,
        sizes: Sequence[int],
        *,
        block_size: int,
        max_model_len: int,
        plans: Callable[[int], list[DecodeGraphPlan]],
        device: torch.device,
        capturer: Capturer,
    ) -> None:
        self.forward, self.sizes = forward, sorted(sizes)
        self.capturer = capturer
        width = -(-max_model_len // block_size)
        self.inputs = StaticInputs(self.sizes[-1], width, block_size, device)
        self.plans = {b: plans(b) for b in self.sizes}
        numel = max(p.workspace_numel for ps in self.plans.values() for p in ps)
        # the split partials of every graph and layer (each call writes what its merge reads)
        self.workspace = torch.zeros(numel, dtype=torch.float32, device=device) if numel else None
        self._graphs: dict[GraphKey, tuple[Replay, torch.Tensor]] = {}
        self.replay_counts: dict[GraphKey, int] = dict.fromkeys(self.keys, 0)

    @property
    def keys(self) -> list[GraphKey]:
        """Every graph this set can hold, largest bucket first (the capture order)."""
        return [(b, i) for b in reversed(self.sizes) for i in range(len(self.plans[b]))]

    def capture(self, keys: Sequence[GraphKey] | None = None) -> None:
        """Capture the given graphs (default: all), in the order given."""
        for key in self.keys if keys is None else keys:
            self._graphs[key] = self.capture_one(key)

    def capture_one(self, key: GraphKey) -> tuple[Replay, torch.Tensor]:
        """Capture one graph and return it (replay, output) without keeping it."""
        b, forward = key[0], self.forward
        self.inputs.fill([], b)
        self.inputs.upload(b)
        ids, positions, meta = self._arguments(key)

        def fn() -> torch.Tensor:
            return forward(ids, positions, meta)

        self.capturer.warmup(fn)
        return self.capturer.capture(fn)

    @property
    def captured(self) -> list[int]:
        """The buckets that have a graph."""
        return sorted({b for b, _ in self._graphs})

    def _arguments(self, key: GraphKey) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        b, i = key
        ids, positions, slots, seq_lens, starts, tables = self.inputs.device_views(b)
        plan = self.plans[b][i]
        meta = AttentionMetadata(
            slot_mapping=slots,
            query_start_loc=starts,
            seq_lens=seq_lens,
            block_tables=tables,
            max_query_len=1,
            max_seq_len=plan.max_seq_len,
            decode_num_splits=plan.num_splits,
            decode_workspace=self.workspace if plan.num_splits > 1 else None,
        )
        return ids, positions, meta

    def _key(self, items: Sequence[ScheduledSeq]) -> GraphKey | None:
        b = bucket_for(len(items), self.captured)
        if b is None:
            return None
        longest = max(it.start_pos for it in items) + 1
        i = next((i for i, p in enumerate(self.plans[b]) if longest <= p.max_seq_len), None)
        return None if i is None or (b, i) not in self._graphs else (b, i)

    def replay(
        self, items: Sequence[ScheduledSeq], patch: Callable[[torch.Tensor], None] | None = None
    ) -> torch.Tensor | None:
        """The forward pass of a decode batch (every item one token) from its graph: (len(items), hidden),
        a view of the graph's output, valid until the next replay. None: no graph for it, run it eagerly.
        `patch(ids)` may rewrite the uploaded token ids on the device before the replay reads them."""
        key = self._key(items)
        if key is None or not self.inputs.fill(items, key[0]):
            return None
        self.inputs.upload(key[0])
        if patch is not None:
            patch(self.inputs.device_views(key[0])[0])
        replay, out = self._graphs[key]
        replay()
        self.replay_counts[key] += 1
        return out[: len(items)]

    @property
    def num_replays(self) -> int:
        return sum(self.replay_counts.values())
