"""One access-log line per request, at logger `pdserve.access`, written when the response really ends.

The status is the one the client finally got: a stream that started with 200 and then failed carries the
error's status (the handler sets `AccessRecord.status`), a client that went away is 499.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger("pdserve.access")
_KEY = "pdserve.access"


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

    def first_token(self) -> None:
        if self.ttft is None:
            self.ttft = time.monotonic() - self.start

    def line(self) -> str:
        ttft = "-" if self.ttft is None else f"{self.ttft:.3f}s"
        return (
            f'{self.client} "{self.method} {self.path}" {self.status or self.sent_status or 500} '
            f"prompt_tokens={self.prompt_tokens} completion_tokens={self.completion_tokens} "
            f"ttft={ttft} duration={time.monotonic() - self.start:.3f}s"
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

        async def watched(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.sent_status = message["status"]
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
            logger.info(record.line())
