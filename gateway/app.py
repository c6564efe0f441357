"""The OpenAI-compatible HTTP gateway: FastAPI to users, grpc.aio to the router.

`create_app(GatewayConfig(router="HOST:PORT"))` gives the ASGI app; `gateway/cli.py` serves it with uvicorn.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import ASGIApp, Receive, Scope, Send

from engine.grpc_common import CHANNEL_OPTIONS
from engine.tokenizer import Tokenizer
from gateway.errors import APIError, from_grpc, install_handlers
from gateway.metrics import GatewayMetrics
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.responses import Choice, Formatter, TokenText, Totals
from gateway.router_client import RouterStreams, build, chat_requests, completion_requests
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GatewayConfig:
    router: str  # host:port of pdserve.v1.Router
    api_key: str | None = None  # bearer token the /v1 endpoints require; None: open
    model_dir: str | None = None  # tokenizer for logprobs' token text; None: the bundled model's


def _load_tokenizer(model_dir: str | None) -> Tokenizer | None:
    try:
        if model_dir is None:
            from engine.roles import model_dir as resolve

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
        self.channel: grpc.aio.Channel | None = None
        self.stub: pb_grpc.RouterStub | None = None
        self.token_text = TokenText(None)
        self._info: pb.ModelInfo | None = None

    @asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        self.channel = grpc.aio.insecure_channel(self.config.router, options=CHANNEL_OPTIONS)
        self.stub = pb_grpc.RouterStub(self.channel)
        self.token_text = TokenText(await asyncio.to_thread(_load_tokenizer, self.config.model_dir))
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

    async def healthy(self) -> bool:
        assert self.channel is not None
        try:
            reply = await health_pb2_grpc.HealthStub(self.channel).Check(
                health_pb2.HealthCheckRequest(), timeout=2
            )
            await self.model_info(fresh=True)
        except (grpc.aio.AioRpcError, APIError):
            return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    async def serve(
        self, request: Request, body: ChatCompletionRequest | CompletionRequest, endpoint: str
    ) -> Response:
        start = time.monotonic()
        chat = isinstance(body, ChatCompletionRequest)
        try:
            info = await self.model_info()
            if body.model != info.model:
                msg = f"The model {body.model!r} does not exist; this server serves {info.model!r}"
                raise APIError(404, msg, "model", "model_not_found")
            if isinstance(body, ChatCompletionRequest):
                reqs = build(lambda: chat_requests(body))
            else:
                reqs = build(lambda: completion_requests(body))
            assert self.stub is not None
            streams = RouterStreams(self.stub, reqs)
            await _unless_disconnected(request, streams, streams.start())
            self.metrics.ttft.labels(endpoint).observe(time.monotonic() - start)
            fmt = Formatter(chat, info.model, body.num_logprobs(), self.token_text)
            if body.stream:
                events = self._events(streams, fmt, body.include_usage, endpoint, start)
                return _EventStream(events, media_type="text/event-stream")
            choices, totals = await _unless_disconnected(request, streams, _collect(streams))
        except APIError as exc:
            self.metrics.done(endpoint, exc.status)
            return exc.response()
        self._finished(endpoint, 200, totals, start)
        return JSONResponse(fmt.whole(choices, totals))

    def _finished(self, endpoint: str, status: int, totals: Totals, start: float) -> None:
        self.metrics.done(endpoint, status, totals.prompt_tokens, totals.completion_tokens)
        self.metrics.e2e.labels(endpoint).observe(time.monotonic() - start)

    async def _events(
        self, streams: RouterStreams, fmt: Formatter, include_usage: bool, endpoint: str, start: float
    ) -> AsyncIterator[str]:
        """Server-sent events; a client disconnect cancels this generator, which cancels the router calls."""
        choices: dict[int, Choice] = {}
        totals, status = Totals(), 499
        try:
            async for offset, resp in streams:
                if resp.HasField("usage"):
                    totals.add(resp.usage)
                if not (resp.token_ids or resp.text or resp.finish_reason):
                    continue
                index = offset + resp.index
                first = index not in choices
                choice = choices.setdefault(index, Choice())
                yield _sse(fmt.chunk(index, resp, choice, first))
            if include_usage:
                yield _sse(fmt.usage_chunk(totals))
            status = 200
        except APIError as exc:
            status = exc.status
            yield _sse(exc.body())
        finally:
            streams.cancel()
            self._finished(endpoint, status, totals, start)
        yield "data: [DONE]\n\n"


class _EventStream(StreamingResponse):
    """Closes its generator however the response ends, so the router calls are always cancelled."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


class _BearerAuth:
    """ASGI middleware: paths under /v1/ need `Authorization: Bearer KEY`; /health and /metrics stay open."""

    def __init__(self, app: ASGIApp, key: str, metrics: GatewayMetrics) -> None:
        self.app = app
        self.expected = f"Bearer {key}".encode()
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                error = APIError(401, "invalid or missing API key", None, "invalid_api_key")
                endpoint = scope["path"].removeprefix("/v1/").split("/")[0]
                if endpoint in ("chat", "completions"):
                    self.metrics.done(endpoint, 401)
                await error.response({"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _collect(streams: RouterStreams) -> tuple[dict[int, Choice], Totals]:
    choices: dict[int, Choice] = {}
    totals = Totals()
    async for offset, resp in streams:
        if resp.HasField("usage"):
            totals.add(resp.usage)
        if not (resp.token_ids or resp.text or resp.finish_reason):
            continue
        choice = choices.setdefault(offset + resp.index, Choice())
        choice.text.append(resp.text)
        choice.logprobs.extend(resp.logprobs)
        if resp.finish_reason:
            choice.finish_reason = resp.finish_reason
            choice.stop_reason = resp.stop_reason or None
    return choices, totals


async def _unless_disconnected(request: Request, streams: RouterStreams, work):  # type: ignore[no-untyped-def]
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
    raise APIError(499, "the client closed the request")


async def _disconnected(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.2)


def create_app(config: GatewayConfig) -> FastAPI:
    gw = Gateway(config)
    app = FastAPI(title="pdserve gateway", version="0.1", lifespan=gw.lifespan)
    app.state.gateway = gw
    install_handlers(app)
    if config.api_key:
        app.add_middleware(_BearerAuth, key=config.api_key, metrics=gw.metrics)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await gw.serve(request, body, "chat")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await gw.serve(request, body, "completions")

    @app.get("/v1/models")
    async def models() -> dict:
        info = await gw.model_info()
        card = {"id": info.model, "object": "model", "created": 0, "owned_by": "pdserve"}
        return {"object": "list", "data": [{**card, "max_model_len": info.max_model_len}]}

    @app.get("/health")
    async def health() -> Response:
        if await gw.healthy():
            return JSONResponse({"status": "ok"})
        return APIError(503, "the router or its workers are not serving").response()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(gw.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
