"""Engine process -> server messages (see serving/messages/__init__.py for the hops).

Tokens travel as a sequence: a step may emit several tokens for one request (speculative decoding), and
the servers, the router and the gateway pass each message's tokens on together."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Ready:
    """Once, when the model is loaded: the worker's identity and limits (`EngineProcess.info`)."""

    info: dict[str, Any]


@dataclass(frozen=True)
class StartFailed:
    """Instead of Ready: the engine could not start (a bad model path, a pool too small)."""

    error: str


@dataclass(frozen=True)
class Load:
    """Every 0.1 s: running / waiting requests and free blocks (pb.WorkerLoad's fields), and the engine's
    running counters and histograms for the worker's /metrics (serving/worker_metrics.py, vLLM's names)."""

    load: dict[str, int]
    counters: dict[str, float] = field(default_factory=dict)
    histograms: dict[str, Any] = field(default_factory=dict)  # name -> engine/stats.py Snapshot


@dataclass(frozen=True)
class KVEvents:
    """Prefill: a batch of prefix-cache events for the router (serving/kv_events.py EventBatch bytes)."""

    data: bytes


@dataclass(frozen=True)
class Error:
    """The request ends with this gRPC status (`code` a grpc.StatusCode name)."""

    request_id: str
    code: str
    details: str


@dataclass(frozen=True)
class BlocksReserved:
    """Decode: the prompt's blocks are reserved and expected by the KV receiver; the server asks the
    prefill worker to fill them (or grants them to the prefill it started ahead)."""

    request_id: str
    block_ids: tuple[int, ...]
    kv_token: str = ""  # the KV receiver's grant: only a write that shows it lands in these blocks


@dataclass(frozen=True)
class Tokens:
    """Decode: new tokens of the completion, in order; the last message of a request has `finish_reason`."""

    request_id: str
    token_ids: tuple[int, ...]
    logprobs: tuple[dict[int, float], ...] = ()  # one per token when asked for, else empty
    finish_reason: str | None = None
    stop_reason: str | None = None  # the stop token id as text
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    # on a request's first message, when asked for: one per prompt token after the first (RequestOutput's
    # prompt_logprobs without its leading None)
    prompt_logprobs: tuple[dict[int, float], ...] = ()


@dataclass(frozen=True)
class Landed:
    """Decode: a remotely prefilled prompt's KV is in and its first token (streamed by the server when the
    prefill worker sent it) joined the running batch. `finish_reason` is set when that token ended it."""

    request_id: str
    finish_reason: str | None = None
    stop_reason: str | None = None


@dataclass(frozen=True)
class FirstToken:
    """Prefill: the prompt's one sampled token, sent as soon as it is sampled, before its KV is written.
    The decode server streams it on as the completion's first token."""

    request_id: str
    token_id: int
    logprobs: dict[int, float] | None
    num_cached_tokens: int
    prompt_logprobs: tuple[dict[int, float], ...] = ()  # as Tokens'


@dataclass(frozen=True)
class KVSent:
    """Prefill: every block of the prompt is in the decode worker's pool (after its FirstToken)."""

    request_id: str


@dataclass(frozen=True)
class Embedded:
    """Either role: the answer to Embed."""

    request_id: str
    embedding: tuple[float, ...]
    num_cached_tokens: int  # prompt tokens served by the prefix cache


@dataclass(frozen=True)
class Snapshot:
    """Prefill: the answer to TakeSnapshot (serving/kv_events.py Snapshot bytes)."""

    request_id: str
    data: bytes


ForRequest = Error | BlocksReserved | Tokens | Landed | FirstToken | KVSent | Embedded | Snapshot
FromEngine = Ready | StartFailed | Load | KVEvents | ForRequest
