"""Server -> engine process messages (see serving/messages/__init__.py for the hops)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class Admit:
    """Decode: generate a completion. With `prefill_remotely` (the router named a prefill worker) a prompt
    over the local-prefill threshold waits for its blocks, then BlocksReserved goes out; any other prompt is
    prefilled here."""

    request_id: str
    prompt_token_ids: np.ndarray  # int64: pickles ~15x faster than a list
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    prefill_remotely: bool = False


@dataclass(frozen=True)
class KVArrived:
    """Decode: the prefill worker wrote every block of the prompt (its kv_done) and sampled this first
    token, which the server has streamed already. The engine joins the request once its receiver confirms
    the bytes."""

    request_id: str
    first_token_id: int
    first_logprobs: dict[int, float] | None  # when asked for
    num_cached_tokens: int  # prompt tokens the prefill worker had cached


@dataclass(frozen=True)
class KVFailed:
    """Decode: the prefill call failed; the request ends with UNAVAILABLE (`reason`) and its blocks are freed."""

    request_id: str
    reason: str


@dataclass(frozen=True)
class PrefillPrompt:
    """Prefill: compute the prompt, sample its first token (FirstToken), write its KV into the decode
    worker's blocks (KVSent). `dst_block_ids` empty: the decode worker's Grant follows."""

    request_id: str
    prompt_token_ids: np.ndarray  # int64
    params: SamplingParams
    cache_salt: str | None
    kv_descriptor: str  # JSON of the decode worker's kvtransfer receiver descriptor
    dst_block_ids: tuple[int, ...] = ()
    priority: int = 0  # lower runs first under the priority policy
    kv_token: str = ""  # with dst_block_ids: what the KV write shows the receiver


@dataclass(frozen=True)
class Embed:
    """Either role: compute the prompt here and answer its embedding (Embedded); `params` are
    engine.sampling_params.embedding_params'. Its blocks stay as prefix cache, as any prompt's."""

    request_id: str
    prompt_token_ids: np.ndarray  # int64
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None


@dataclass(frozen=True)
class Grant:
    """Prefill: the decode worker reserved these blocks for a prompt that started without them."""

    request_id: str
    dst_block_ids: tuple[int, ...]
    kv_token: str = ""


@dataclass(frozen=True)
class Abort:
    """Either role: forget the request and free what it holds; nothing is answered."""

    request_id: str


@dataclass(frozen=True)
class TakeSnapshot:
    """Prefill: every block in the prefix cache, answered with Snapshot under this id."""

    request_id: str


@dataclass(frozen=True)
class Shutdown:
    """Either role: the engine process returns."""


ToEngine = Admit | KVArrived | KVFailed | PrefillPrompt | Embed | Grant | Abort | TakeSnapshot | Shutdown
