"""The gateway's side of the router: OpenAI request -> GenerateRequest(s), and their merged response streams.

A completions request with several prompts becomes one router call per prompt; choice `i * n + j` is
completion `j` of prompt `i`. The first message of every call is awaited before any HTTP status is sent,
so a refused request (bad params, too long, no capacity) gets its own status code, not a broken stream.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from engine.prompt_checks import check_fits_by_size, check_length, fit_max_tokens, truncate_prompt
from gateway.errors import APIError, from_grpc
from gateway.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    ToolDefinition,
)
from gateway.responses import Echo
from gateway.tools import SPECIAL_MARKERS, ToolPlan, plan_schema, tools_json
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc
from serving.grpc_common import set_token_controls

_PASSTHROUGH = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


def sampling_proto(body: ChatCompletionRequest | CompletionRequest, max_tokens: int) -> pb.SamplingParams:
    for found, code in ((body.conflict(), "invalid_request"), (body.unsupported(), "unsupported")):
        if found is not None:
            field, message = found
            raise APIError(400, message, field, code)
    try:
        bias = body.token_bias()
    except ValueError as exc:
        raise APIError(400, str(exc), "logit_bias", "invalid_request") from None
    msg = pb.SamplingParams(
        max_tokens=max_tokens,
        n=body.n,
        stop=[body.stop] if isinstance(body.stop, str) else list(body.stop or []),
        stop_token_ids=body.stop_token_ids or [],
        ignore_eos=body.ignore_eos,
        include_stop_str_in_output=body.include_stop_str_in_output,
    )
    for name in _PASSTHROUGH:
        value = getattr(body, name)
        if value is not None:
            setattr(msg, name, value)
    num = body.num_logprobs()
    if num is not None:
        msg.logprobs = num
    num = body.num_prompt_logprobs()
    if num is not None:
        msg.prompt_logprobs = num
    if body.truncate_prompt_tokens is not None:
        msg.truncate_prompt_tokens = body.truncate_prompt_tokens
    msg.bad_words.extend(body.bad_words or ())
    try:
        structured = body.structured()
    except ValueError as exc:
        raise APIError(400, str(exc), "response_format", "invalid_request") from None
    if structured is not None:
        msg.structured_outputs.CopyFrom(pb.StructuredOutputs(**structured))
    set_token_controls(msg, bias, body.min_tokens, body.allowed_token_ids, body.skip_special_tokens)
    return msg


@dataclass(frozen=True)
class Rendering:
    """The gateway's settings for chat templates (vLLM's flags): `default_kwargs`, chat_template_kwargs a
    request's own override (--default-chat-template-kwargs); `exclude_tools_when_none`, a request with
    tool_choice "none" renders no tools (--exclude-tools-when-tool-choice-none)."""

    default_kwargs: dict = field(default_factory=dict)
    exclude_tools_when_none: bool = False


def chat_messages(
    body: ChatCompletionRequest | TokenizeChatRequest, rendering: Rendering = Rendering()
) -> pb.ChatMessages:
    """The request's messages, tools and template variables, as the router renders them with the chat template."""
    tools = body.tools
    if (
        rendering.exclude_tools_when_none
        and isinstance(body, ChatCompletionRequest)
        and body.tool_choice == "none"
    ):
        tools = None
    return render_chat(body.messages, body.add_generation_prompt, tools, body.chat_template_kwargs, rendering)


def render_chat(
    messages: list[ChatMessage],
    add_generation_prompt: bool,
    tools: list[ToolDefinition] | None,
    template_kwargs: dict[str, Any] | None,
    rendering: Rendering = Rendering(),
) -> pb.ChatMessages:
    """Messages, tools and template variables (over the gateway's defaults) as the router takes them."""
    out = []
    for m in messages:
        msg = pb.ChatMessage(
            role=m.role, content=m.text(), tool_call_id=m.tool_call_id or "", name=m.name or ""
        )
        if m.tool_calls:
            msg.tool_calls_json = json.dumps([c.for_template() for c in m.tool_calls], ensure_ascii=False)
        out.append(msg)
    variables = {**rendering.default_kwargs, **(template_kwargs or {})}
    kwargs = json.dumps(variables, ensure_ascii=False) if variables else ""
    return pb.ChatMessages(
        messages=out,
        add_generation_prompt=add_generation_prompt,
        tools_json=tools_json(tools),
        template_kwargs_json=kwargs,
    )


