"""vLLM's `use_beam_search` on /v1/completions and /v1/chat/completions: engine/beam_search.py's search driven over
router calls. Each step runs every live beam as a prompt of token ids for one token with its top 2 x n logprobs
(the workers' prefix caches hold each beam's tokens, so a step computes one token a beam), at most MAX_CONCURRENT
calls at once; the n best beams come back as n choices, answered whole. What beam search would ignore (stop
strings, penalties, logprobs, structured output, sampling filters, streaming) is refused by name."""

from __future__ import annotations

import asyncio

import grpc

from gateway.errors import APIError, from_grpc
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc

MAX_CONCURRENT = 64
# sampling fields beam search does not honour: refused when set to anything but their default
_IGNORED = {
    "stop": None, "stop_token_ids": None, "logprobs": None, "prompt_logprobs": None, "presence_penalty": 0.0,
    "frequency_penalty": 0.0, "repetition_penalty": 1.0, "logit_bias": None, "min_tokens": 0,
    "allowed_token_ids": None, "bad_words": None, "structured_outputs": None, "top_p": 1.0, "top_k": 0,
    "min_p": 0.0, "seed": None, "include_stop_str_in_output": False,
}  # fmt: skip


def refused_field(sampling: pb.SamplingParams, stream: bool, tools: bool) -> str | None:
    """The first field of the request that beam search would ignore, or None."""
    if stream:
        return "stream"
    if tools:
        return "tools"
    for name, default in _IGNORED.items():
        value = getattr(sampling, name)
        try:
            present = sampling.HasField(name)
        except ValueError:  # no presence: a repeated field or a map (set when not empty), or a plain scalar
            present = len(value) > 0 if hasattr(value, "__len__") else value != default
            default = None
        if present and (default is None or value != default):
            return name
    return None


class BeamSteps:
    """A beam search's router calls: cancelled when the client goes, stopped with an error by the drain."""

    def __init__(self, stub: pb_grpc.RouterStub, base: pb.GenerateRequest) -> None:
        self.stub, self.base = stub, base  # base: model, priority, cache salt and the step's sampling
        self.error: APIError | None = None
        self._calls: set = set()
        self._limit = asyncio.Semaphore(MAX_CONCURRENT)

    async def next_logprobs(self, token_lists: list[list[int]]) -> list[dict[int, float]]:
        tasks = [asyncio.ensure_future(self._one(ids)) for ids in token_lists]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()

    async def _one(self, ids: list[int]) -> dict[int, float]:
        async with self._limit:
            if self.error is not None:
                raise self.error
            request = pb.GenerateRequest()
            request.CopyFrom(self.base)
            request.token_ids.ids.extend(ids)
            call = self.stub.Generate(request)
            self._calls.add(call)
            try:
                async for resp in call:
                    if resp.logprobs:
                        first = resp.logprobs[0]
                        return {**{t.token_id: t.logprob for t in first.top}, first.token_id: first.logprob}
            except grpc.aio.AioRpcError as exc:
                raise from_grpc(exc) from None
            except asyncio.CancelledError:
                if self.error is not None:  # stopped by the drain, not by the client
                    raise self.error from None
                raise
            finally:
                self._calls.discard(call)
                call.cancel()  # its last message (usage) is not needed
        raise APIError(502, "the router answered a beam's step without its logprobs", None, "bad_gateway")

    def cancel(self) -> None:
        for call in list(self._calls):
            call.cancel()

    def stop(self, error: APIError) -> None:
        self.error = error
        self.cancel()
