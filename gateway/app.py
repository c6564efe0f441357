"""The OpenAI-compatible HTTP gateway: FastAPI to users, grpc.aio to the router.

`create_app(GatewayConfig(router="HOST:PORT"))` gives the ASGI app; `gateway/cli.py` serves it with uvicorn.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import logging
import signal
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.types import Receive, Scope, Send

from engine.beam_search import BeamSearch, BeamSearchParams
from engine.prompt_checks import fit_max_tokens
from engine.tokenizer import Tokenizer
from gateway.access import AccessLog, AccessRecord, record_of
from gateway.auth import BearerAuth
from gateway.beam import BeamSteps, refused_field
from gateway.defaults import DEFAULT_MAX_REQUEST_BYTES
from gateway.drain import Admission, Drain
from gateway.embeddings import (
    EmbedCalls,
    EmbeddingRequest,
    RerankRequest,
    ScoreRequest,
    embedding_requests,
    embedding_response,
    score_response,
)
from gateway.errors import APIError, client_closed, endpoint_of, from_grpc, install_handlers
from gateway.limits import BodyLimit, OffLoopJSONRoute
from gateway.metrics import GatewayMetrics
from gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from gateway.rate_limit import TenantLimits, retry_after
from gateway.reasoning import END as THINK_END
from gateway.reasoning import PARSERS as REASONING_PARSERS
from gateway.reasoning import START as THINK_START
from gateway.reasoning import Reasoning
from gateway.responses import Choice, Formatter, TokenText, Totals
from gateway.responses_api import ResponsesOutput, ResponsesRequest, ResponseStore, messages_of
from gateway.router_client import (
    Rendering,
    RouterStreams,
    build,
    chat_requests,
    completion_requests,
    echo_of,
    refuse_unfit,
    tokenize_request,
)
from gateway.tenants import CacheSalts, TenantKeys
from gateway.tools import PARSERS, tool_plan
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc
from serving.logs import new_request_id
from serving.metrics_compat import add_compat
from serving.tls import PLAINTEXT, TLSConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GatewayConfig:
    router: str  # host:port of pdserve.v1.Router
    api_key: str | None = field(
        default=None, repr=False
    )  # bearer token the /v1 endpoints require; None: open
    model_dir: str | None = None  # tokenizer for logprobs' token text; None: the bundled model's
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # larger bodies get 413, unread
    drain_timeout_s: float = 30.0  # on SIGTERM: how long requests in flight may run on
    metrics_compat: str | None = None  # "vllm": /metrics under vllm: as well (serving/metrics_compat.py)
    tls: TLSConfig = PLAINTEXT  # the channel to the router (serving/tls.py)
    api_keys_file: str | None = None  # `KEY TENANT` lines (gateway/tenants.py); reloaded on SIGHUP
    cache_salt_secret: str | None = field(default=None, repr=False)  # tenants' cache salts' HMAC key
    rate_limit_requests_per_s: float | None = None  # per tenant (gateway/rate_limit.py); None: no limit
    rate_limit_tokens_per_s: float | None = None
    # tool_choice "auto" (gateway/tools.py): on, with the parser that picks calls out of the model's text
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None  # one of gateway/tools.py's PARSERS
    reasoning_parser: str | None = None  # one of gateway/reasoning.py's PARSERS: chat's reasoning split off
    # chat templates: variables a request's chat_template_kwargs override; no tools where tool_choice is "none"
    default_chat_template_kwargs: dict = field(default_factory=dict)
    exclude_tools_when_tool_choice_none: bool = False

    def __post_init__(self) -> None:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError(
                "--enable-auto-tool-choice needs --tool-call-parser (one of " + ", ".join(PARSERS) + ")"
            )
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"--reasoning-parser {self.reasoning_parser!r} is not one of {', '.join(REASONING_PARSERS)}"
            )
        if self.tool_call_parser is not None and self.tool_call_parser not in PARSERS:
            raise ValueError(
                f"--tool-call-parser {self.tool_call_parser!r} is not one of {', '.join(PARSERS)}"
            )
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be at least 1, got {self.max_request_bytes}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")


def _load_tokenizer(model_dir: str | None) -> Tokenizer | None:
    try:
        if model_dir is None:
            from engine.bundled import model_dir as resolve

            model_dir = resolve(None)
        if not Path(model_dir, "tokenizer.json").is_file():
            return None
        return Tokenizer.from_dir(model_dir)
    except Exception:  # logprobs then name tokens "token_id:N"
        logger.warning("no tokenizer for logprobs' token text", exc_info=True)
        return None


class Gateway:
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.metrics = GatewayMetrics()
        self.drain = Drain()
        self.channel: grpc.aio.Channel | None = None
        self.stub: pb_grpc.RouterStub | None = None
        self.token_text = TokenText(None)
        self._info: pb.ModelInfo | None = None
        has_keys = config.api_key or config.api_keys_file
        self.keys = TenantKeys(config.api_keys_file, config.api_key) if has_keys else None
        self.salts = CacheSalts(config.cache_salt_secret)
        self.limits = TenantLimits(config.rate_limit_requests_per_s, config.rate_limit_tokens_per_s)
        self.responses = ResponseStore()  # /v1/responses' stored responses (gateway/responses_api.py)
        self.rendering = Rendering(
            dict(config.default_chat_template_kwargs), config.exclude_tools_when_tool_choice_none
        )

    @asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        self.channel = self.config.tls.aio_channel(self.config.router)
        self.stub = pb_grpc.RouterStub(self.channel)
        self.token_text = TokenText(await asyncio.to_thread(_load_tokenizer, self.config.model_dir))
        if self.keys is not None and self.keys.has_tenants:
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self.keys.reload_or_keep)
        try:
            yield
        finally:
            await self.channel.close()

    async def model_info(self, fresh: bool = False) -> pb.ModelInfo:
        if self._info is not None and not fresh:
            return self._info
        assert self.stub is not None
        try:
            self._info = await self.stub.GetModelInfo(pb.ModelInfoRequest(), timeout=5)
        except grpc.aio.AioRpcError as exc:
            raise from_grpc(exc) from exc
        return self._info

    async def model_card(self) -> dict:
        """The served model as OpenAI's /v1/models lists it, with vLLM's max_model_len."""
        info = await self.model_info()
        return {
            "id": info.model,
            "object": "model",
            "created": 0,
            "owned_by": "pdserve",
            "max_model_len": info.max_model_len,
        }

    async def unhealthy(self) -> str | None:
        """None while the router can route; otherwise why not, in the router's words where it gives them."""
        assert self.channel is not None
        try:
            reply = await health_pb2_grpc.HealthStub(self.channel).Check(
                health_pb2.HealthCheckRequest(), timeout=2
            )
            await self.model_info(fresh=True)  # a router that cannot route says why here
        except grpc.aio.AioRpcError:
            return f"the router at {self.config.router} does not answer"
        except APIError as exc:
            return exc.message
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            return "the router is not serving"
        return None

    async def respond(self, request: Request, body: ResponsesRequest) -> Response:
        """OpenAI's Responses API: the request runs as a chat request (gateway/responses_api.py)."""
        record = record_of(request.scope)
        try:
            refused = body.refused()
            if refused is not None:
                raise refused
            history = (
                self.responses.get(record.tenant, body.previous_response_id)[1]
                if body.previous_response_id
                else []
            )
            chat_body = body.chat_body(history)
            try:
                chat = ChatCompletionRequest.model_validate(chat_body)
            except ValidationError as exc:
                first = exc.errors()[0]
                raise APIError(400, f"{first['msg']} (as a chat request: {'.'.join(map(str, first['loc']))})",
                               None, "invalid_request") from None  # fmt: skip
        except APIError as exc:
            self.metrics.done("responses", exc.status)
            return exc.response()
        turns = history + messages_of(body.items())  # what a later previous_response_id continues
        # serve() refuses a model other than the one served before anything is answered
        out = ResponsesOutput(body, turns, body.model, self.responses, record.tenant)
        return await self.serve(request, chat, "responses", out)

    async def serve(
        self,
        request: Request,
        body: ChatCompletionRequest | CompletionRequest,
        endpoint: str,
        out: ResponsesOutput | None = None,
    ) -> Response:
        """`out`: a /v1/responses request's own answer (gateway/responses_api.py), else chat's or completions'."""
        if body.use_beam_search and out is None:
            return await self.beam(request, body, endpoint)
        start = time.monotonic()
        record = record_of(request.scope)
        chat = isinstance(body, ChatCompletionRequest)
        try:
            self._admit(record.tenant)
            info = await self.model_info()
            check_model(body.model, info)
            refuse_unfit(body, info)  # before a long prompt is copied into router calls
            assert self.stub is not None
            echo = None
            plan, reasoning = None, None
            if isinstance(body, ChatCompletionRequest):
                auto = self.config.tool_call_parser if self.config.enable_auto_tool_choice else None
                plan = tool_plan(body, auto)
                reqs = build(lambda: chat_requests(body, plan, self.rendering))
                if self.config.reasoning_parser is not None:
                    constrained = reqs[0].sampling.HasField("structured_outputs")
                    if constrained and info.think_tokens:  # the workers hold the text from the thinking's end
                        for req in reqs:
                            so = req.sampling.structured_outputs
                            so.reasoning_start, so.reasoning_end = THINK_START, THINK_END
                        constrained = False
                    reasoning = Reasoning(self.config.reasoning_parser, body.include_reasoning, constrained)
            else:
                reqs = build(lambda: completion_requests(body))
                echo = await echo_of(self.stub, body, reqs, info.max_model_len)
            salt = self.salts.salt(record.tenant, body.cache_salt)
            for req, rid in zip(reqs, router_ids(record, len(reqs)), strict=True):
                req.request_id, req.cache_salt = rid, salt
            streams = RouterStreams(self.stub, reqs)
            self.drain.watch(streams)
            await _unless_disconnected(request, streams, streams.start())
            record.identify(streams.request_id)
            self.metrics.ttft.labels(endpoint).observe(time.monotonic() - start)
            record.first_token()
            token_text = TokenText(None) if body.return_tokens_as_token_ids else self.token_text  # token_id:N
            fmt = Formatter(
                chat, info.model, body.num_logprobs(), token_text, body.n, body.prompt_logprobs, echo, plan,
                body.continuous_usage, reasoning,
            )  # fmt: skip
            if body.stream:
                sse = out if out is not None else ChatEvents(fmt, body.include_usage)
                events = self._events(streams, fmt, sse, (endpoint, start, record))
                return _EventStream(events, media_type="text/event-stream")
            choices, totals = await _unless_disconnected(request, streams, _collect(streams, fmt))
        except APIError as exc:
            self._finished((endpoint, start, record), exc.status, Totals())
            return exc.response()
        self._finished((endpoint, start, record), 200, totals)
        whole = fmt.whole(choices, totals)
        return JSONResponse(out.whole(whole) if out is not None else whole)

    async def beam(
        self, request: Request, body: ChatCompletionRequest | CompletionRequest, endpoint: str
    ) -> Response:
        """vLLM's use_beam_search (gateway/beam.py): body.n beams a prompt, answered whole as n choices."""
        where = (endpoint, time.monotonic(), record_of(request.scope))
        record = where[2]
        chat = isinstance(body, ChatCompletionRequest)
        try:
            self._admit(record.tenant)
            info = await self.model_info()
            check_model(body.model, info)
            assert self.stub is not None
            if isinstance(body, ChatCompletionRequest):
                reqs = build(lambda: chat_requests(body, None, self.rendering))
                tools = bool(body.tools) and body.tool_choice != "none"
            else:
                reqs = build(lambda: completion_requests(body))
                tools = False
            refused = refused_field(reqs[0].sampling, body.stream, tools)
            if refused is None and isinstance(body, CompletionRequest) and body.echo:
                refused = "echo"
            if refused is not None:
                raise APIError(
                    400, f"{refused} is not supported with use_beam_search", refused, "unsupported"
                )
            prompts = []
            for req in reqs:
                try:
                    reply = await self.stub.Tokenize(pb.TokenizeRequest(prompt=req), timeout=60)
                except grpc.aio.AioRpcError as exc:
                    raise from_grpc(exc) from None
                prompts.append(list(reply.token_ids))
            try:
                limits = [
                    fit_max_tokens(len(p), body.token_limit() or None, info.max_model_len) for p in prompts
                ]
            except ValueError as exc:
                raise APIError(400, str(exc), None, "context_length_exceeded") from None
            temperature = reqs[0].sampling.temperature if reqs[0].sampling.HasField("temperature") else 0.0
            params = BeamSearchParams(body.n, min(limits), body.ignore_eos, temperature, body.length_penalty)
            search = BeamSearch(prompts, params, set(info.eos_token_ids))
            step = pb.SamplingParams(
                max_tokens=1, logprobs=2 * body.n, temperature=temperature, ignore_eos=True
            )
            salt = self.salts.salt(record.tenant, body.cache_salt)
            base = pb.GenerateRequest(
                sampling=step, model=body.model, priority=body.priority, cache_salt=salt or ""
            )
            steps = BeamSteps(self.stub, base)
            self.drain.watch(steps)
            while not search.done:
                search.advance(
                    await _unless_disconnected(request, steps, steps.next_logprobs(search.wanted()))
                )
            choices, totals = {}, Totals(prompt_tokens=sum(map(len, prompts)))
            for i, (prompt, out) in enumerate(zip(prompts, search.results())):
                for j, beam in enumerate(out.sequences):
                    ids = BeamSearch.generated(beam, len(prompt))
                    text = (await self.stub.Detokenize(pb.DetokenizeRequest(token_ids=ids), timeout=60)).text
                    choices[i * body.n + j] = Choice(text=[text], finish_reason=beam.finish_reason)
                    # a final EOS counts, as it does unbeamed
                    totals.completion_tokens += len(beam.tokens) - len(prompt)
        except APIError as exc:
            self._finished(where, exc.status, Totals())
            return exc.response()
        except grpc.aio.AioRpcError as exc:
            error = from_grpc(exc)
            self._finished(where, error.status, Totals())
            return error.response()
        reasoning = None
        if isinstance(body, ChatCompletionRequest) and self.config.reasoning_parser is not None:
            reasoning = Reasoning(self.config.reasoning_parser, body.include_reasoning)
        fmt = Formatter(chat, info.model, None, self.token_text, body.n, reasoning=reasoning)
        self._finished(where, 200, totals)
        return JSONResponse(fmt.whole(choices, totals))

    async def scores(self, request: Request, body: ScoreRequest | RerankRequest, endpoint: str) -> Response:
        """vLLM's /score and /rerank for an embedding model: cosine similarities of the texts' embeddings."""
        where = (endpoint, time.monotonic(), record_of(request.scope))
        record = where[2]
        try:
            self._admit(record.tenant)
            info = await self.model_info()
            check_model(body.model, info)
            texts, pairs = body.pairs()
            salt = self.salts.salt(record.tenant, None)
            assert self.stub is not None
            calls = EmbedCalls(
                self.stub, embedding_requests(texts, body, router_ids(record, len(texts)), salt)
            )
            self.drain.watch(calls)
            replies = await _unless_disconnected(request, calls, calls.run())
        except APIError as exc:
            self._finished(where, exc.status, Totals())
            return exc.response()
        self._finished(where, 200, Totals(prompt_tokens=sum(r.prompt_tokens for r in replies)))
        rerank = body if isinstance(body, RerankRequest) else None
        return JSONResponse(score_response(info.model, replies, pairs, rerank))

    async def embeddings(self, request: Request, body: EmbeddingRequest) -> Response:
        """OpenAI's /v1/embeddings: each input embedded by the router (gateway/embeddings.py)."""
        where = ("embeddings", time.monotonic(), record_of(request.scope))
        record = where[2]
        try:
            self._admit(record.tenant)
            info = await self.model_info()
            check_model(body.model, info)
            prompts = body.prompts(self.rendering)
            salt = self.salts.salt(record.tenant, body.cache_salt)
            rids = router_ids(record, len(prompts))
            assert self.stub is not None
            calls = EmbedCalls(self.stub, [body.router_request(p, r, salt) for p, r in zip(prompts, rids)])
            self.drain.watch(calls)
            replies = await _unless_disconnected(request, calls, calls.run())
        except APIError as exc:
            self._finished(where, exc.status, Totals())
            return exc.response()
        if len(replies) == 1:
            record.identify(replies[0].request_id)
        self._finished(where, 200, Totals(prompt_tokens=sum(r.prompt_tokens for r in replies)))
        return JSONResponse(embedding_response(body, info.model, replies))

    async def tokenize(self, body: TokenizeCompletionRequest | TokenizeChatRequest) -> Response:
        """vLLM's /tokenize: the router encodes the prompt as Generate would, so `count` is the
        `usage.prompt_tokens` the same prompt gets."""
        assert self.stub is not None
        try:
            request = build(lambda: tokenize_request(body, self.rendering))
            reply = await self.stub.Tokenize(request, timeout=60)
        except grpc.aio.AioRpcError as exc:
            return from_grpc(exc).response()
        except APIError as exc:
            return exc.response()
        ids = list(reply.token_ids)
        strs = list(reply.token_strs) if body.return_token_strs else None
        return JSONResponse(
            {"count": len(ids), "max_model_len": reply.max_model_len, "tokens": ids, "token_strs": strs}
        )

    async def detokenize(self, body: DetokenizeRequest) -> Response:
        """vLLM's /detokenize: token ids back to text, special tokens kept."""
        assert self.stub is not None
        request = pb.DetokenizeRequest(model=body.model or "", token_ids=body.tokens)
        try:
            reply = await self.stub.Detokenize(request, timeout=60)
        except grpc.aio.AioRpcError as exc:
            return from_grpc(exc).response()
        return JSONResponse({"prompt": reply.text})

    def _admit(self, tenant: str | None) -> None:
        """The tenant's rate limits: 429 with Retry-After when it is over one."""
        wait = self.limits.admit(tenant)
        if wait is not None:
            after = retry_after(wait)
            message = f"rate limit reached for this API key; retry in {after} s"
            raise APIError(429, message, None, "rate_limit_exceeded", {"Retry-After": after})

    def _finished(self, where: tuple[str, float, AccessRecord], status: int, totals: Totals) -> None:
        endpoint, start, record = where
        self.limits.charge(record.tenant, totals.prompt_tokens + totals.completion_tokens)
        self.metrics.done(endpoint, status, totals.prompt_tokens, totals.completion_tokens)
        if status < 400:
            self.metrics.e2e.labels(endpoint).observe(time.monotonic() - start)
        elif status == 499:
            logger.info("the client closed its %s request", endpoint)
        record.status = status
        record.prompt_tokens, record.completion_tokens = totals.prompt_tokens, totals.completion_tokens

    async def _events(
        self,
        streams: RouterStreams,
        fmt: Formatter,
        sse: ChatEvents | ResponsesOutput,
        where: tuple[str, float, AccessRecord],
    ) -> AsyncIterator[str]:
        """Server-sent events, each chunk of `fmt` as `sse` writes it; a client disconnect cancels this generator,
        which cancels the router calls. A failure mid-way, shutdown included, is a last error event; `sse`'s end
        (chat's `data: [DONE]`) always ends it."""
        totals, status, streamed = Totals(), 499, 0
        try:
            for event in sse.start():
                yield event
            async for offset, resp in streams:
                if resp.HasField("usage"):
                    totals.add(resp.usage)
                streamed += len(resp.token_ids)
                fmt.saw(offset, resp)
                if not (resp.token_ids or resp.text or resp.finish_reason):
                    continue
                for chunk in fmt.stream(offset + resp.index, resp):
                    for event in sse.chunk(chunk):
                        yield event
            for chunk in fmt.flush():
                for event in sse.chunk(chunk):
                    yield event
            for event in sse.end(totals):
                yield event
            status = 200
        except APIError as exc:
            status = exc.status
            for event in sse.error(exc.body()):
                yield event
        finally:
            streams.cancel()
            totals.completion_tokens = totals.completion_tokens or streamed  # no usage on a cut stream
            self._finished(where, status, totals)
        for event in sse.done():
            yield event