def chat_requests(
    body: ChatCompletionRequest, plan: ToolPlan | None = None, rendering: Rendering = Rendering()
) -> list[pb.GenerateRequest]:
    """plan (gateway/tools.py: tool_plan): a named or required tool choice holds the text to its schema;
    the hermes and mistral parsers need special tokens' text, as vLLM's ask for it."""
    chat = chat_messages(body, rendering)
    sampling = sampling_proto(body, body.token_limit() or 0)  # OpenAI: unset is up to the context (0)
    schema = plan_schema(plan, body) if plan is not None else None
    if schema is not None:
        if sampling.HasField("structured_outputs"):
            message = (
                f"tool_choice {body.choice_name()!r} holds the output to its tools' schema: it cannot be "
            )
            raise APIError(400, message + "combined with another structured output", "tool_choice",
                           "invalid_request")  # fmt: skip
        sampling.structured_outputs.json = json.dumps(schema, ensure_ascii=False)
    if plan is not None and plan.parser in SPECIAL_MARKERS:
        sampling.skip_special_tokens = False
    return [pb.GenerateRequest(chat=chat, sampling=sampling, model=body.model, priority=body.priority)]


def completion_requests(body: CompletionRequest) -> list[pb.GenerateRequest]:
    sampling = sampling_proto(body, body.token_limit())
    out = []
    for prompt in body.prompts():
        req = pb.GenerateRequest(sampling=sampling, model=body.model, priority=body.priority)
        if isinstance(prompt, str):
            req.text = prompt
        else:
            req.token_ids.ids.extend(prompt)
        out.append(req)
    return out


async def echo_of(
    stub: pb_grpc.RouterStub, body: CompletionRequest, requests: list[pb.GenerateRequest], max_model_len: int
) -> Echo | None:
    """What echo shows of each prompt, from the router's tokenizer: a text prompt's own text and, with
    logprobs, its token ids; a token-id prompt's ids and their text (special tokens kept, as vLLM decodes
    it); with truncate_prompt_tokens, the tokens kept and their text. A text prompt whose ids were fetched goes
    to the router as them (in `requests`): the tokens shown are those that ran."""
    if not body.echo:
        return None
    cut = body.truncate_prompt_tokens

    async def one(prompt: str | list[int]) -> tuple[str, list[int]]:
        text = prompt if isinstance(prompt, str) else None
        ids = prompt if isinstance(prompt, list) else []
        if text is not None and (body.logprobs is not None or cut is not None):
            request = pb.TokenizeRequest(prompt=pb.GenerateRequest(model=body.model, text=text))
            ids = list((await stub.Tokenize(request, timeout=60)).token_ids)
        kept = truncate_prompt(ids, cut, max_model_len)
        if text is None or len(kept) < len(ids):
            reply = await stub.Detokenize(pb.DetokenizeRequest(model=body.model, token_ids=kept), timeout=60)
            text = reply.text
        return text, kept

    try:
        found = await asyncio.gather(*(one(p) for p in body.prompts()))
    except grpc.aio.AioRpcError as exc:
        raise from_grpc(exc) from exc
    for request, (_, ids) in zip(requests, found, strict=True):
        if ids and request.WhichOneof("prompt") == "text":
            request.token_ids.ids.extend(ids)  # the prompt's oneof: the text is cleared
    return Echo([text for text, _ in found], [ids for _, ids in found], body.echo_only)


def tokenize_request(
    body: TokenizeCompletionRequest | TokenizeChatRequest, rendering: Rendering = Rendering()
) -> pb.TokenizeRequest:
    chat = isinstance(body, TokenizeChatRequest)
    if body.add_special_tokens != (not chat):
        field = "add_special_tokens"
        raise APIError(400, f"{field} {body.add_special_tokens} is not supported: prompts are encoded as "
                       f"{'chat' if chat else 'completion'}s encode them", field, "unsupported")  # fmt: skip
    prompt = pb.GenerateRequest(model=body.model or "")
    if isinstance(body, TokenizeChatRequest):
        refused = body.unsupported()
        if refused is not None:
            raise APIError(400, refused[1], refused[0], "unsupported")
        other = [kind for m in body.messages for kind in m.other_parts()]
        if other:
            message = f"messages hold a content part of type {other[0]!r}: this model reads text only"
            raise APIError(400, message, "messages", "unsupported")
        prompt.chat.CopyFrom(chat_messages(body, rendering))
    else:
        prompt.text = body.prompt
    return pb.TokenizeRequest(prompt=prompt, return_token_strs=body.return_token_strs)


