"""Bearer-token auth for the /v1 endpoints; /health and /metrics stay open."""

from __future__ import annotations

import secrets
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import APIError


def bearer_token(header: bytes) -> bytes | None:
    """The token of an `Authorization: Bearer TOKEN` header; the scheme is case-insensitive (RFC 7235)."""
    scheme, _, token = header.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    return token.strip()


class BearerAuth:
    """ASGI middleware: paths under /v1/ need the key; the comparison takes the same time wherever the
    given token differs. `on_refused(path, status)` is told of every refusal."""

    def __init__(self, app: ASGIApp, key: str, on_refused: Callable[[str, int], None]) -> None:
        self.app = app
        self.expected = key.encode()
        self.on_refused = on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            token = bearer_token(dict(scope["headers"]).get(b"authorization", b""))
            if not secrets.compare_digest(token or b"", self.expected):
                self.on_refused(scope["path"], 401)
                error = APIError(401, "invalid or missing API key", None, "invalid_api_key")
                await error.response({"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)
