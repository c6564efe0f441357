"""Runs one scheduled step on the model: build the flat batch, forward, sample.

Owns the model and the worker's single KV-cache allocation; never touches scheduler state.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable

import torch

from engine.attention_metadata import AttentionMetadata
from engine.config import CacheConfig
from engine.model import LlamaForCausalLM
from engine.model_config import ModelConfig
from engine.sampler import Sampler, SamplerOutput
from engine.scheduler import SchedulerOutput
from engine.uploads import upload

logger = logging.getLogger(__name__)


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
    ) -> None:
        self.model = model
        self.device = device
        self.dtype = dtype
        self.block_size = cache_config.block_size
        self.kv_shape_tail = (
            cache_config.block_size,
            model_config.num_key_value_heads,
            model_config.head_dim,
        )
        self.num_layers = model_config.num_hidden_layers
        self.sampler = Sampler(seed)
        num_blocks = self._num_kv_blocks(cache_config, max_num_batched_tokens)
        # (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim): the worker's one KV allocation
        self.kv_cache = torch.zeros(
            self.num_layers, 2, num_blocks, *self.kv_shape_tail, dtype=dtype, device=device
        )
        logger.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB)",
            num_blocks,
            self.block_size,
            self.kv_cache.numel() * self.kv_cache.element_size() / 2**30,
        )

    @property
    def num_blocks(self) -> int:
        return self.kv_cache.shape[2]

    def bytes_per_block(self) -> int:
        per_token = 2 * self.num_layers * self.kv_shape_tail[1] * self.kv_shape_tail[2]
        return per_token * self.block_size * torch.empty((), dtype=self.dtype).element_size()

    def _num_kv_blocks(self, cache_config: CacheConfig, max_num_batched_tokens: int) -> int:
        if cache_config.num_gpu_blocks_override is not None:
            return cache_config.num_gpu_blocks_override
        if self.device.type != "cuda":
            return int(cache_config.cpu_kv_cache_space * 2**30) // self.bytes_per_block()
        peak = self._profile_peak_memory(max_num_batched_tokens)
        free, total = torch.cuda.mem_get_info(self.device)
        budget = min(total * cache_config.gpu_memory_utilization - peak, free - 256 * 2**20)
        return max(int(budget) // self.bytes_per_block(), 0)

    @torch.inference_mode()
    def _profile_peak_memory(self, num_tokens: int) -> int:
        """Peak bytes this process needs for weights plus one full-budget forward pass."""
        torch.cuda.reset_peak_memory_stats(self.device)
        num_blocks = -(-num_tokens // self.block_size)
        scratch = torch.zeros(
            self.num_layers, 2, num_blocks, *self.kv_shape_tail, dtype=self.dtype, device=self.device
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
    def run(
        self, out: SchedulerOutput, during: Callable[[], None] | None = None
    ) -> dict[str, tuple[int, dict[int, float] | None]]:
        """Run the step; return {request_id: (sampled token, its logprobs or None)} for requests that sample.
        `during()` runs while the GPU computes: once the forward pass and the sampling (with the copies of
        its results to the host) are queued, before the host waits for them. Work it queues on the current
        stream runs after the step's and does not delay its tokens."""
        items = out.scheduled
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
        sampling = [i for i, it in enumerate(items) if it.sample]
        # every upload is queued (engine/uploads.py), so the host runs ahead of the GPU through the whole
        # step and reaches during() while the forward pass computes
        ends = list(itertools.accumulate(len(it.token_ids) for it in items))
        last_rows = upload(torch.tensor([ends[i] - 1 for i in sampling], dtype=torch.long), self.device)
        hidden = self.model(
            upload(input_ids, self.device), upload(positions, self.device), meta, self.kv_cache
        )

        def hook() -> None:
            if during is not None:
                with torch.inference_mode(False):  # its tensors (e.g. a new KV sender's) stay ordinary ones
                    during()

        if not sampling:
            hook()
            return {}
        logits = self.model.compute_logits(hidden[last_rows])  # (num_sampling, vocab) float32
        result: SamplerOutput = self.sampler(
            logits,
            [items[i].params for i in sampling],
            [items[i].generator for i in sampling],
            [items[i].history for i in sampling],
            before_read=hook,
        )
        return {
            items[i].request_id: (tok, lp) for i, tok, lp in zip(sampling, result.token_ids, result.logprobs)
        }
