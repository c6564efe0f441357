"""The engine core: model, KV pool, scheduler; one step at a time (schedule -> run -> postprocess).

No tokenizer work happens here beyond loading it: LLMEngine (offline) and the workers build on this."""

from __future__ import annotations

import functools
import itertools
import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine import trace
from engine.block_hash import extra_keys
from engine.block_manager import BlockManager
from engine.config import DTYPE_NAMES, EngineConfig, SchedulerConfig
from engine.kv_scales import CALIBRATION_TEXT, setup_kv_scales
from engine.model_runner import LaunchedStep, ModelRunner, Sampled, kv_bytes_per_block
from engine.pooling import PoolerConfig
from engine.prompt_checks import bad_word_ids, check_param_token_ids, check_prompt
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import Sequence
from engine.spec_decode import Proposer, SpeculativeConfig
from engine.stats import HistogramSnapshot
from engine.structured_output import GuideFactory, reasoning_ended
from engine.swap_setup import build_preemption
from engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    from engine.tp.ranks import Ranks

logger = logging.getLogger(__name__)

_DTYPES = {name: getattr(torch, torch_name) for name, torch_name in DTYPE_NAMES.items()}


def resolve_dtype(name: str, device: torch.device, config_dtype: str | None) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type != "cuda":
        return torch.float32
    return torch.float16 if config_dtype == "float16" else torch.bfloat16


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        from engine.bundled import bundled_model_dir, gguf_model_dir

        self.config = config
        self.device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        model_path = config.model or str(bundled_model_dir())
        if config.load_format in ("auto", "gguf") and Path(model_path).is_file():
            model_path = str(
                gguf_model_dir(model_path)
            )  # converted once, tokenizer and chat template included
        self.model_id = config.served_model_name or Path(model_path).name  # in every block hash
        self.ranks: Ranks | None = None  # tensor parallelism's other ranks (engine/tp/)
        model, self.model_config = self._load(model_path)
        self.tokenizer = self._load_tokenizer(config.tokenizer or model_path)
        self._guides: GuideFactory | None = None  # structured output's, made on first use
        spec = config.speculative_config
        draft = self._load_draft(spec) if isinstance(spec, SpeculativeConfig) and spec.model else None
        self.max_model_len = self._max_model_len(config)
        sched_cfg = SchedulerConfig(**{**config.scheduler.__dict__, "max_model_len": self.max_model_len})
        make_runner = ModelRunner if self.ranks is None else self._tp_runner()
        self.runner = make_runner(
            model,
            self.model_config,
            config.cache,
            sched_cfg.max_num_batched_tokens,
            self.device,
            self.dtype,
            seed=config.seed,
            max_num_seqs=sched_cfg.max_num_seqs,
            max_model_len=self.max_model_len,
            enforce_eager=config.enforce_eager,
            extra_bytes_per_block=kv_bytes_per_block(draft[1], config.cache.block_size, self.dtype)
            if draft
            else 0,
        )
        if draft is not None:
            self.runner.attach_draft(
                draft[0], draft[1], min(draft[1].max_position_embeddings, self.max_model_len)
            )
        self._check_pool(self.runner.num_blocks, config.cache.block_size)
        self.runner.pooler = PoolerConfig.from_dir(model_path)
        calibration = self.tokenizer.encode(CALIBRATION_TEXT) if self.tokenizer is not None else None
        self.kv_scales = setup_kv_scales(self.runner, config.cache.calculate_kv_scales, calibration)
        if self.device.type == "cuda":
            self._warm_up_kernels(
                config.cache.block_size, sched_cfg.max_num_seqs, sched_cfg.max_num_batched_tokens
            )
        self.block_manager = BlockManager(
            self.runner.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching
        )
        if self.runner.draft is not None:  # what the draft's cache holds is valid per block generation
            self.runner.draft.held.generations = self.block_manager.generations
        proposer = None
        if isinstance(spec, SpeculativeConfig):
            proposer = Proposer(spec, draft_cost_fraction=self._draft_cost_fraction(spec, model, draft))
            proposer.max_draft_len = self.runner.draft.max_model_len if self.runner.draft else None
        if isinstance(spec, SpeculativeConfig):
            spec.check_model(self.model_config.num_hidden_layers)
            if spec.method == "self_draft":
                self.runner.draft_layers = spec.num_draft_layers
            if spec.adaptive and self.device.type == "cuda" and proposer is not None:
                self._profile_step_cost(proposer, spec.num_speculative_tokens + 1, sched_cfg)
        preemption = build_preemption(
            config.cache, sched_cfg.preemption_mode, self.runner, self.block_manager,
            sched_cfg.max_num_batched_tokens,
        )  # fmt: skip
        self.scheduler = Scheduler(sched_cfg, self.block_manager, self._eos_ids(), proposer, preemption)
        self._in_flight: _InFlight | None = None  # step_overlapped's step on the device
        self._step_numbers = itertools.count()

    def _draft_cost_fraction(self, spec: SpeculativeConfig, model: Any, draft: Any) -> float:
        """What one drafting pass costs against a target step, for the draft-length policy: self_draft runs
        that share of the target's layers; a draft model, its parameters' share of the target's (at the
        batch sizes that draft, a pass reads its weights once, as a step reads the target's)."""
        if spec.method == "self_draft":
            return (spec.num_draft_layers or 0) / self.model_config.num_hidden_layers
        if draft is None:
            return 0.0

        def size(net: Any) -> int:
            return sum(p.numel() for p in net.parameters())

        return size(draft[0]) / size(model)

    def _warm_up_kernels(self, block_size: int, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        """Compile at start-up the kernel variants that serving would otherwise compile on first use, a second
        or more each, stalling that step: the eager steps that mix decode rows with a prompt chunk (decode
        attention unsplit and split, a chunk after cached context), prompt chunks of every prefill tile, the
        sampler: filters, penalties, logprobs, and the argmax of a step whose rows are all greedy, and a draft
        model's catch-up chunks and drafting passes at its own shapes. (The decode
        graphs compiled theirs when captured; arguments that change with the batch are not specialized on:
        kernels/_backend.py.) The steps run over block 0, which holds nothing yet: what they write there is never
        read."""
        from engine.scheduler import ScheduledSeq
        from kernels.paged_decode_attention import MIN_PARTITION
        from kernels.paged_prefill_attention import TILE_QUERY_LENS
        from kernels.rotary_kv_write import all_kv_heads_from
        from kernels.top_p_cutoff import MIN_ROWS

        t0 = time.perf_counter()
        greedy = SamplingParams(temperature=0.0, max_tokens=1)
        filters = SamplingParams(
            temperature=0.8, top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.1, max_tokens=1, logprobs=2
        )
        top_k = SamplingParams(temperature=0.7, top_k=5, max_tokens=1)

        def row(name: str, seq_len: int, params: SamplingParams, tokens: int = 1) -> ScheduledSeq:
            table = [0] * -(-seq_len // block_size)
            return ScheduledSeq(
                f"warm-up-{name}", [0] * tokens, seq_len - tokens, table, True, params, None, ([0], [0])
            )

        longest = self.max_model_len
        # a prompt chunk after a cached block, where the model allows one
        cached = min(block_size, longest // 2)
        new = min(block_size + 1, longest - cached)
        chunk = row("chunk", cached + new, greedy, tokens=new)
        lengths = [min(longest, 8 * MIN_PARTITION), longest]  # 16 splits or fewer, then more
        short = min(block_size, longest)
        # decode rows first, as the scheduler orders them: a mixed step runs them through the decode kernel
        # MIN_ROWS sampled rows, where the batch limits allow them (fewer take torch's sort, not the top-p kernel)
        room = min(max_num_seqs, max_num_batched_tokens - len(chunk.token_ids)) - 2
        filtered = [row(f"short-{i}", short, filters) for i in range(max(1, min(MIN_ROWS, room)))]
        steps = [[*filtered, row("short-greedy", short, greedy), chunk]]
        steps += [[row("all-greedy", short, greedy), chunk]]  # no knobs: the sampler's greedy argmax alone
        steps += [[row(f"long-{n}", n, top_k), chunk] for n in sorted(set(lengths))]
        # prompt chunks alone: one of each prefill tile's query lengths, and one long enough that the rotary write
        # gives a program all of a token's kv heads, as far as the limits allow. The memory profile would run the
        # longest, but a given pool size (num_gpu_blocks_override) skips it
        most = min(max_num_batched_tokens, longest - cached)
        sizes = sorted({min(n, most) for n in (*TILE_QUERY_LENS, all_kv_heads_from(self.device))})
        steps += [[row(f"prompt-{n}", cached + n, greedy, tokens=n)] for n in sizes if n > 0]
        for items in steps:
            self.runner.run(SchedulerOutput(items, sum(len(it.token_ids) for it in items), []))
        # a draft model's own shapes: its catch-up chunks and its drafting passes
        if self.runner.draft is not None:
            chunks = [(0, n) for n in sizes] + [(cached, n) for n in sizes]
            self.runner.draft.warm_up(chunks, sorted({short, *lengths}), sorted({1, max_num_seqs}))
        logger.info("kernels warmed up for mixed steps and sampling in %.2f s", time.perf_counter() - t0)

    def _profile_step_cost(self, proposer: Proposer, tokens_per_row: int, sched_cfg: SchedulerConfig) -> None:
        """Seed the draft-length policy's cost table: a step of n one-token rows (over a scratch slot of
        the first block, which holds nothing yet) for n in powers of two up to what a full batch of drafts
        runs; the engine's own steps refine it online."""
        from engine.scheduler import ScheduledSeq, SchedulerOutput

        params = SamplingParams(temperature=0.0, max_tokens=1)
        top = min(sched_cfg.max_num_batched_tokens, sched_cfg.max_num_seqs * tokens_per_row)
        sizes = [1 << i for i in range(top.bit_length()) if 1 << i <= top]
        for n in sizes:
            items = [ScheduledSeq(f"profile-{i}", [0], 0, [0], True, params, None) for i in range(n)]
            plan = SchedulerOutput(items, n, [])
            self.runner.run(plan)  # warm
            for _ in range(2):
                torch.cuda.synchronize(self.device)
                t = time.perf_counter()
                self.runner.run(plan)
                proposer.cost.observe(n, time.perf_counter() - t)
        logger.info("speculative decoding: step cost profiled at %d sizes up to %d tokens", len(sizes), top)

    def _load_draft(self, spec: SpeculativeConfig):
        """The draft model and its config, loaded beside the target (before the KV cache is sized); its
        tokenizer must be the target's."""
        from engine.bundled import gguf_model_dir
        from engine.spec_decode import check_draft_tokenizer
        from engine.weights import load_model

        assert spec.model is not None
        path = str(gguf_model_dir(spec.model)) if Path(spec.model).is_file() else spec.model
        if not Path(path, "tokenizer.json").exists() or self.tokenizer is None:
            raise ValueError(f"the draft model {spec.model!r} and the target need tokenizers to be compared")
        check_draft_tokenizer(self.tokenizer, Tokenizer.from_dir(path), self.model_id, Path(path).name)
        return load_model(path, dtype=self.dtype, device=self.device)

    def _load(self, model_path: str):
        from engine.model_config import ModelConfig
        from engine.quant_weights import quantized_source
        from engine.weights import load_model

        cfg = self.config
        weights = quantized_source(cfg.model, cfg.quantization, cfg.load_format) or model_path
        probe: ModelConfig | None = None
        if (
            self.config.dtype == "auto"
            and self.device.type == "cuda"
            and Path(model_path, "config.json").exists()
        ):
            probe = ModelConfig.from_dir(model_path)
        self.dtype = resolve_dtype(self.config.dtype, self.device, getattr(probe, "torch_dtype", None))
        if self.config.tensor_parallel_size > 1:
            from engine.tp.launch import load_sharded, shutdown

            self.ranks, model, model_config = load_sharded(self.config, weights, self.dtype, self.device)
            self._stop_ranks = weakref.finalize(self, shutdown, self.ranks)  # a dropped engine's stop with it
            return model, model_config
        return load_model(
            weights, dtype=self.dtype, load_format=cfg.load_format, device=self.device,
            quantization=cfg.quantization,
        )  # fmt: skip

    def _tp_runner(self) -> Callable[..., ModelRunner]:
        """ModelRunner's constructor for rank 0 of a tensor-parallel engine."""
        from engine.tp.heads import shard_heads
        from engine.tp.runner import TPModelRunner

        ranks, cfg = self.ranks, self.model_config
        assert ranks is not None
        shard = shard_heads(cfg.num_attention_heads, cfg.num_key_value_heads, ranks.size, 0)

        def make(*args: Any, **kwargs: Any) -> ModelRunner:
            try:
                return TPModelRunner(ranks, shard, *args, **kwargs)
            except BaseException:
                self.shutdown()  # e.g. a KV cache that does not fit: the ranks stop with it
                raise

        return make

    def shutdown(self) -> None:
        """Stop what the engine started besides itself: its tensor-parallel ranks (nothing on one rank).
        Idempotent; a dropped engine does it when collected, and at exit."""
        if self.ranks is not None:
            self._stop_ranks()

    @staticmethod
    def _load_tokenizer(path: str) -> Tokenizer | None:
        if Path(path, "tokenizer.json").exists():
            return Tokenizer.from_dir(path)
        return None  # dummy shapes and bare weights: prompts must be token ids

    def _max_model_len(self, config: EngineConfig) -> int:
        native = self.model_config.max_position_embeddings
        if config.max_model_len is None:
            return native
        if config.max_model_len > native:
            raise ValueError(
                f"max_model_len {config.max_model_len} is longer than the model's {native} positions"
            )
        return config.max_model_len

    def _check_pool(self, num_blocks: int, block_size: int) -> None:
        need = -(-self.max_model_len // block_size)
        if num_blocks < need:
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks ({num_blocks * block_size} tokens), fewer than one "
                f"sequence of max_model_len {self.max_model_len} needs; lower max_model_len or give the cache "
                "more memory (gpu_memory_utilization / cpu_kv_cache_space / num_gpu_blocks_override)"
            )

    def _eos_ids(self) -> set[int]:
        if self.tokenizer is not None:
            return set(self.tokenizer.eos_token_ids)
        eos = self.model_config.eos_token_id
        return set(eos if isinstance(eos, (tuple, list)) else [] if eos is None else [eos])

    def counters(self) -> dict[str, float]:
        """The engine's running counts under vLLM's metric names (serving/worker_metrics.py exports them):
        prompt and generated tokens, preemptions (and by mode, `num_preemptions_by_mode/<mode>`), prefix-cache
        queries and hits (in tokens), finished requests by reason (`request_success/<reason>`), swaps' blocks,
        bytes and seconds with a swap space, and speculative decoding's when it speculates."""
        s, bm = self.scheduler, self.block_manager
        out: dict[str, float] = {
            "prompt_tokens": s.num_prompt_tokens,
            "generation_tokens": s.num_generation_tokens,
            "num_preemptions": s.num_preemptions,
            "prefix_cache_queries": bm.prefix_queries,
            "prefix_cache_hits": bm.prefix_hits,
        }
        out.update({f"request_success/{reason}": n for reason, n in s.finished_by_reason.items()})
        out.update(s.preemption.counters())
        if s.proposer is not None:
            stats = s.spec_stats
            out["spec_decode_num_drafts"] = stats.num_drafts
            out["spec_decode_num_draft_tokens"] = stats.num_draft_tokens
            out["spec_decode_num_accepted_tokens"] = stats.num_accepted_tokens
            for i, n in enumerate(stats.accepted_per_pos):
                out[f"spec_decode_num_accepted_tokens_per_pos/{i}"] = n
        return out

    def _observe_step(self, sched: SchedulerOutput) -> None:
        if not sched.is_empty:
            self.scheduler.stats.observe("iteration_tokens_total", sched.num_batched_tokens)

    def histograms(self) -> dict[str, HistogramSnapshot]:
        """The latency and step-size histograms (engine/stats.py: EngineStats.snapshot)."""
        return self.scheduler.stats.snapshot()

    def describe(self) -> dict:
        """The model and cache limits a worker reports about itself (fixed for the process's life)."""
        return {
            "model": self.model_id,
            "max_model_len": self.max_model_len,
            "vocab_size": self.model_config.vocab_size,
            "block_size": self.block_manager.block_size,
            "num_blocks": self.block_manager.num_blocks,
        }

    # ---- requests -------------------------------------------------------------------------------------

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompt token ids")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def validate(self, prompt_ids: list[int] | np.ndarray, params: SamplingParams) -> None:
        """ValueError unless the prompt (engine/prompt_checks.py; give the servers' int arrays as they are)
        and params can run here."""
        check_prompt(prompt_ids, self.max_model_len, self.model_config.vocab_size)
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        check_param_token_ids(params, self.model_config.vocab_size)
        if params.pooling is None and not self.runner.model.has_lm_head:
            raise ValueError(
                "this checkpoint is a base model with no LM head (as embedding models are saved): it serves "
                "embeddings (LLM.embed, /v1/embeddings), not generation"
            )
        if params.pooling is not None:
            self.runner.pooler.check(params.pooling, self.model_config.hidden_size)
            if params.n != 1 or params.max_tokens != 1:
                raise ValueError("an embedding request runs its prompt once: n and max_tokens must be 1")
        if params.bad_words and self.tokenizer is None:
            raise ValueError("bad_words need a tokenizer; this model has none")
        if params.structured_outputs is not None:
            self.guides().check(params.structured_outputs)  # its pattern compiles in the background

    def guides(self) -> GuideFactory:
        """Structured output's guides over this model's tokenizer (engine/structured_output.py)."""
        if self.tokenizer is None:
            raise ValueError("structured output needs a tokenizer; this model has none")
        if self._guides is None:
            self._guides = GuideFactory(self.tokenizer, self.model_config.vocab_size)
        return self._guides

    def make_sequence(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
        parent: Sequence | None = None,
    ) -> Sequence:
        seq = Sequence(
            request_id,
            prompt_ids,
            params,
            self.block_manager.block_size,
            extra_keys(self.model_id, cache_salt),
            priority=priority,
            parent=parent,
        )
        if params.structured_outputs is not None:
            markers = self.guides().reasoning_ids(params.structured_outputs)
            if markers is not None and not reasoning_ended(prompt_ids, *markers):
                seq.reasoning_end_id = markers[1]
            seq.guide_future = self.guides().index_future(params.structured_outputs)
            seq.guide_words = self.guides().mask_words()
            seq.settle_guide(wait=False)  # compiled already: ready at once
        if params.bad_words and self.tokenizer is not None:
            tok = self.tokenizer
            words = bad_word_ids(params.bad_words, lambda s: tok.encode(s, add_special_tokens=False))
            seq.bad_words_ids = tuple(w for w in words if max(w) < self.model_config.vocab_size)
        return seq

    def step_core(
        self,
        after_run: Callable[[SchedulerOutput, dict], None] | None = None,
        during: Callable[[SchedulerOutput], None] | None = None,
    ) -> tuple[list[Sequence], dict[str, list[dict[int, float]]]]:
        """One step: schedule -> run -> postprocess. Returns the sequences that got tokens (`seq.new_tokens`
        of them: several where a draft was verified) and the logprobs of those tokens.

        `during(schedule)` runs while the GPU computes the step (its forward pass and sampling queued, not
        yet waited for; on the CPU, after them): the prefill worker takes grants and queues finished
        prompts' KV copies there. `after_run(schedule, sampled)` sees the step once its tokens are back,
        while every block is still held (the prefill worker sends the first tokens, and the KV it could
        not queue earlier, from there)."""
        begun = time.perf_counter()
        sched = self.scheduler.schedule()
        self._observe_step(sched)
        if trace.enabled:
            for item in sched.scheduled:
                trace.mark(item.request_id, "core.run")
        hook = functools.partial(self._during, sched, during)
        started = time.perf_counter()
        sampled: Sampled = {}
        if not sched.is_empty:
            sampled, step = self.runner.run_launched(sched, hook)
            self._add_prompt_logprobs(step)
            self._add_embeddings(step)
        if self.scheduler.proposer is not None and not sched.is_empty:  # the draft-length policy's cost
            self.scheduler.proposer.cost.observe(sched.num_batched_tokens, time.perf_counter() - started)
        if trace.enabled:
            for rid in sampled:
                trace.mark(rid, "core.sampled")
        if after_run is not None:
            after_run(sched, sampled)
        updated = self.scheduler.postprocess(sched, {rid: toks for rid, (toks, _) in sampled.items()})
        self._observe_decode_step(sched, time.perf_counter() - begun, in_order=True)
        return updated, _add_logprobs(updated, sampled)

    def _during(self, sched: SchedulerOutput, during: Callable[[SchedulerOutput], None] | None) -> None:
        """While the GPU computes `sched`: the caller's `during`, then `_warm_hashes`."""
        if during is not None:
            during(sched)
        self._warm_hashes(sched)

    def _warm_hashes(self, sched: SchedulerOutput) -> None:
        """While the GPU computes `sched`: hash the blocks its prompt chunks fill, which caching them after the
        step would otherwise do before their tokens go out (a decode step's one token fills at most one block:
        that is hashed then, as before)."""
        for item in sched.scheduled:
            seq = self.scheduler.seqs.get(item.request_id)
            if seq is not None and len(item.token_ids) > 1:
                self.block_manager.warm_hashes(seq)

    def run_step(self, hold_frees: bool = False) -> tuple[list[Sequence], dict[str, list[dict[int, float]]]]:
        """The engine's step as configured: overlapped (`async_scheduling`) where it can be, else in order.

        Drafts start from the known tokens, so a speculating engine steps in order while its policy would
        draft, and overlaps its plain steps where it would not (the step in flight is read first when
        drafting resumes). `hold_frees`: as for step_overlapped."""
        if not self.config.async_scheduling:
            return self.step_core()
        if self.scheduler.would_draft():
            prev, self._in_flight = self._in_flight, None
            if prev is not None:
                return self._resolve(prev, hold_frees)
            return self.step_core()
        return self.step_overlapped(hold_frees)

    def step_overlapped(
        self, hold_frees: bool = False
    ) -> tuple[list[Sequence], dict[str, list[dict[int, float]]]]:
        """One step of overlapped scheduling: plan and queue a step while the device still runs the one
        queued before it, then take that one's tokens. Returns, as `step_core` does, the sequences that got
        a token (from the step queued before) and their logprobs.

        A request's newest token is then still on the device when its next step is planned: the scheduler
        counts it as pending, the runner reads it there (engine/model_runner.py: launch), and a request
        that stops on it (EOS, a stop token or string) has one step computed for nothing, dropped. Where a
        row needs its whole history on the host (penalties) or n > 1 children wait for their parent's
        prompt blocks, the step in flight is finished first and the next one queued after it.

        `hold_frees`: where something besides this stream writes the KV pool (a decode worker's KV
        receiver), a block freed while a step runs is not free until that step is done: a request that
        ends or is preempted meanwhile may still be written by it."""
        begun = time.perf_counter()
        prev, self._in_flight = self._in_flight, None
        if prev is not None and not self._can_overlap():
            return self._resolve(prev, hold_frees)
        sched = self.scheduler.schedule(drafts=False)
        self._observe_step(sched)
        if not sched.is_empty:
            inputs_from = None
            if prev is not None:
                rows = {rid: j for j, rid in enumerate(prev.step.request_ids)}
                seqs = self.scheduler.seqs
                inputs_from = [
                    rows[it.request_id] if seqs[it.request_id].num_pending else -1 for it in sched.scheduled
                ]
            step = self.runner.launch(sched, inputs_from, prev.step if prev is not None else None)
            self._in_flight = _InFlight(sched, self.scheduler.launched(sched), step, next(self._step_numbers))
            if hold_frees:  # from here on, frees wait for this step (queued after prev: it covers prev)
                self.block_manager.hold_for = self._in_flight.number
            self._warm_hashes(sched)
        if prev is None:
            return [], {}
        done = self._resolve(prev, hold_frees)
        self._observe_decode_step(sched, time.perf_counter() - begun, in_order=False)
        return done

    def _observe_decode_step(self, sched: SchedulerOutput, seconds: float, in_order: bool) -> None:
        """A decode step's wall time, for the draft-length policy's weighing of stepping in order against
        overlapping (Proposer.in_order_cost). An overlapped step's is the time from planning it to reading
        the one before; an in-order step's has its drafts' own cost taken out (their verification tokens at
        the marginal cost, their drafting passes at the policy's share of a step)."""
        proposer = self.scheduler.proposer
        items = sched.scheduled
        if proposer is None or not items or any(len(it.token_ids) - it.num_draft != 1 for it in items):
            return
        if not in_order:
            proposer.overlapped.observe(len(items), seconds)
            return
        drafted = sched.num_batched_tokens - len(items)
        seconds -= (proposer.cost.slope(sched.num_batched_tokens) or 0.0) * drafted
        passes = max(it.num_draft for it in items) if proposer.on_device else 0
        proposer.in_order.observe(len(items), max(seconds, 0.0) / (1 + proposer.draft_cost_fraction * passes))

    def _add_prompt_logprobs(self, step: LaunchedStep) -> None:
        """A read step's prompt logprobs onto their sequences (entry p: prompt token p + 1's), where still held."""
        for rid, (first, rows) in step.prompt_logprobs().items():
            seq = self.scheduler.seqs.get(rid)
            if seq is not None:
                seq.prompt_logprobs[first : first + len(rows)] = rows

    def _add_embeddings(self, step: LaunchedStep) -> None:
        """A read step's embeddings onto their sequences, where still held."""
        for rid, vector in step.embeddings().items():
            seq = self.scheduler.seqs.get(rid)
            if seq is not None:
                seq.embedding = vector

    @property
    def in_flight(self) -> bool:
        """Whether a step is queued on the device whose tokens step_overlapped has not read yet."""
        return self._in_flight is not None

    def _can_overlap(self) -> bool:
        return not self.scheduler.deferred and not any(
            s.params.has_penalties or s.bad_words_ids or s.guide is not None for s in self.scheduler.running
        )

    def _resolve(
        self, done: _InFlight, hold_frees: bool = False
    ) -> tuple[list[Sequence], dict[str, list[dict[int, float]]]]:
        sampled = self.runner.collect(done.step)
        self._add_prompt_logprobs(done.step)
        self._add_embeddings(done.step)
        if hold_frees and self._in_flight is None:
            self.block_manager.hold_for = None  # nothing runs now: frees are free at once
        updated = self.scheduler.resolve(
            done.sched, done.seqs, {rid: toks for rid, (toks, _) in sampled.items()}
        )
        if hold_frees:
            self.block_manager.release_held(done.number)
        return updated, _add_logprobs(updated, sampled)


@dataclass
class _InFlight:
    """A step queued on the device whose tokens the host has not read: its plan, its sequences item by
    item, and the runner's handle."""

    sched: SchedulerOutput
    seqs: list[Sequence]
    step: LaunchedStep
    number: int  # frees held while it runs wait for it (BlockManager.hold_for)


def _add_logprobs(updated: list[Sequence], sampled: Sampled) -> dict[str, list[dict[int, float]]]:
    """The logprobs of each updated sequence's new tokens (those it kept: a stop drops the rest) onto it;
    returns them by request id ([] where not asked for)."""
    out: dict[str, list[dict[int, float]]] = {}
    for seq in updated:
        lps = [lp for lp in sampled[seq.request_id][1][: seq.new_tokens] if lp is not None]
        new = seq.output_token_ids[seq.num_output_tokens - seq.new_tokens :]
        for lp, token in zip(lps, new):
            seq.logprobs.append(lp)
            seq.cumulative_logprob += lp[token]
        out[seq.request_id] = lps
    return out
