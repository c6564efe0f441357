"""The offline API, shaped like vLLM's: `LLM(...).generate(prompts, params)` and `.chat(messages, params)`."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

from engine.args import engine_config
from engine.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from engine.llm_engine import LLMEngine
from engine.metrics_reader import Metric, get_metrics
from engine.outputs import (
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from engine.pooling import PoolingParams
from engine.prompt_checks import truncate_prompt
from engine.sampling_params import SamplingParams, embedding_params

PromptType = str | list[int] | dict


class LLM:
    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        """`model`: an HF model directory, a GGUF file or a dummy shape name (None: the bundled SmolLM2).
        `engine_args`: the engine's settings under vLLM's names, any field of EngineConfig
        (engine/engine_core.py), SchedulerConfig or CacheConfig (engine/config.py), e.g. dtype, device,
        max_model_len, max_num_seqs, block_size, gpu_memory_utilization (engine/args.py: engine_config)."""
        self.engine = LLMEngine(engine_config(model=model, **engine_args))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion, batched together; outputs come back in prompt order.

        A prompt is text, a list of token ids, or {"prompt": ... | "prompt_token_ids": ..., "cache_salt": ...}.
        Every prompt is checked before any is queued, so a bad one raises ValueError and runs nothing."""
        batch = _as_batch(prompts)
        params = _per_prompt(sampling_params, len(batch))
        prios: list[int] = list(priority) if priority is not None else [0] * len(batch)
        encoded = [self._encode(p, sp) for p, sp in zip(batch, params)]
        for (ids, _), sp in zip(encoded, params):
            self.engine.validate(ids, sp)
        rids = [self._add(p, e, sp, prio) for p, e, sp, prio in zip(batch, encoded, params, prios)]
        finished = {out.request_id: out for out in self._drain()}
        return [finished[r] for r in rids]

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """vLLM's `LLM.embed`: each prompt's embedding (engine/pooling.py: the last token's final hidden state,
        normalized unless asked not to), batched together, in prompt order. Prompts are as `generate` takes them;
        a bad one raises ValueError and runs nothing."""
        batch = _as_batch(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            pooling = [pooling_params] * len(batch)
        else:
            pooling = list(pooling_params)
            if len(pooling) != len(batch):
                raise ValueError(f"got {len(pooling)} pooling params for {len(batch)} prompts")
        params = [embedding_params(p, truncate_prompt_tokens) for p in pooling]
        encoded = [self._encode(p, sp) for p, sp in zip(batch, params)]
        for (ids, _), sp in zip(encoded, params):
            self.engine.validate(ids, sp)
        rids = [self._add(p, e, sp, 0) for p, e, sp in zip(batch, encoded, params)]
        seqs = {rid: self.engine.requests[rid].seqs[0] for rid in rids}
        finished = {out.request_id: out for out in self._drain()}
        outputs = []
        for rid in rids:
            seq, out = seqs[rid], finished[rid]
            if seq.embedding is None:  # the engine ended it before its last chunk ran (it cannot here)
                raise RuntimeError(f"request {rid} finished without its embedding")
            outputs.append(
                EmbeddingRequestOutput(rid, EmbeddingOutput(seq.embedding), out.prompt_token_ids, True,
                                       out.num_cached_tokens)
            )  # fmt: skip
        return outputs

    def score(
        self,
        text_1: PromptType | Sequence[PromptType],
        text_2: PromptType | Sequence[PromptType],
        *,
        truncate_prompt_tokens: int | None = None,
    ) -> list[ScoringRequestOutput]:
        """vLLM's `LLM.score` for an embedding model: the cosine similarity of text_1's embedding and each of
        text_2's (one text_1), or of each pair (as many of each)."""
        first, second = _as_batch(text_1), _as_batch(text_2)
        if not first or not second:
            raise ValueError("text_1 and text_2 must not be empty")
        if len(first) != 1 and len(first) != len(second):
            raise ValueError(
                f"text_1 holds {len(first)} prompts and text_2 {len(second)}: give one text_1, or one per text_2"
            )
        embedded = self.embed(
            first + second, PoolingParams(normalize=True), truncate_prompt_tokens=truncate_prompt_tokens
        )
        out = []
        for i, b in enumerate(embedded[len(first) :]):
            a = embedded[0 if len(first) == 1 else i]
            x, y = a.outputs.embedding, b.outputs.embedding
            norms = math.sqrt(sum(v * v for v in x) * sum(v * v for v in y))
            cos = sum(p * q for p, q in zip(x, y)) / norms if norms else 0.0
            out.append(ScoringRequestOutput(f"{a.request_id}+{b.request_id}", ScoringOutput(cos),
                                            a.prompt_token_ids + b.prompt_token_ids))  # fmt: skip
        return out

    def beam_search(
        self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams
    ) -> list[BeamSearchOutput]:
        """vLLM's `LLM.beam_search` (engine/beam_search.py): each prompt's beam_width best sequences, best first."""
        batch = _as_batch(prompts)
        encoded = [self._tokens(p)[0] for p in batch]
        for ids in encoded:
            self.engine.validate(ids, SamplingParams(max_tokens=params.max_tokens))
        tok = self.tokenizer

        def step(token_lists: list[list[int]], one: SamplingParams) -> list[dict[int, float]]:
            outs = self.generate([{"prompt_token_ids": t} for t in token_lists], one)
            return [o.outputs[0].logprobs[0] if o.outputs[0].logprobs else {} for o in outs]

        def decode(ids: list[int]) -> str:
            return tok.decode(ids) if tok is not None else ""

        return beam_search(encoded, params, step, set(self.engine.scheduler.eos_token_ids), decode)

    def get_metrics(self) -> list[Metric]:
        """The engine's series, as vLLM's `LLM.get_metrics()` gives them: counters, gauges, vectors and
        histograms with name, labels and values (engine/metrics_reader.py)."""
        return get_metrics(self.engine)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: list[dict] | None = None,
    ) -> list[RequestOutput]:
        """One conversation or a list of them, rendered with the model's chat template or `chat_template`
        (its text) and run as `generate` runs prompts. `tools`: OpenAI's tool definitions, the template's
        `tools`; messages may carry `tool_calls` (arguments as dicts), `tool_call_id` and `name`."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so no chat template")
        prompts = [
            {
                "prompt": self.tokenizer.apply_chat_template(
                    conv,
                    add_generation_prompt=add_generation_prompt,
                    chat_template=chat_template,
                    tools=tools,
                ),
                "add_special_tokens": False,
            }
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params)

    def _encode(self, prompt: PromptType, params: SamplingParams) -> tuple[list[int], dict]:
        """The prompt's token ids, truncated as params ask (truncate_prompt_tokens), and its options."""
        ids, opts = self._tokens(prompt)
        return truncate_prompt(ids, params.truncate_prompt_tokens, self.engine.max_model_len), opts

    def _tokens(self, prompt: PromptType) -> tuple[list[int], dict]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return list(prompt["prompt_token_ids"]), prompt
            text = prompt.get("prompt")
            if not isinstance(text, str):
                raise ValueError("a prompt dict needs 'prompt' (text) or 'prompt_token_ids'")
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompt token ids")
            return self.tokenizer.encode(
                text, add_special_tokens=prompt.get("add_special_tokens", True)
            ), prompt
        return self.engine.encode_prompt(prompt), {}

    def _add(
        self, prompt: PromptType, encoded: tuple[list[int], dict], params: SamplingParams, prio: int
    ) -> str:
        ids, opts = encoded
        rid = self.engine.add_request(ids, params, priority=prio, cache_salt=opts.get("cache_salt"))
        text = prompt if isinstance(prompt, str) else opts.get("prompt")
        self.engine.requests[rid].prompt = text
        return rid

    def _drain(self) -> Iterator[RequestOutput]:
        while self.engine.has_unfinished_requests():
            yield from self.engine.step(final_only=True)


def _as_batch(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    items: list = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]  # one prompt of token ids
    return items


def _per_prompt(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts")
    return params
