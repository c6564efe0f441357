"""vLLM's `use_beam_search` on /v1/completions and /v1/chat/completions: engine/beam_search.py's search driven over
router calls. Each step runs every live beam as a prompt of token ids for one token with its top 2 x n logprobs
(the workers' prefix caches hold each beam's tokens, so a step computes one token a beam), at most 64 calls at
once (gateway/router_calls.py); the n best beams come back as n choices, answered whole. What beam search would
ignore (stop strings, penalties, logprobs, structured output, sampling filters, streaming) is refused by name."""

from __future__ import annotations

from typing import Any

from gateway.errors import APIError
from gateway.router_calls import RouterCalls
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc

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


class BeamSteps(RouterCalls):
    """A beam search's step calls (gateway/router_calls.py)."""

    def __init__(self, stub: pb_grpc.RouterStub, base: pb.GenerateRequest) -> None:
        super().__init__(stub)
        self.base = base  # model, priority, cache salt and the step's sampling

    async def next_logprobs(self, token_lists: list[list[int]]) -> list[dict[int, float]]:
        """Each token list's next-token logprobs: the top 2n and the sampled one."""
        return await self.each(token_lists, self._start, _first_logprobs)

    def _start(self, ids: list[int]) -> Any:
        request = pb.GenerateRequest()
        request.CopyFrom(self.base)
        request.token_ids.ids.extend(ids)
        return self.stub.Generate(request)


async def _first_logprobs(call: Any) -> dict[int, float]:
    async for resp in call:
        if resp.logprobs:
            first = resp.logprobs[0]
            return {**{t.token_id: t.logprob for t in first.top}, first.token_id: first.logprob}
    raise APIError(502, "the router answered a beam's step without its logprobs", None, "bad_gateway")
