"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}`, and where they come from.

A user's mistake is a 4xx: validation errors (FastAPI's 422 becomes 400), bad sampling values or a prompt
over max_model_len (the router's INVALID_ARGUMENT), an unknown model (404), a body over the size limit
(413). Load is 429, no router or worker is 503, a deadline 504. Only the server's own faults are 5xx, and
their messages are plain sentences: transport text (`Stream removed`, `ipv4:...`) and class reprs stay in
the gateway's log.
"""

from __future__ import annotations

import logging
from http import HTTPStatus

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

_SERVER_SIDE = {  # status, code, the sentence a client sees when the router's own words are transport text
    grpc.StatusCode.UNAVAILABLE: (503, "unavailable", "a worker became unavailable; retry the request"),
    grpc.StatusCode.CANCELLED: (503, "unavailable", "a worker became unavailable; retry the request"),
    grpc.StatusCode.ABORTED: (503, "unavailable", "a worker became unavailable; retry the request"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout", "the request timed out"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (
        429,
        "overloaded",
        "the server is overloaded; retry the request later",
    ),
}
_INTERNAL = (500, "internal_error", "the server failed to handle the request")
_CLIENT_SIDE = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.NOT_FOUND: 404,
}
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}
# Words that mark a message as transport or Python text rather than a sentence written for people.
_TRANSPORT_WORDS = (
    "stream removed",
    "sendmsg",
    "recvmsg",
    "socket closed",
    "failed to connect",
    "connection reset",
    "connection refused",
    "ipv4:",
    "ipv6:",
    "unix:",
    "exception",
    "traceback",
    "<class",
    "errno",
    "rst_stream",
    "grpc_",
    "locally cancelled",
)

SHUTTING_DOWN = "server shutting down"


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers  # sent with the response (Retry-After on a 429)

    def body(self) -> dict:
        kind = _TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers or self.headers)


def shutting_down() -> APIError:
    return APIError(503, SHUTTING_DOWN, None, "unavailable")


def client_closed() -> APIError:
    return APIError(499, "the client closed the request", None, "client_closed")


def is_plain(message: str) -> bool:
    """A sentence fit for a client: not empty, not transport text, not a Python repr."""
    low = message.lower()
    return bool(message.strip()) and not any(word in low for word in _TRANSPORT_WORDS)


_CONTEXT_WORDS = ("this model's maximum context length", "but max_model_len is")  # router/server.py's words


def from_grpc(exc: grpc.aio.AioRpcError) -> APIError:
    """The router's status as an HTTP error. CANCELLED here comes from the server side: a call the gateway
    cancels itself never reaches this (its reads raise asyncio.CancelledError instead)."""
    code = exc.code()
    message = exc.details() or ""
    if code in _CLIENT_SIDE:
        if code == grpc.StatusCode.INVALID_ARGUMENT and message.startswith("unknown model"):
            return APIError(404, message, "model", "model_not_found")
        if code == grpc.StatusCode.INVALID_ARGUMENT and any(w in message for w in _CONTEXT_WORDS):
            return APIError(400, message, None, "context_length_exceeded")  # OpenAI's code for it
        return APIError(_CLIENT_SIDE[code], message or "invalid request", None, code.name.lower())
    status, kind, sentence = _SERVER_SIDE.get(code, _INTERNAL)
    if status == 500:
        logger.error("router failed: %s %s", code.name, message)
    elif not is_plain(message):
        logger.warning("router call ended with %s: %s", code.name, message)
    return APIError(status, message if is_plain(message) else sentence, None, kind)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    parts, param = [], None
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            return f"the body is not valid JSON: {err.get('ctx', {}).get('error', 'decode error')}", None
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        where = ".".join(loc)
        param = param or (where or None)
        parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    return "; ".join(parts) or "invalid request", param


MODEL_PATHS = frozenset({"/score", "/rerank", "/v2/rerank"})  # vLLM's paths outside /v1 that run the model


def endpoint_of(path: str) -> str | None:
    """The metrics label of an OpenAI endpoint's path; None for other paths."""
    return {
        "/v1/chat/completions": "chat",
        "/v1/completions": "completions",
        "/v1/responses": "responses",
        "/v1/embeddings": "embeddings",
        "/score": "score",
        "/v1/score": "score",
        "/rerank": "rerank",
        "/v1/rerank": "rerank",
        "/v2/rerank": "rerank",
    }.get(path)


def _count(request: Request, status: int) -> None:
    """Requests refused before the gateway's handler ran still count in the metrics, when they hit an endpoint."""
    gateway = getattr(request.app.state, "gateway", None)
    endpoint = endpoint_of(request.url.path)
    if gateway is not None and endpoint is not None:
        gateway.metrics.done(endpoint, status)


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        _count(request, 400)
        return APIError(400, message, param, "invalid_request").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        try:
            phrase = HTTPStatus(exc.status_code).phrase
        except ValueError:
            phrase = "error"
        message = exc.detail if isinstance(exc.detail, str) else phrase
        _count(request, exc.status_code)
        return APIError(exc.status_code, message).response(headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> JSONResponse:
        """A fault of the gateway itself; uvicorn logs its traceback, the client gets a plain 500."""
        _count(request, 500)
        return APIError(500, _INTERNAL[2], None, _INTERNAL[1]).response()
