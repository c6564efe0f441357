"""What every pdserve gRPC server and client shares: proto <-> SamplingParams, health, reflection."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine.pooling import PoolingParams
from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredOutputsParams
from protos import pdserve_pb2 as pb

if TYPE_CHECKING:
    from serving.tls import TLSConfig

_OPTIONAL = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "max_tokens",
    "seed",
    "logprobs",
    "prompt_logprobs",
    "truncate_prompt_tokens",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "skip_special_tokens",
)

# Small messages, long streams: no message size surprises, keepalive so dead peers are noticed.
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 2**20),
    ("grpc.max_send_message_length", 64 * 2**20),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),  # servers accept those pings
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.http2.max_ping_strikes", 0),  # servers never GOAWAY a peer for pinging (too_many_pings)
    # A peer that restarts on its address is reached again within ~0.5 s (gRPC's default backoff grows to
    # 120 s, so a worker back after a minute could wait another minute to be used).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
    # gRPC reads this one as the least time a connection attempt gets to finish its handshake, not as a
    # backoff: at 100 ms a peer busy for a moment (a loaded host) failed calls made then with UNAVAILABLE.
    ("grpc.min_reconnect_backoff_ms", 5_000),
]


def params_from_proto(msg: pb.SamplingParams, defaults: dict | None = None) -> SamplingParams:
    """Build SamplingParams; raises ValueError naming the bad field."""
    kwargs: dict = dict(defaults or {})
    for name in _OPTIONAL:
        if msg.HasField(name):
            kwargs[name] = getattr(msg, name)
    if kwargs.get("max_tokens") == 0:
        kwargs["max_tokens"] = None  # as many as the context allows
    return SamplingParams(
        **kwargs,
        stop=list(msg.stop) or None,
        stop_token_ids=list(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        include_stop_str_in_output=msg.include_stop_str_in_output,
        logit_bias=dict(msg.logit_bias) or None,
        allowed_token_ids=list(msg.allowed_token_ids) or None,
        bad_words=list(msg.bad_words) or None,
        structured_outputs=_structured_from_proto(msg.structured_outputs)
        if msg.HasField("structured_outputs")
        else None,
    )


def _structured_from_proto(msg: pb.StructuredOutputs) -> StructuredOutputsParams:
    return StructuredOutputsParams(
        json=msg.json or None,
        regex=msg.regex or None,
        choice=list(msg.choice) or None,
        json_object=msg.json_object or None,
        grammar=msg.grammar or None,
        reasoning=(msg.reasoning_start, msg.reasoning_end)
        if msg.reasoning_start or msg.reasoning_end
        else None,
    )


def pooling_from_proto(msg: pb.PoolingParams) -> PoolingParams:
    """PoolingParams; raises ValueError naming the bad field."""
    return PoolingParams(
        dimensions=msg.dimensions if msg.HasField("dimensions") else None,
        normalize=msg.normalize if msg.HasField("normalize") else None,
    )


def pooling_to_proto(p: PoolingParams) -> pb.PoolingParams:
    return pb.PoolingParams(dimensions=p.dimensions, normalize=p.normalize)


def params_to_proto(p: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        min_p=p.min_p,
        n=p.n,
        stop=p.stop_strings,
        stop_token_ids=p.stop_token_ids or [],
        ignore_eos=p.ignore_eos,
        include_stop_str_in_output=p.include_stop_str_in_output,
    )
    if p.has_penalties:
        msg.presence_penalty = p.presence_penalty
        msg.frequency_penalty = p.frequency_penalty
        msg.repetition_penalty = p.repetition_penalty
    if p.max_tokens is not None:
        msg.max_tokens = p.max_tokens
    if p.seed is not None:
        msg.seed = p.seed
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    if p.prompt_logprobs is not None:
        msg.prompt_logprobs = p.prompt_logprobs
    if p.truncate_prompt_tokens is not None:
        msg.truncate_prompt_tokens = p.truncate_prompt_tokens
    msg.bad_words.extend(p.bad_words or ())
    so = p.structured_outputs
    if so is not None:
        schema = so.json if so.json is None or isinstance(so.json, str) else json.dumps(so.json)
        msg.structured_outputs.CopyFrom(
            pb.StructuredOutputs(
                json=schema or "", regex=so.regex or "", choice=list(so.choice or ()),
                json_object=bool(so.json_object), grammar=so.grammar or "",
                reasoning_start=so.reasoning[0] if so.reasoning else "",
                reasoning_end=so.reasoning[1] if so.reasoning else "",
            )
        )  # fmt: skip
    set_token_controls(msg, p.logit_bias, p.min_tokens, p.allowed_token_ids, p.skip_special_tokens)
    return msg


def set_token_controls(
    msg: pb.SamplingParams,
    logit_bias: dict[int, float] | None,
    min_tokens: int,
    allowed_token_ids: list[int] | None,
    skip_special_tokens: bool,
) -> None:
    """The fields that steer which tokens a request may take, set only where they differ from the default (as
    from SamplingParams, so from an OpenAI request body)."""
    if logit_bias:
        msg.logit_bias.update(logit_bias)
    if min_tokens:
        msg.min_tokens = min_tokens
    if allowed_token_ids:
        msg.allowed_token_ids.extend(allowed_token_ids)
    if not skip_special_tokens:
        msg.skip_special_tokens = False


def logprobs_to_proto(token_id: int, entry: dict[int, float] | None) -> pb.TokenLogprobs:
    entry = entry or {}
    return pb.TokenLogprobs(
        token_id=token_id,
        logprob=entry.get(token_id, 0.0),
        top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in entry.items()],
    )


def prompt_logprobs_to_proto(
    prompt_ids: Iterable[int], entries: Sequence[dict[int, float]]
) -> list[pb.TokenLogprobs]:
    """A prompt's logprobs as GenerateResponse carries them: entry p is prompt token p + 1's (the first token
    has none), in the shape of an output token's."""
    if not entries:  # every chunk but a request's first
        return []
    return [logprobs_to_proto(t, e) for t, e in zip(itertools.islice(prompt_ids, 1, None), entries)]


def logprobs_from_proto(msg: pb.TokenLogprobs) -> dict[int, float]:
    out = {t.token_id: t.logprob for t in msg.top}
    out[msg.token_id] = msg.logprob
    return out


def add_health_and_reflection(server: grpc.aio.Server, service_names: list[str]) -> health.HealthServicer:
    """Serve grpc.health.v1 (NOT_SERVING until the caller marks it ready) and server reflection."""
    servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    for name in ["", *service_names]:
        servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    reflection.enable_server_reflection(
        [*service_names, reflection.SERVICE_NAME, health.SERVICE_NAME], server
    )
    return servicer


def mark_serving(servicer: health.HealthServicer, service_names: list[str], serving: bool = True) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *service_names]:
        servicer.set(name, status)


async def check_health(address: str, timeout: float = 1.0, tls: TLSConfig | None = None) -> bool:
    from serving.tls import PLAINTEXT

    async with (tls or PLAINTEXT).aio_channel(address) as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout
            )
        except grpc.aio.AioRpcError:
            return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