def check_model(model: str, info: pb.ModelInfo) -> None:
    """404 model_not_found unless `model` is the one served."""
    if model != info.model:
        msg = f"The model {model!r} does not exist; this server serves {info.model!r}"
        raise APIError(404, msg, "model", "model_not_found")


def router_ids(record: AccessRecord, n: int) -> list[str]:
    """The ids of a request's `n` router calls ("": the router makes it). Workers key requests by id, so each
    is unique: a client's `X-Request-Id` gets a random suffix; and each contains the request's id, so one
    grep finds them all. A request without one takes the router's, or with several prompts one made here."""
    if record.request_id is not None:
        base = f"{record.request_id}-{uuid.uuid4().hex[:8]}"
    elif n == 1:
        return [""]
    else:
        base = new_request_id()
        record.identify(base)
    return [base] if n == 1 else [f"{base}-{i}" for i in range(n)]


class _EventStream(StreamingResponse):
    """Closes its generator however the response ends, so the router calls are always cancelled."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class ChatEvents:
    """Chat's and completions' server-sent events: each chunk as it is, the usage chunk where asked for, then
    `data: [DONE]`."""

    def __init__(self, fmt: Formatter, include_usage: bool) -> None:
        self.fmt, self.include_usage = fmt, include_usage

    def start(self) -> list[str]:
        return []

    def chunk(self, chunk: dict) -> list[str]:
        return [_sse(chunk)]

    def end(self, totals: Totals) -> list[str]:
        return [_sse(self.fmt.usage_chunk(totals))] if self.include_usage else []

    def error(self, body: dict) -> list[str]:
        return [_sse(body)]

    def done(self) -> list[str]:
        return ["data: [DONE]\n\n"]


async def _collect(streams: RouterStreams, fmt: Formatter) -> tuple[dict[int, Choice], Totals]:
    choices: dict[int, Choice] = {}
    totals = Totals()
    async for offset, resp in streams:
        if resp.HasField("usage"):
            totals.add(resp.usage)
        fmt.saw(offset, resp)
        if not (resp.token_ids or resp.text or resp.finish_reason):
            continue
        choice = choices.setdefault(offset + resp.index, Choice())
        choice.text.append(resp.text)
        choice.logprobs.extend(resp.logprobs)
        if resp.finish_reason:
            choice.finish_reason = resp.finish_reason
            choice.stop_reason = resp.stop_reason or None
    return choices, totals


async def _unless_disconnected(request: Request, streams: RouterStreams | EmbedCalls | BeamSteps, work):  # type: ignore[no-untyped-def]
    """Await `work`; if the client goes away first, cancel the router calls (freeing every worker's blocks)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    streams.cancel()
    task.cancel()
    raise client_closed()


async def _disconnected(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.2)


def _version() -> str:
    try:
        return importlib.metadata.version("pdserve")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


_VERSION = _version()


def _score_route(gw: Gateway):  # type: ignore[no-untyped-def]
    async def score(body: ScoreRequest, request: Request) -> Response:
        return await gw.scores(request, body, "score")

    return score


def _rerank_route(gw: Gateway):  # type: ignore[no-untyped-def]
    async def rerank(body: RerankRequest, request: Request) -> Response:
        return await gw.scores(request, body, "rerank")

    return rerank


def create_app(config: GatewayConfig) -> FastAPI:
    gw = Gateway(config)
    app = FastAPI(title="pdserve gateway", version=_VERSION, lifespan=gw.lifespan)
    app.router.route_class = OffLoopJSONRoute
    app.state.gateway = gw
    install_handlers(app)
    served = add_compat(gw.metrics.registry, config.metrics_compat)

    def refused(path: str, status: int) -> None:
        endpoint = endpoint_of(path)
        if endpoint is not None:
            gw.metrics.done(endpoint, status)

    # outermost last: access log, drain admission, auth, then the body limit (no body read before auth)
    app.add_middleware(BodyLimit, max_bytes=config.max_request_bytes, on_refused=refused)
    if gw.keys is not None:
        app.add_middleware(BearerAuth, keys=gw.keys, on_refused=refused)
    app.add_middleware(Admission, drain=gw.drain, on_refused=refused)
    app.add_middleware(AccessLog)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await gw.serve(request, body, "chat")

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        return await gw.respond(request, body)

    @app.get("/v1/responses/{response_id}")
    async def response(response_id: str, request: Request) -> dict:
        return gw.responses.get(record_of(request.scope).tenant, response_id)[0]

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request) -> dict:
        gw.responses.delete(record_of(request.scope).tenant, response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await gw.serve(request, body, "completions")

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        return await gw.embeddings(request, body)

    for path in ("/score", "/v1/score"):
        app.add_api_route(path, _score_route(gw), methods=["POST"])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.add_api_route(path, _rerank_route(gw), methods=["POST"])

    @app.post("/tokenize")
    async def tokenize(body: TokenizeChatRequest | TokenizeCompletionRequest) -> Response:
        return await gw.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Response:
        return await gw.detokenize(body)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [await gw.model_card()]}

    @app.get("/v1/models/{model:path}")  # a served name may hold slashes ("org/name")
    async def model(model: str) -> dict:
        card = await gw.model_card()
        if model != card["id"]:
            msg = f"The model {model!r} does not exist; this server serves {card['id']!r}"
            raise APIError(404, msg, "model", "model_not_found")
        return card

    @app.get("/version")
    async def version() -> dict:  # vLLM's: the server's version, open as /health is
        return {"version": _VERSION}

    @app.get("/health")
    async def health() -> Response:
        if gw.drain.draining:
            return JSONResponse({"status": "unavailable", "reason": "draining"}, status_code=503)
        reason = await gw.unhealthy()
        if reason is None:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(served), media_type=CONTENT_TYPE_LATEST)

    return app