def refuse_unfit(body: ChatCompletionRequest | CompletionRequest, info: pb.ModelInfo) -> None:
    """A prompt that cannot fit gets the router's own refusal here, from its characters (the router's bound of
    characters a token) or its count of ids, before its bytes are copied into a router call: a few megabytes
    of prompt cost the gateway's event loop more to build and send than to count. One the router cuts to its
    last tokens (truncate_prompt_tokens) may be any size; the count may not pass max_model_len."""
    max_tokens = body.token_limit()
    if body.truncate_prompt_tokens is not None:  # cut to its last tokens by the router: any size may fit
        try:
            truncate_prompt([], body.truncate_prompt_tokens, info.max_model_len)  # a count past max_model_len
        except ValueError as exc:
            raise APIError(400, str(exc), "truncate_prompt_tokens", "invalid_request") from exc
        return
    try:
        if isinstance(body, ChatCompletionRequest):  # the router counts every message's content
            chars = sum(len(m.text()) for m in body.messages)  # (not tools: a template may leave them out)
            check_fits_by_size(chars, info.max_token_chars, max_tokens, info.max_model_len)
            return
        for prompt in body.prompts():
            if isinstance(prompt, str):
                check_fits_by_size(len(prompt), info.max_token_chars, max_tokens, info.max_model_len)
            else:
                check_length(len(prompt), info.max_model_len)
                fit_max_tokens(len(prompt), max_tokens, info.max_model_len)
    except ValueError as exc:
        raise APIError(400, str(exc), None, "context_length_exceeded") from exc


def build(make: Callable[[], list[pb.GenerateRequest]]) -> list[pb.GenerateRequest]:
    """Run a request builder; a value protobuf refuses (say, a lone surrogate in a string) is a 400."""
    try:
        return make()
    except (ValueError, TypeError, OverflowError) as exc:
        raise APIError(400, f"invalid request: {exc}", None, "invalid_request") from exc


class RouterStreams:
    """The router calls of one HTTP request. `start()` waits for every call's first message (or error);
    iterating yields (choice offset, response) until all calls end; `cancel()` ends them all."""

    def __init__(self, stub: pb_grpc.RouterStub, requests: list[pb.GenerateRequest]) -> None:
        self.calls = [stub.Generate(r) for r in requests]
        self.offsets = [i * max(r.sampling.n, 1) for i, r in enumerate(requests)]
        self._first: list[pb.GenerateResponse | None] = []
        self._stopped: APIError | None = None

    async def start(self) -> None:
        try:
            self._first = list(await asyncio.gather(*(self._read(c) for c in self.calls)))
        except BaseException:
            self.cancel()
            raise

    @property
    def request_id(self) -> str:
        """The id the router answered with (after `start`)."""
        first = self._first[0] if self._first else None
        return first.request_id if first is not None else ""

    def cancel(self) -> None:
        for call in self.calls:
            call.cancel()

    def stop(self, error: APIError) -> None:
        """End the calls on the server's behalf (shutting down): their readers get `error`, not a cancel."""
        if self._stopped is None:
            self._stopped = error
        self.cancel()

    async def __aiter__(self) -> AsyncIterator[tuple[int, pb.GenerateResponse]]:
        if len(self.calls) == 1:
            async for item in self._drain(0):
                yield item
            return
        queue: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.create_task(self._pump(i, queue)) for i in range(len(self.calls))]
        try:
            for _ in tasks:
                while (item := await queue.get()) is not None:
                    if isinstance(item, BaseException):
                        raise item
                    yield item
        finally:
            for task in tasks:
                task.cancel()

    async def _pump(self, i: int, queue: asyncio.Queue) -> None:
        try:
            async for item in self._drain(i):
                queue.put_nowait(item)
        except Exception as exc:  # handed to the consumer
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(None)

    async def _drain(self, i: int) -> AsyncIterator[tuple[int, pb.GenerateResponse]]:
        msg = self._first[i]
        while msg is not None:
            yield self.offsets[i], msg
            msg = await self._read(self.calls[i])

    async def _read(self, call: grpc.aio.UnaryStreamCall) -> pb.GenerateResponse | None:
        try:
            msg = await call.read()
        except grpc.aio.AioRpcError as exc:
            raise (self._stopped or from_grpc(exc)) from exc
        except asyncio.CancelledError:
            # a call cancelled locally fails its reads with CancelledError; only `stop` makes that an error
            task = asyncio.current_task()
            if self._stopped is None or (task is not None and task.cancelling()):
                raise
            raise self._stopped from None
        return None if msg is grpc.aio.EOF else msg
