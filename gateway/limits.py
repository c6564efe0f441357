"""Bodies the gateway refuses before anything parses them.

`BodyLimit` is a pure ASGI middleware. It refuses a declared `Content-Length` over `max_bytes` at once, and
otherwise counts the body as it streams in (chunked bodies too), refusing as soon as the count passes the
limit: 413 `request_too_large`, sent without reading the rest. uvicorn then discards the rest as it
arrives, so the client, still sending, reliably reads the 413 (a close with unread bytes would reset the
connection under it); a body with no length or one declared far past the limit closes the connection. A body
within the limit whose JSON nests deeper than `MAX_JSON_DEPTH` is a 400 (`json_too_deep`) before the JSON
parser (recursive) or pydantic see it. The app then gets the body in one message, and `OffLoopJSONRoute`
parses a large one in a worker thread, so the event loop keeps serving other requests meanwhile.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np
from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import APIError

MAX_JSON_DEPTH = 64
_DISCARD_BYTES = 64 * 1024 * 1024  # past the limit, at most this much is discarded on a kept connection
_OFF_LOOP_BYTES = 256 * 1024  # bodies this large are scanned and parsed in a worker thread

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = np.zeros(256, dtype=np.int32)
_STEP[list(b"[{")] = 1
_STEP[list(b"]}")] = -1


def json_too_deep(body: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether the JSON in `body` nests arrays and objects more than `limit` deep: a byte scan with strings
    removed, brackets counted +1 / -1, the running sum's peak."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    brackets = _STRING.sub(b"", body).translate(None, _NOT_BRACKET)
    if len(brackets) <= limit:
        return False
    depth = np.cumsum(_STEP[np.frombuffer(brackets, dtype=np.uint8)])  # (num_brackets,)
    return bool(depth.max() > limit)


def too_large(max_bytes: int) -> APIError:
    message = f"the request body is larger than this server accepts ({max_bytes} bytes)"
    return APIError(413, message, None, "request_too_large")


def too_deep() -> APIError:
    message = f"the request body nests JSON deeper than {MAX_JSON_DEPTH} levels"
    return APIError(400, message, None, "json_too_deep")


class BodyLimit:
    """ASGI middleware; `on_refused(path, status)` is told of every refusal (the metrics count them)."""

    def __init__(self, app: ASGIApp, max_bytes: int, on_refused: Callable[[str, int], None]) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.on_refused = on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        too_long = declared is not None and declared > self.max_bytes
        body = None if too_long else await self._read(receive)
        if body is None:
            close = declared is None or declared > self.max_bytes + _DISCARD_BYTES
            await self._refuse(too_large(self.max_bytes), scope, receive, send, close)
            return
        if await _too_deep(body):
            await self._refuse(too_deep(), scope, receive, send)
            return
        await self.app(scope, _replay(body, receive), send)

    async def _read(self, receive: Receive) -> bytes | None:
        """The whole body, or None as soon as it passes the limit; a disconnect ends it early (the app
        then sees the disconnect on its next receive)."""
        parts: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"".join(parts)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return None
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)

    async def _refuse(
        self, error: APIError, scope: Scope, receive: Receive, send: Send, close: bool = False
    ) -> None:
        self.on_refused(scope["path"], error.status)
        await error.response({"connection": "close"} if close else None)(scope, receive, send)


async def _too_deep(body: bytes) -> bool:
    if len(body) < _OFF_LOOP_BYTES:
        return json_too_deep(body)
    return await asyncio.to_thread(json_too_deep, body)  # a few passes over megabytes: off the loop


class _OffLoopJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            # a 2 MB body takes json.loads ~3 ms on a quiet core and several times that on a busy one; the
            # GIL is still held meanwhile, but in a thread the loop gets its turns between bodies
            self._json = (
                json.loads(body) if len(body) < _OFF_LOOP_BYTES else await asyncio.to_thread(json.loads, body)
            )
        return self._json


class OffLoopJSONRoute(APIRoute):
    """An APIRoute whose JSON body, when large, is parsed in a worker thread rather than on the event loop."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            return await handler(_OffLoopJSONRequest(request.scope, request.receive))

        return route


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay
