"""A Generate request's checks before it is routed: the model, the sampling params, the prompt (tokenized
in the router's pool, router/prompts.py) against max_model_len and the vocabulary (the engine's own
checks, engine/prompt_checks.py). Each refusal is a `Stop` with a plain message; the context-length ones
say "this model's maximum context length" or "but max_model_len is", which the gateway answers as
`context_length_exceeded`."""

from __future__ import annotations

import dataclasses

import grpc
import numpy as np

from engine.prompt_checks import (
    check_fits_by_size,
    check_length,
    check_not_empty,
    check_param_token_ids,
    check_vocabulary,
    fit_max_tokens,
    truncate_prompt,
)
from engine.sampling_params import SamplingParams
from protos import pdserve_pb2 as pb
from router.errors import Stop
from router.prompts import Overloaded, PromptEncoder, prompt_chars
from serving.grpc_common import params_from_proto, pooling_from_proto

_INVALID = grpc.StatusCode.INVALID_ARGUMENT
_OVERLOADED = "the router is overloaded: too many prompts are being tokenized; retry later"


async def admit(
    request: pb.GenerateRequest, info: pb.ModelInfo, served_model_name: str, prompts: PromptEncoder | None
) -> tuple[np.ndarray, SamplingParams]:
    """The prompt's token ids and the request's params (max_tokens filled in); raises Stop."""
    check_model(request.model, served_model_name)
    try:
        params = params_from_proto(request.sampling)
        cut = params.truncate_prompt_tokens
        if request.WhichOneof("prompt") == "token_ids":  # int64: checked before any narrowing
            ids = truncate_prompt(request.token_ids.ids, cut, info.max_model_len)
            check_length(len(ids), info.max_model_len)  # before copying millions of ids
            prompt_ids = np.array(ids, dtype=np.int64)
        else:
            ids = await _tokenize(request, params, info, prompts)
            prompt_ids = np.array(truncate_prompt(ids, cut, info.max_model_len), dtype=np.int64)
        if params.stop_strings and prompts is None:
            raise ValueError("stop strings need a tokenizer; this model has none")
        check_not_empty(len(prompt_ids))
        check_length(len(prompt_ids), info.max_model_len)
        max_tokens = fit_max_tokens(len(prompt_ids), params.max_tokens, info.max_model_len)
        check_vocabulary(prompt_ids, info.vocab_size)
        check_param_token_ids(params, info.vocab_size)
        if max_tokens != params.max_tokens:  # checked again: min_tokens may not fit in the room left
            params = dataclasses.replace(params, max_tokens=max_tokens)
    except ValueError as exc:
        raise Stop(_INVALID, str(exc)) from exc
    return prompt_ids, params


async def admit_embedding(
    request: pb.EmbedRequest, info: pb.ModelInfo, served_model_name: str, prompts: PromptEncoder | None
) -> np.ndarray:
    """An embedding request's prompt token ids, admitted as Generate admits a prompt that generates one token
    (the engine's embedding requests run one step); raises Stop."""
    as_generate = pb.GenerateRequest(model=request.model, sampling=pb.SamplingParams(max_tokens=1))
    if request.HasField("truncate_prompt_tokens"):
        as_generate.sampling.truncate_prompt_tokens = request.truncate_prompt_tokens
    kind = request.WhichOneof("prompt")
    if kind == "text":
        as_generate.text = request.text
    elif kind == "token_ids":
        as_generate.token_ids.CopyFrom(request.token_ids)
    elif kind == "chat":
        as_generate.chat.CopyFrom(request.chat)
    try:
        pooling_from_proto(request.pooling)
    except ValueError as exc:
        raise Stop(_INVALID, str(exc)) from exc
    prompt_ids, _ = await admit(as_generate, info, served_model_name, prompts)
    return prompt_ids


async def _tokenize(
    request: pb.GenerateRequest, params: SamplingParams, info: pb.ModelInfo, prompts: PromptEncoder | None
) -> list[int]:
    """A text or chat prompt's token ids, from the tokenizing pool; a prompt too long to fit is refused
    from its size alone, before any of that."""
    if request.WhichOneof("prompt") is None:
        raise ValueError("the request has no prompt: set text, chat or token_ids")
    if prompts is None:
        raise ValueError("this model has no tokenizer: send token_ids")
    if params.truncate_prompt_tokens is None:  # a prompt cut to its last tokens may be any size
        check_fits_by_size(
            prompt_chars(request), prompts.max_token_chars, params.max_tokens, info.max_model_len
        )
    try:
        return await prompts.encode(request)
    except Overloaded:
        raise Stop(grpc.StatusCode.RESOURCE_EXHAUSTED, _OVERLOADED) from None


async def tokenize(
    request: pb.TokenizeRequest, info: pb.ModelInfo, served_model_name: str, prompts: PromptEncoder | None
) -> pb.TokenizeResponse:
    """A prompt's token ids as Generate encodes them (vLLM's /tokenize): no length is enforced, since the
    caller may be measuring how much to cut; raises Stop."""
    prompt = request.prompt
    check_model(prompt.model, served_model_name)
    try:
        if prompt.WhichOneof("prompt") == "token_ids":
            ids = list(prompt.token_ids.ids)
            check_vocabulary(ids, info.vocab_size)
        elif prompt.WhichOneof("prompt") is None:
            raise ValueError("the request has no prompt: set text, chat or token_ids")
        elif prompts is None:
            raise ValueError("this model has no tokenizer")
        else:
            ids = await prompts.encode(prompt)
        out = pb.TokenizeResponse(token_ids=ids, max_model_len=info.max_model_len)
        if request.return_token_strs:
            if prompts is None:
                raise ValueError("token strings need a tokenizer; this model has none")
            out.token_strs.extend(await prompts.token_strs(ids))
    except ValueError as exc:
        raise Stop(_INVALID, str(exc)) from exc
    except Overloaded:
        raise Stop(grpc.StatusCode.RESOURCE_EXHAUSTED, _OVERLOADED) from None
    return out


async def detokenize(
    request: pb.DetokenizeRequest, info: pb.ModelInfo, served_model_name: str, prompts: PromptEncoder | None
) -> pb.DetokenizeResponse:
    """Token ids back to text, special tokens kept (vLLM's /detokenize), in the tokenizing pool; raises Stop."""
    check_model(request.model, served_model_name)
    ids = list(request.token_ids)
    try:
        check_vocabulary(ids, info.vocab_size)
        if prompts is None:
            raise ValueError("this model has no tokenizer")
        return pb.DetokenizeResponse(text=await prompts.decode(ids))
    except ValueError as exc:
        raise Stop(_INVALID, str(exc).replace("prompt token ids", "token ids")) from exc
    except Overloaded:
        raise Stop(grpc.StatusCode.RESOURCE_EXHAUSTED, _OVERLOADED) from None


def check_model(model: str, served_model_name: str) -> None:
    if model and model != served_model_name:
        raise Stop(_INVALID, f"unknown model {model!r}; this server serves {served_model_name!r}")
