"""One access-log line per request, at logger `pdserve.access`, written when the response really ends.

The status is the one the client finally got: a stream that started with 200 and then failed carries the
error's status (the handler sets `AccessRecord.status`), a client that went away is 499.

The request id is the client's `X-Request-Id` (printable ASCII, no spaces, up to 128 characters; another is
ignored) or, without one, the id the router made (the handler sets `AccessRecord.request_id` from its first
reply); the response echoes it in `X-Request-Id`, and every line logged while the request is served carries
it (serving/logs.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serving.logs import bind_request

logger = logging.getLogger("pdserve.access")
_KEY = "pdserve.access"
_HEADER = b"x-request-id"
_MAX_ID = 128


@dataclass
class AccessRecord:
    method: str = "-"
    path: str = "-"
    client: str = "-"
    start: float = field(default_factory=time.monotonic)
    status: int | None = None  # final status, when the handler knows better than the response's start line
    sent_status: int | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft: float | None = None
    request_id: str | None = None
    tenant: str | None = None  # set by the auth middleware (gateway/auth.py); never logged

    def first_token(self) -> None:
        if self.ttft is None:
            self.ttft = time.monotonic() - self.start

    def identify(self, rid: str) -> None:
        """The request's id, once known; lines logged from the calling task carry it from now on."""
        if rid and self.request_id is None:
            self.request_id = rid
            bind_request(rid)

    def fields(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "path": self.path,
            "client": self.client,
            "status": self.status or self.sent_status or 500,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "ttft_s": None if self.ttft is None else round(self.ttft, 6),
            "duration_s": round(time.monotonic() - self.start, 6),
        }

    def line(self, fields: dict[str, Any]) -> str:
        ttft = "-" if fields["ttft_s"] is None else f"{fields['ttft_s']:.3f}s"
        return (
            f'{self.client} "{self.method} {self.path}" {fields["status"]} '
            f"prompt_tokens={self.prompt_tokens} completion_tokens={self.completion_tokens} "
            f"ttft={ttft} duration={fields['duration_s']:.3f}s request_id={self.request_id or '-'}"
        )


def record_of(scope: Scope) -> AccessRecord:
    """The request's record (a detached one when the middleware is not installed)."""
    record = scope.get(_KEY)
    return record if isinstance(record, AccessRecord) else AccessRecord()


class AccessLog:
    """ASGI middleware: keeps an `AccessRecord` in the scope and logs it when the app returns."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        client = scope.get("client")
        record = AccessRecord(scope["method"], scope["path"], f"{client[0]}:{client[1]}" if client else "-")
        scope[_KEY] = record
        record.identify(client_request_id(scope))

        async def watched(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.sent_status = message["status"]
                if record.request_id:
                    headers = [h for h in message.get("headers", []) if h[0].lower() != _HEADER]
                    message["headers"] = [*headers, (_HEADER, record.request_id.encode())]
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except asyncio.CancelledError:
            record.status = record.status or 499
            raise
        except Exception:
            record.status = record.status or 500
            raise
        finally:
            fields = record.fields()
            logger.info(record.line(fields), extra={"request_id": record.request_id, "fields": fields})


def client_request_id(scope: Scope) -> str:
    """The request's `X-Request-Id`, "" when it has none or one that is not a plain token."""
    for name, value in scope.get("headers", []):
        if name.lower() == _HEADER:
            rid = value.decode("latin-1")
            return (
                rid
                if 0 < len(rid) <= _MAX_ID and rid.isascii() and rid.isprintable() and " " not in rid
                else ""
            )
    return ""
