"""Log lines of every role: `--log-format text` (the default) or `json`, one object a line.

A JSON line carries timestamp (ISO 8601, UTC), level, logger, message, role, address (the process's listen
address) and, where a request is in play, request_id; a record's `extra={"fields": {...}}` adds keys (the
gateway's access line). The request id comes from `request_id`, a context variable: a handler that serves
one request in its own task calls `bind_request(rid)` once, and every line logged from that task, and from
the tasks it starts, carries it. grpc.aio runs each call, and serving/mux.py each multiplexed call, in a
task of its own, so the id holds for exactly one request.

`setup_logging` configures the root logger once per process; the worker's engine process gets the same
setup (`current()`, passed to it at spawn) so its lines look like its server's.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import uuid
from contextvars import ContextVar
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any, TextIO

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

request_id: ContextVar[str | None] = ContextVar("pdserve_request_id", default=None)


@dataclass(frozen=True)
class LogSetup:
    format: str = "text"
    level: str = "WARNING"
    role: str | None = None  # router, prefill, decode, gateway, up
    address: str | None = None  # host:port the process listens on

    def __post_init__(self) -> None:
        if self.format not in LOG_FORMATS:
            raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {self.format!r}")


_current = LogSetup()


def add_log_format_arg(p: argparse.ArgumentParser, default: str = "text") -> None:
    p.add_argument(
        "--log-format",
        default=default,
        choices=LOG_FORMATS,
        help="text lines, or one JSON object a line with role, address and request_id (default: text)",
    )


def current() -> LogSetup:
    return _current


def new_request_id() -> str:
    return f"r-{uuid.uuid4().hex[:16]}"


def bind_request(rid: str) -> None:
    """The request this task (and the tasks it starts from now on) serves, for its log lines."""
    request_id.set(rid)


class ContextFilter(logging.Filter):
    """Stamps every record with the process's role and address and the task's request id (a record's own
    `extra={"request_id": ...}` wins)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.role = _current.role
        record.address = _current.address
        if getattr(record, "request_id", None) is None:
            record.request_id = request_id.get()
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stamp = datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds")
        line: dict[str, Any] = {
            "timestamp": stamp.replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "role": getattr(record, "role", None),
            "address": getattr(record, "address", None),
        }
        rid = getattr(record, "request_id", None)
        if rid is not None:
            line["request_id"] = rid
        line.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line, ensure_ascii=False, default=str)


def make_handler(stream: TextIO, text_format: str = TEXT_FORMAT) -> logging.Handler:
    """A handler in the process's format (text: `text_format`), its records stamped by ContextFilter."""
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter() if _current.format == "json" else logging.Formatter(text_format))
    handler.addFilter(ContextFilter())
    return handler


def setup_logging(setup: LogSetup) -> None:
    """The root logger writes `setup`'s format to stderr at `setup.level`; Python warnings go through it."""
    global _current
    _current = setup
    root = logging.getLogger()
    for old in root.handlers[:]:
        root.removeHandler(old)
    root.addHandler(make_handler(sys.stderr))
    root.setLevel(setup.level.upper())
    logging.captureWarnings(setup.format == "json")


def identify(role: str | None = None, address: str | None = None) -> None:
    """Name this process in its log lines, once it knows its role and listen address (None: kept)."""
    global _current
    _current = replace(_current, role=role or _current.role, address=address or _current.address)


def announce(message: str) -> None:
    """A status line for whoever runs the process, shown at any log level: printed to stdout as it is, or
    in the json format as an INFO line of logger `pdserve`."""
    if _current.format != "json":
        print(message, flush=True)
        return
    record = logging.LogRecord("pdserve", logging.INFO, __file__, 0, message, None, None)
    ContextFilter().filter(record)
    print(JsonFormatter().format(record), flush=True)
