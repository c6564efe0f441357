"""The model runner of a tensor-parallel engine: on rank 0 it sends each step's plan to the other ranks
before running the step itself; every rank then runs the same forward pass over its share of the weights
and KV heads, the layers' collectives keeping them in step (engine/layers/).

The sampler runs on every rank, identically: the LM head all-gathers the logits to every rank, and the
samplers start from the same seed and draw in the same order, so every rank samples the same tokens.
That keeps each step's tokens on every rank's device, where the next step's inputs read them while the
host does not know them yet (overlapped scheduling), with no broadcast per step. Only rank 0 reads them
back to the host.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import torch

from engine.config import CacheConfig
from engine.model import LlamaForCausalLM
from engine.model_config import ModelConfig
from engine.model_runner import LaunchedStep, ModelRunner, Sampled
from engine.scheduler import SchedulerOutput
from engine.tp.group import all_ranks_min
from engine.tp.heads import HeadShard
from engine.tp.messages import BuildRunner, CaptureGraphs, Launch, Ready
from engine.tp.ranks import Ranks, TensorParallelError

FAILURE_NOTICE_S = 2.0  # how long a collective's error waits for the dead rank's pipe to say who died


def rank_model_config(config: ModelConfig, shard: HeadShard) -> ModelConfig:
    """The model as one rank's runner sees it: its own heads and KV heads (its KV cache's shape)."""
    return dataclasses.replace(
        config, num_attention_heads=shard.num_heads, num_key_value_heads=shard.num_kv_heads
    )


class RankRunner(ModelRunner):
    """A rank's runner: its KV cache holds the blocks every rank can hold, so a block id means the same
    blocks on every rank."""

    def _num_kv_blocks(self, cache_config: CacheConfig, max_num_batched_tokens: int) -> int:
        return all_ranks_min(super()._num_kv_blocks(cache_config, max_num_batched_tokens), self.device)


class TPModelRunner(RankRunner):
    """Rank 0's runner: every launch (and graph capture) is sent to the other ranks first."""

    def __init__(
        self,
        ranks: Ranks,
        shard: HeadShard,
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
        extra_bytes_per_block: int = 0,
    ) -> None:
        self.ranks, self.shard = ranks, shard
        self._last: LaunchedStep | None = None
        max_len = max_model_len or model_config.max_position_embeddings
        ranks.send(
            BuildRunner(cache_config, max_num_batched_tokens, max_num_seqs, max_len, enforce_eager, seed)
        )
        try:
            super().__init__(
                model, rank_model_config(model_config, shard), cache_config, max_num_batched_tokens, device,
                dtype, seed, max_num_seqs=max_num_seqs, max_model_len=max_len, enforce_eager=enforce_eager,
                extra_bytes_per_block=extra_bytes_per_block,
            )  # fmt: skip
            ready = ranks.collect(Ready)
        except RuntimeError as e:
            raise self._failed(e) from e
        assert all(r.num_blocks == self.num_blocks for r in ready), "ranks disagree on the KV block count"

    def launch(
        self, out: SchedulerOutput, inputs_from: Sequence[int] | None = None, prev: LaunchedStep | None = None
    ) -> LaunchedStep:
        if prev is not None and prev is not self._last:
            raise ValueError("a tensor-parallel step can only read the tokens of the step launched before it")
        self.ranks.send(Launch(out, None if inputs_from is None else list(inputs_from), prev is not None,
                               self.draft_layers))  # fmt: skip
        try:
            self._last = super().launch(out, inputs_from, prev)
        except RuntimeError as e:
            raise self._failed(e) from e
        return self._last

    def collect(self, step: LaunchedStep) -> Sampled:  # type: ignore[override]
        try:
            sampled = ModelRunner.collect(step)
        except RuntimeError as e:
            raise self._failed(e) from e
        self.ranks.check()  # NCCL: an aborted collective returns garbage rather than an error
        return sampled

    def capture_graphs(self):  # type: ignore[no-untyped-def]
        self.ranks.send(CaptureGraphs())
        return super().capture_graphs()

    def _failed(self, error: RuntimeError) -> RuntimeError:
        """A collective's error, as the rank failure behind it when there is one (its reader thread may
        need a moment to see the pipe close)."""
        if isinstance(error, TensorParallelError):
            return error
        deadline = time.monotonic() + FAILURE_NOTICE_S
        while self.ranks.failure is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return TensorParallelError(self.ranks.failure) if self.ranks.failure is not None else error
