"""Runs one scheduled step on the model: build the flat batch, forward, sample.

Owns the model and the worker's single KV-cache allocation; never touches scheduler state. On CUDA,
decode-only steps replay a captured graph of the forward pass (engine/cuda_graph.py) unless
`enforce_eager`; everything else runs eagerly.
"""

from __future__ import annotations

import itertools
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from engine.attention import DecodeGraphPlan, decode_graph_plans, graph_capturable
from engine.attention_metadata import AttentionMetadata
from engine.config import CacheConfig
from engine.cuda_graph import CudaGraphCapturer, DecodeGraphs, Forward, capture_sizes
from engine.kv_scales import kv_cache_dtype
from engine.model import LlamaForCausalLM
from engine.model_config import ModelConfig
from engine.pooling import PoolerConfig, pool
from engine.sampler import PendingSample, Sampler, SamplerOutput
from engine.sampling_ops import logprob_tensors
from engine.scheduler import ScheduledSeq, SchedulerOutput
from engine.spec_decode import accepted_length
from engine.uploads import upload
from kernels.kv_quant import FP8_DTYPE
from kernels.sampling_noise import greedy_argmax

logger = logging.getLogger(__name__)

GRAPH_MEMORY_MARGIN = 64 * 2**20  # bytes reserved on top of the measured graph memory
# the most driver memory counted per graph: measured ~20-30 MiB on the H200 (Llama-3-8B, SmolLM2, ~300-400
# kernels a graph); a reading above it is another process's allocation landing in the window
GRAPH_DRIVER_CAP = 64 * 2**20
PROMPT_ROWS = 256  # rows of prompt logits a block when computing prompt logprobs: (256, vocab) fp32 at a time


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        max_num_batched_tokens: int,
        device: torch.device,
        dtype: torch.dtype,
        seed: int = 0,
        *,
        max_num_seqs: int = 256,
        max_model_len: int | None = None,
        enforce_eager: bool = False,
        extra_bytes_per_block: int = 0,  # what else each block costs (a draft model's KV)
    ) -> None:
        self.extra_bytes_per_block = extra_bytes_per_block
        self.max_num_batched_tokens = max_num_batched_tokens
        self.model = model
        self.model_config = model_config
        self.device = device
        self.dtype = dtype
        self.block_size = cache_config.block_size
        self.kv_shape_tail = (
            cache_config.block_size,
            model_config.num_key_value_heads,
            model_config.head_dim,
        )
        self.num_layers = model_config.num_hidden_layers
        self.max_model_len = max_model_len or model_config.max_position_embeddings
        self.sampler = Sampler(seed)
        self.pooler = PoolerConfig()  # how embeddings pool (the engine sets the model's: engine/pooling.py)
        self.draft_layers: int | None = None  # self_draft speculation: the target's first layers draft
        self.draft: DraftModel | None = None  # draft_model speculation (set by attach_draft)
        use_graphs = not enforce_eager and graph_capturable(device)
        if not enforce_eager and device.type == "cuda" and not use_graphs:
            logger.info("CUDA graphs off: the attention backend is forced to the torch reference")
        self.graph_sizes = capture_sizes(max_num_seqs) if use_graphs else []
        self.kv_dtype = kv_cache_dtype(cache_config.kv_cache_dtype, dtype)  # fp8: engine/kv_scales.py
        num_blocks = self._num_kv_blocks(cache_config, max_num_batched_tokens)
        # (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim): the worker's one KV allocation
        self.kv_cache = torch.zeros(
            self.num_layers, 2, num_blocks, *self.kv_shape_tail, dtype=self.kv_dtype, device=device
        )
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        more = dtype.itemsize // self.kv_dtype.itemsize
        logger.info(
            "KV cache: %d blocks of %d tokens, %d tokens (%.2f GiB, %s%s); weights %.2f GiB (%.2f GB)",
            num_blocks, self.block_size, num_blocks * self.block_size,
            self.kv_cache.numel() * self.kv_cache.element_size() / 2**30, str(self.kv_dtype).removeprefix("torch."),
            f": {more}x the tokens {str(dtype).removeprefix('torch.')} would hold" if more > 1 else "",
            weights / 2**30, weights / 1e9,
        )  # fmt: skip
        self.graphs: DecodeGraphs | None = None
        if self.graph_sizes:
            self.capture_graphs()

    @property
    def num_blocks(self) -> int:
        return self.kv_cache.shape[2]

    def attach_draft(self, model: LlamaForCausalLM, config: ModelConfig, max_model_len: int) -> None:
        """Speculate with a draft model: it gets a KV cache of its own, of the target's block count."""
        self.draft = DraftModel(
            model, config, self.num_blocks, self.block_size, max_model_len, self.model_config.vocab_size,
            self.dtype, self.device, self.max_num_batched_tokens,
        )  # fmt: skip

    def bytes_per_block(self) -> int:
        return kv_bytes_per_block(self.model_config, self.block_size, self.kv_dtype)

    def _num_kv_blocks(self, cache_config: CacheConfig, max_num_batched_tokens: int) -> int:
        if cache_config.num_gpu_blocks_override is not None:
            return cache_config.num_gpu_blocks_override
        per_block = self.bytes_per_block() + self.extra_bytes_per_block
        if self.device.type != "cuda":
            return int(cache_config.cpu_kv_cache_space * 2**30) // per_block
        peak = self._profile_peak_memory(max_num_batched_tokens)
        graphs = self._profile_graph_memory() if self.graph_sizes else 0
        free, total = torch.cuda.mem_get_info(self.device)
        budget = min(total * cache_config.gpu_memory_utilization - peak, free - 256 * 2**20) - graphs
        return max(int(budget) // per_block, 0)

    # ---- CUDA graphs ---------------------------------------------------------------------------------

    def graph_forward(self, kv_cache: torch.Tensor) -> Forward:
        """What a decode graph captures: the forward pass and the LM head, so a replayed step launches
        nothing more before sampling. (rows,) ids and positions -> (rows, vocab) fp32 logits."""
        model = self.model  # closes over the model, not the runner: no cycle keeps a dropped engine alive

        def forward(ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
            return model.compute_logits(model(ids, positions, meta, kv_cache))

        return forward

    def _decode_graphs(self, kv_cache: torch.Tensor) -> DecodeGraphs:
        cfg = self.model_config
        forward = self.graph_forward(kv_cache)

        def plans(num_seqs: int) -> list[DecodeGraphPlan]:
            return decode_graph_plans(
                num_seqs, self.max_model_len, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                self.device, fp8=self.kv_dtype == FP8_DTYPE,
            )  # fmt: skip

        return DecodeGraphs(
            forward,
            self.graph_sizes,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            plans=plans,
            device=self.device,
            capturer=CudaGraphCapturer(self.device),
        )

    @torch.inference_mode()
    def _profile_graph_memory(self) -> int:
        """Bytes the decode graphs will hold, measured over a one-block scratch cache before the KV cache
        takes the rest, in two parts. Their memory pool, read from this process's allocator (exact whatever
        else runs on the GPU): the largest graph's, which the smaller ones reuse, plus for each other graph
        what the smallest one added. The driver's memory for each graph (about the same for all: the same
        kernels), read from the device's free memory around three captures: the median, so another process
        allocating or freeing meanwhile moves at most one of the three, and at most GRAPH_DRIVER_CAP."""
        scratch = torch.zeros(
            self.num_layers, 2, 1, *self.kv_shape_tail, dtype=self.kv_dtype, device=self.device
        )
        probe = self._decode_graphs(scratch)
        keys = probe.keys
        kept, pools, drivers = [], [], []
        for key in (keys[0], keys[-1], keys[-1]):
            free0, reserved0 = self._memory_now()
            kept.append(probe.capture_one(key))
            free1, reserved1 = self._memory_now()
            pools.append(reserved1 - reserved0)
            drivers.append(max(free0 - free1 - pools[-1], 0))
        n = len(keys)
        driver = min(statistics.median(drivers), GRAPH_DRIVER_CAP)
        reserve = pools[0] + max(pools[1:]) * (n - 1) + driver * n + GRAPH_MEMORY_MARGIN
        del kept, probe, scratch
        torch.cuda.empty_cache()
        logger.info(
            "CUDA graphs: reserving %.2f GiB for %d graphs (pool %.0f MiB, driver %.1f MiB a graph)",
            reserve / 2**30, n, pools[0] / 2**20, driver / 2**20,
        )  # fmt: skip
        return int(reserve)

    def _memory_now(self) -> tuple[int, int]:
        """(free device bytes, bytes this process's allocator holds), with its unused cache given back."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(self.device)[0], torch.cuda.memory_reserved(self.device)

    @torch.inference_mode()
    def capture_graphs(self) -> DecodeGraphs:
        """Capture the decode graphs over the KV cache; again, the old ones go first (their memory reused)."""
        self.graphs = None
        t0 = time.perf_counter()
        free0, _ = self._memory_now()
        graphs = self._decode_graphs(self.kv_cache)
        graphs.capture()
        used = free0 - self._memory_now()[0]
        logger.info(
            "captured %d CUDA graphs (decode batches %d..%d) in %.2f s, %.2f GiB",
            len(graphs.keys),
            self.graph_sizes[0],
            self.graph_sizes[-1],
            time.perf_counter() - t0,
            used / 2**30,
        )
        self.graphs = graphs
        return graphs

    @torch.inference_mode()
    def _profile_peak_memory(self, num_tokens: int) -> int:
        """Peak bytes this process needs for weights plus one full-budget forward pass."""
        torch.cuda.reset_peak_memory_stats(self.device)
        num_blocks = -(-num_tokens // self.block_size)
        scratch = torch.zeros(
            self.num_layers, 2, num_blocks, *self.kv_shape_tail, dtype=self.kv_dtype, device=self.device
        )
        meta = AttentionMetadata.build(
            [num_tokens], [num_tokens], [list(range(num_blocks))], self.block_size, self.device
        )
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        hidden = self.model(ids, torch.arange(num_tokens, device=self.device), meta, scratch)
        self.model.compute_logits(hidden[-1:])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - scratch.numel() * scratch.element_size()
        del scratch, hidden
        torch.cuda.empty_cache()
        return peak

    @torch.inference_mode()
    def run(self, out: SchedulerOutput, during: Callable[[], None] | None = None) -> Sampled:
        """Run the step; return {request_id: (new tokens, their logprobs or None each)} for requests that
        sample: one token, or a verified draft's accepted tokens and the target's token after them.
        `during()` runs while the GPU computes: once the forward pass and the sampling (with the copies of
        its results to the host) are queued, before the host waits for them. Work it queues on the current
        stream runs after the step's and does not delay its tokens."""
        return self.run_launched(out, during)[0]

    @torch.inference_mode()
    def run_launched(
        self, out: SchedulerOutput, during: Callable[[], None] | None = None
    ) -> tuple[Sampled, LaunchedStep]:
        """`run`, with the launched step, whose prompt logprobs (LaunchedStep.prompt_logprobs) are read then."""
        step = self.launch(out)
        if during is not None:
            with torch.inference_mode(False):  # its tensors (e.g. a new KV sender's) stay ordinary ones
                during()
        return self.collect(step), step

    @torch.inference_mode()
    def launch(
        self, out: SchedulerOutput, inputs_from: Sequence[int] | None = None, prev: LaunchedStep | None = None
    ) -> LaunchedStep:
        """Queue the step's forward pass, sampling and the copy of its results to the host; wait for nothing.

        `inputs_from[i] >= 0`: item i's last token is not known on the host yet (its token_ids hold a
        placeholder there); it is row inputs_from[i] of `prev`'s sampled tokens, read on the device."""
        items = out.scheduled
        sampling = [i for i, it in enumerate(items) if it.sample]
        patch = None
        if inputs_from is not None and any(src >= 0 for src in inputs_from):
            assert prev is not None and prev.sample is not None
            pending = [i for i, src in enumerate(inputs_from) if src >= 0]
            patch = _Patch(pending, [inputs_from[i] for i in pending], prev.sample.tokens)
        patches = [patch] if patch is not None else []
        model_drafts: list[tuple[int, int, int]] = []  # (sampling index, row of `drafted`, draft length)
        drafted_host = None
        draft_kv: DraftKV | None = None
        if (self.draft_layers is not None or self.draft is not None) and any(it.num_draft for it in items):
            drafting = [i for i in sampling if items[i].num_draft]
            if self.draft is not None:  # its KV first: every position before the drafts' first
                self.draft.catch_up([items[i] for i in drafting])
                index = {i: n for n, i in enumerate(sampling)}
                draft_kv = DraftKV(
                    self.draft, {index[i]: (items[i].block_table, items[i].start_pos) for i in drafting}
                )
            drafted = self._draft_passes(items, drafting)
            ends = list(itertools.accumulate(len(it.token_ids) for it in items))
            k_max = drafted.shape[1]
            dst = [ends[i] - items[i].num_draft + j for i in drafting for j in range(items[i].num_draft)]
            src = [s * k_max + j for s, i in enumerate(drafting) for j in range(items[i].num_draft)]
            patches.append(_Patch(dst, src, drafted.view(-1), flat=True))
            where = {i: s for s, i in enumerate(drafting)}
            model_drafts = [(n, where[i], items[i].num_draft) for n, i in enumerate(sampling) if i in where]
            drafted_host = drafted.to("cpu", non_blocking=True) if drafted.is_cuda else drafted
        # every upload is queued (engine/uploads.py), so the host runs ahead of the GPU through the whole
        # step and returns while the forward pass computes
        # (rows, vocab) fp32 from a graph; None: run eagerly (always for prompt logprobs: every row's hidden)
        wants_prompt = any(it.prompt_logprobs is not None for it in items)
        # embedding requests: their last row's hidden state is read, so the step runs eagerly
        pooling = [i for i in sampling if items[i].params.pooling is not None]
        logits = None if wants_prompt or pooling else self._replay(items, patches)
        # a row per sampling item, or k + 1 for an item verifying a k-token draft (its last k + 1 positions)
        owners = [i for i in sampling for _ in range(items[i].num_draft + 1)]
        offsets = [j for i in sampling for j in range(-items[i].num_draft, 1)]
        hidden = self._forward_eager(items, patches) if logits is None else None  # (tokens, hidden)
        if logits is not None and not any(it.num_draft for it in items):  # row i is item i
            rows = None if len(sampling) == len(items) else sampling
        else:  # a row per token, items in order (eager, or a verification replayed as decode rows)
            ends = list(itertools.accumulate(len(it.token_ids) for it in items))
            rows = [ends[i] - 1 + j for i, j in zip(owners, offsets)]
        prompt = self._prompt_logprobs(items, hidden) if wants_prompt and hidden is not None else []
        pooled = self._pooled(items, pooling, hidden) if pooling and hidden is not None else None
        if not sampling:
            return LaunchedStep([], [], None, prompt=prompt)
        picked = None if rows is None else upload(torch.tensor(rows, dtype=torch.long), self.device)
        if hidden is not None:
            logits = self.model.compute_logits(hidden if picked is None else hidden[picked])
        assert logits is not None
        if hidden is None and picked is not None:
            logits = logits[picked]  # (num_rows, vocab) float32
        sample = self.sampler.queue(
            logits,
            [items[i].params for i in owners],
            [items[i].generator for i in owners],
            [items[i].history for i in owners],
            positions=[items[i].seq_len + j for i, j in zip(owners, offsets)],
            banned=[items[i].banned for i in owners],
            masks=[items[i].allowed_mask for i in owners],
        )
        drafts = [items[i].token_ids[len(items[i].token_ids) - items[i].num_draft :] for i in sampling]
        return LaunchedStep(
            [items[i].request_id for i in sampling],
            drafts,
            sample,
            model_drafts,
            drafted_host,
            draft_kv,
            prompt,
            pooled,
        )

    def _pooled(self, items: list[ScheduledSeq], pooling: list[int], hidden: torch.Tensor) -> Pooled:
        """Queue the embeddings of the items that pool (engine/pooling.py): each one's last row of the final
        norm's output, cut and normalized as its params ask, copied to the host with no wait."""
        ends = list(itertools.accumulate(len(it.token_ids) for it in items))
        rows = hidden[upload(torch.tensor([ends[i] - 1 for i in pooling], dtype=torch.long), self.device)]
        params = [items[i].params.pooling for i in pooling]
        vectors = [_to_host(v) for v in pool(rows, params, self.pooler)]  # type: ignore[arg-type]
        ready = None
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        return Pooled([items[i].request_id for i in pooling], vectors, ready)

    def _prompt_logprobs(self, items: list[ScheduledSeq], hidden: torch.Tensor) -> list[PromptLogprobs]:
        """Queue each asking item's prompt logprobs (ScheduledSeq.prompt_logprobs): the log-softmax of the LM
        head's fp32 logits at its chunk's rows, at the prompt's next token and the top k, PROMPT_ROWS rows at a
        time (a (rows, vocab) fp32 block each), copied to the host with no wait."""
        out = []
        ends = list(itertools.accumulate(len(it.token_ids) for it in items))
        for it, end in zip(items, ends):
            if it.prompt_logprobs is None:
                continue
            offset, targets = it.prompt_logprobs
            k = it.params.prompt_logprobs or 0
            base = end - len(it.token_ids) + offset
            own, top_v, top_i = [], [], []
            for s in range(0, len(targets), PROMPT_ROWS):
                rows = targets[s : s + PROMPT_ROWS]
                logits = self.model.compute_logits(hidden[base + s : base + s + len(rows)])
                tgt = upload(torch.tensor(rows, dtype=torch.long), self.device)
                got = logprob_tensors(
                    logits, tgt, min(k, logits.shape[1])
                )  # as the sampled tokens' are taken
                own.append(got[0])
                if k:
                    top_v.append(got[1])
                    top_i.append(got[2])
            out.append(
                PromptLogprobs(
                    it.request_id, it.start_pos + offset, targets, _to_host(torch.cat(own)),
                    _to_host(torch.cat(top_v)) if k else None, _to_host(torch.cat(top_i)) if k else None,
                )
            )  # fmt: skip
        if out and self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            for p in out:
                p.ready = event
        return out

    @staticmethod
    def collect(step: LaunchedStep) -> Sampled:
        """A launched step's {request_id: (new tokens, their logprobs)}, once the device has them. An item
        with a draft keeps the target's tokens up to and including the first that differs from it."""
        if step.sample is None:
            return {}
        result: SamplerOutput = step.sample.result()  # the drafts' copy was queued before: it is here too
        for n, row, k in step.model_drafts:
            assert step.drafted is not None
            step.drafts[n] = step.drafted[row, :k].tolist()
        out: Sampled = {}
        at = 0
        for n, (rid, draft) in enumerate(zip(step.request_ids, step.drafts)):
            targets = result.token_ids[at : at + len(draft) + 1]
            accepted = accepted_length(draft, targets)
            out[rid] = (targets[: accepted + 1], result.logprobs[at : at + accepted + 1])
            at += len(draft) + 1
            if step.draft_kv is not None and n in step.draft_kv.rows:
                # the drafting passes' inputs up to the last accepted token were the sequence's own
                table, start = step.draft_kv.rows[n]
                step.draft_kv.model.held.mark(table, start, start + accepted + 1)
        return out

    def _replay(self, items: list[ScheduledSeq], patches: list[_Patch] | None = None) -> torch.Tensor | None:
        """The logits from a decode graph, a row per token, or None when the step has none (a prompt
        chunk in it, too many rows). A row verifying a k-token draft is k + 1 decode rows, one per position,
        each attending up to its own position over the row's blocks: each layer writes every row's K/V
        before attending, so position j sees the draft's earlier positions as a prompt chunk would."""
        if self.graphs is None or any(len(it.token_ids) != 1 + it.num_draft for it in items):
            return None
        rows = items
        if any(it.num_draft for it in items):
            rows = [
                replace(it, token_ids=[t], start_pos=it.start_pos + j, num_draft=0)
                for it in items
                for j, t in enumerate(it.token_ids)
            ]
        if not patches:
            return self.graphs.replay(rows)
        ends = list(itertools.accumulate(len(it.token_ids) for it in items))

        def patch(ids: torch.Tensor) -> None:
            for p in patches:  # as in _forward_eager: the rows are the step's tokens in order
                p.apply(ids, p.rows if p.flat else [ends[i] - 1 for i in p.rows])

        return self.graphs.replay(rows, patch)

    @torch.inference_mode()
    def _draft_passes(self, items: list[ScheduledSeq], drafting: list[int]) -> torch.Tensor:
        """(len(drafting), k_max) int64 on the device: each drafting item's draft, greedy, one batched pass
        per draft position (an item with a shorter draft leaves the later passes). A self draft runs the
        target's first layers, its final norm and LM head, writing those layers' KV (which the verification
        rewrites); a draft model runs on its own KV cache, with one pass more, over the draft's last token,
        so that its cache holds every position the verification may accept."""
        k_max = max(items[i].num_draft for i in drafting)
        drafted = torch.zeros(len(drafting), k_max, dtype=torch.long, device=self.device)
        last = [items[i].token_ids[len(items[i].token_ids) - items[i].num_draft - 1] for i in drafting]
        ids = upload(torch.tensor(last, dtype=torch.long), self.device)
        extra = 1 if self.draft is not None else 0
        for j in range(k_max + extra):
            rows = [s for s, i in enumerate(drafting) if items[i].num_draft + extra > j]
            its = [items[drafting[s]] for s in rows]
            positions = [it.start_pos + j for it in its]  # start_pos: the newest known token's position
            meta = AttentionMetadata.build(
                [1] * len(its), [p + 1 for p in positions], [it.block_table for it in its], self.block_size,
                self.device,
            )  # fmt: skip
            pos = upload(torch.tensor(positions, dtype=torch.long), self.device)
            if self.draft is not None:
                logits = self.draft.logits(ids, pos, meta)
            else:
                logits = self.model.compute_logits(
                    self.model(ids, pos, meta, self.kv_cache, self.draft_layers)
                )
            tokens = greedy_argmax(logits)
            writes = [n for n, s in enumerate(rows) if items[drafting[s]].num_draft > j]
            if writes:  # the extra pass's tokens are dropped
                index = upload(torch.tensor([rows[n] for n in writes], dtype=torch.long), self.device)
                drafted[index, j] = tokens[upload(torch.tensor(writes, dtype=torch.long), self.device)]
            keep = [n for n, s in enumerate(rows) if items[drafting[s]].num_draft + extra > j + 1]
            if keep:  # the next pass's rows, in order: its input is this pass's token
                ids = tokens[upload(torch.tensor(keep, dtype=torch.long), self.device)]
        return drafted

    def _forward_eager(self, items: list[ScheduledSeq], patches: list[_Patch] | None = None) -> torch.Tensor:
        input_ids = torch.tensor([t for it in items for t in it.token_ids], dtype=torch.long)
        positions = torch.tensor(
            [p for it in items for p in range(it.start_pos, it.seq_len)], dtype=torch.long
        )
        meta = AttentionMetadata.build(
            [len(it.token_ids) for it in items],
            [it.seq_len for it in items],
            [it.block_table for it in items],
            self.block_size,
            self.device,
        )
        ids = upload(input_ids, self.device)
        ends = list(itertools.accumulate(len(it.token_ids) for it in items))
        for patch in patches or []:
            # rows: an item's last token, at its chunk's end; flat: positions in the step's ids already
            patch.apply(ids, patch.rows if patch.flat else [ends[i] - 1 for i in patch.rows])
        return self.model(ids, upload(positions, self.device), meta, self.kv_cache)


Sampled = dict[str, tuple[list[int], list[dict[int, float] | None]]]


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block of a model's KV cache takes: K and V of every layer and kv head."""
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
    return per_token * block_size * torch.empty((), dtype=dtype).element_size()


class DraftModel:
    """A draft model for speculative decoding, on a KV cache of its own laid out as the target's (the same
    block count, block ids and block tables), so that it needs no block manager of its own.

    Its KV is computed lazily: in a step that drafts for a sequence, the positions the draft's cache lacks
    are computed first, as one chunk (`catch_up`); a step that drafts nothing costs no more than plain
    decoding. What the cache holds is kept per block (`HeldSlots`), so a prefix hit on blocks the draft
    has written reuses them, as the target does. Positions at or past its own max_model_len are never
    computed (it does not draft there)."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        target_vocab: int,
        dtype: torch.dtype,
        device: torch.device,
        max_chunk_tokens: int,
    ) -> None:
        self.model, self.block_size, self.max_model_len = model, block_size, max_model_len
        self.target_vocab, self.device, self.max_chunk_tokens = target_vocab, device, max_chunk_tokens
        shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        self.kv_cache = torch.zeros(config.num_hidden_layers, 2, *shape, dtype=dtype, device=device)
        self.held = HeldSlots(num_blocks, block_size)

    def logits(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The draft's logits over the target's vocabulary (padding rows beyond it dropped)."""
        hidden = self.model(ids, positions, meta, self.kv_cache)
        return self.model.compute_logits(hidden)[:, : self.target_vocab]

    @torch.inference_mode()
    def catch_up(self, items: list[ScheduledSeq]) -> None:
        """Write the draft's KV for every position before each drafting item's newest token (the first its
        drafting passes compute) that its cache lacks, reading the tokens from the item's context; in
        passes of at most max_chunk_tokens tokens."""
        todo = []  # (block table, start, tokens)
        for it in items:
            assert it.context is not None, "a drafting item carries its tokens"
            upto = min(it.start_pos, self.max_model_len)
            start = self.held.length(it.block_table, upto)
            if start < upto:
                todo.append((it.block_table, start, it.context[start:upto]))
        while todo:
            chunk, budget = [], self.max_chunk_tokens
            while todo and budget > 0:
                table, start, tokens = todo.pop(0)
                take = tokens[:budget]
                chunk.append((table, start, take))
                budget -= len(take)
                if len(take) < len(tokens):
                    todo.insert(0, (table, start + len(take), tokens[len(take) :]))
            self._forward(chunk)
            for table, start, tokens in chunk:
                self.held.mark(table, start, start + len(tokens))

    @torch.inference_mode()
    def warm_up(self, chunks: list[tuple[int, int]], decode_lens: list[int], rows: list[int]) -> None:
        """Compile at start-up the kernel variants that drafting runs at this model's own shapes: catch-up
        chunks, (start, tokens) each, and drafting passes of each count of one-token rows at each sequence
        length, with their greedy argmax, each held to this model's limits. They run over block 0, which holds
        nothing yet, and mark nothing held."""
        size, longest = self.block_size, self.max_model_len
        for start, n in chunks:
            start = min(start, longest // 2)
            n = min(n, self.max_chunk_tokens, longest - start)
            if n > 0:
                self._forward([([0] * -(-(start + n) // size), start, [0] * n)])
        for seq_len in sorted({min(n, longest) for n in decode_lens}):
            table = [0] * -(-seq_len // size)
            for n in rows:
                meta = AttentionMetadata.build([1] * n, [seq_len] * n, [table] * n, size, self.device)
                ids = torch.zeros(n, dtype=torch.long, device=self.device)
                pos = torch.full((n,), seq_len - 1, dtype=torch.long, device=self.device)
                greedy_argmax(self.logits(ids, pos, meta))

    def _forward(self, chunk: list[tuple[list[int], int, list[int]]]) -> None:
        ids = upload(
            torch.tensor([t for _, _, tokens in chunk for t in tokens], dtype=torch.long), self.device
        )
        positions = torch.tensor([p for _, s, tokens in chunk for p in range(s, s + len(tokens))])
        meta = AttentionMetadata.build(
            [len(tokens) for _, _, tokens in chunk], [s + len(tokens) for _, s, tokens in chunk],
            [table for table, _, _ in chunk], self.block_size, self.device,
        )  # fmt: skip
        self.model(ids, upload(positions, self.device), meta, self.kv_cache)


class HeldSlots:
    """Which positions a second KV cache on the target's block ids (a draft model's) holds: per block, how
    many leading slots, valid while the block keeps the generation they were written in (a block the
    block manager takes for new contents starts empty; `generations` is its array, set by the engine)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.generations = np.zeros(num_blocks, dtype=np.int64)
        self.filled = np.zeros(num_blocks, dtype=np.int64)
        self.filled_in = np.full(num_blocks, -1, dtype=np.int64)  # the generation `filled` counts in

    def length(self, block_table: list[int], upto: int) -> int:
        """How many positions from 0 (at most `upto`) of the sequence with this block table are held."""
        size = self.block_size
        table = np.asarray(block_table[: -(-upto // size)], dtype=np.int64)
        filled = np.where(self.filled_in[table] == self.generations[table], self.filled[table], 0)
        short = np.flatnonzero(filled < size)
        n = len(table) * size if not short.size else int(short[0]) * size + int(filled[short[0]])
        return min(n, upto)

    def mark(self, block_table: list[int], start: int, end: int) -> None:
        """Positions [start, end) of the sequence with this block table are now held; `start` is at most
        its `length`."""
        size = self.block_size
        for i in range(start // size, -(-end // size)):
            block = block_table[i]
            n = min(size, end - i * size)
            if self.filled_in[block] == self.generations[block]:
                n = max(n, int(self.filled[block]))
            self.filled[block], self.filled_in[block] = n, self.generations[block]


@dataclass
class DraftKV:
    """A step's drafts from a draft model: {index among the sampling items: (block table, position of the
    newest known token)}, for marking what the draft's cache holds once the verification is read."""

    model: DraftModel
    rows: dict[int, tuple[list[int], int]]


@dataclass
class LaunchedStep:
    """A step queued on the device: the requests that sample, in row order, each one's draft to verify
    ([] for none), and their pending sampling."""

    request_ids: list[str]
    drafts: list[list[int]]
    sample: PendingSample | None
    # self-drafted items: (index among the sampling items, row of `drafted`, draft length); their drafts
    # are on the device at launch and read with the sampled tokens
    model_drafts: list[tuple[int, int, int]] = field(default_factory=list)
    drafted: torch.Tensor | None = None
    draft_kv: DraftKV | None = None
    prompt: list[PromptLogprobs] = field(default_factory=list)  # items' prompt logprobs, by request
    pooled: Pooled | None = None  # the embeddings of the items that pool

    def embeddings(self) -> dict[str, list[float]]:
        """{request id: its embedding} of the items that pool, once the device has them."""
        return self.pooled.read() if self.pooled is not None else {}

    def prompt_logprobs(self) -> dict[str, tuple[int, list[dict[int, float]]]]:
        """{request id: (prompt position of the first row, one {token: logprob} a row: the prompt's next token
        and the top k)}, once the device has them."""
        return {p.request_id: (p.first, p.read()) for p in self.prompt}


@dataclass
class Pooled:
    """Embeddings on their way to the host, one fp32 vector a request."""

    request_ids: list[str]
    vectors: list[torch.Tensor]
    ready: torch.cuda.Event | None = None

    def read(self) -> dict[str, list[float]]:
        if self.ready is not None:
            self.ready.synchronize()
        return {rid: v.tolist() for rid, v in zip(self.request_ids, self.vectors)}


@dataclass
class PromptLogprobs:
    """One item's prompt logprobs on their way to the host: rows for positions first, first + 1, ..., each
    row's logprob of the prompt's next token (`targets`) and its top k (values, ids; None for k = 0)."""

    request_id: str
    first: int
    targets: list[int]
    own: torch.Tensor
    top_values: torch.Tensor | None
    top_ids: torch.Tensor | None
    ready: torch.cuda.Event | None = None

    def read(self) -> list[dict[int, float]]:
        if self.ready is not None:
            self.ready.synchronize()
        own = self.own.tolist()
        rows = [{t: v} for t, v in zip(self.targets, own)]
        if self.top_ids is not None and self.top_values is not None:
            for row, ids, values in zip(rows, self.top_ids.tolist(), self.top_values.tolist()):
                for t, v in zip(ids, values):
                    row.setdefault(t, v)
        return rows


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A copy on the host, queued behind the step's work when t is on a GPU (read after the step's event)."""
    if not t.is_cuda:
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


class _Patch:
    """Input tokens that an earlier step sampled and the host does not know yet: item `rows[j]` takes row
    `src[j]` of that step's device-side tokens, copied on the device before the forward pass reads them."""

    def __init__(self, rows: list[int], src: list[int], tokens: torch.Tensor, flat: bool = False) -> None:
        self.rows, self.src, self.tokens, self.flat = rows, src, tokens, flat

    def apply(self, ids: torch.Tensor, dst: list[int]) -> None:
        index = upload(torch.tensor([dst, self.src], dtype=torch.long), ids.device)
        ids.index_copy_(0, index[0], self.tokens.index_select(0, index[1]).to(ids.dtype))
