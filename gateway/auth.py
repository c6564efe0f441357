"""Bearer-token auth for the /v1 endpoints and vLLM's paths outside it (/tokenize, /detokenize, /score, /rerank);
/health and /metrics stay open. A key may name a tenant (gateway/tenants.py): the request's access record carries
it on, for its cache salt and rate limits."""

from __future__ import annotations

from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.access import record_of
from gateway.errors import MODEL_PATHS, APIError
from gateway.tenants import TenantKeys

# vLLM's paths outside /v1: they use the router's tokenizer, or run the model
KEYED = frozenset({"/tokenize", "/detokenize"}) | MODEL_PATHS


def bearer_token(header: bytes) -> bytes | None:
    """The token of an `Authorization: Bearer TOKEN` header; the scheme is case-insensitive (RFC 7235)."""
    scheme, _, token = header.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    return token.strip()


class BearerAuth:
    """ASGI middleware: paths under /v1/ (and KEYED) need a key of `keys`; keys are looked up by their SHA-256, so the
    time taken says nothing about how close a wrong token came. `on_refused(path, status)` is told of
    every refusal."""

    def __init__(self, app: ASGIApp, keys: TenantKeys, on_refused: Callable[[str, int], None]) -> None:
        self.app = app
        self.keys = keys
        self.on_refused = on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (scope["path"].startswith("/v1/") or scope["path"] in KEYED):
            token = bearer_token(dict(scope["headers"]).get(b"authorization", b""))
            known, tenant = self.keys.lookup(token or b"") if token else (False, None)
            if not known:
                self.on_refused(scope["path"], 401)
                error = APIError(401, "invalid or missing API key", None, "invalid_api_key")
                await error.response({"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
            record_of(scope).tenant = tenant
        await self.app(scope, receive, send)
