"""What the router tells a client when a request cannot go on: a status code and a plain sentence, never a
worker's raw transport text or a Python class name."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

SHUTTING_DOWN = "server shutting down"

# codes a decode call ends with when the worker (or the connection to it) went away
_GONE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN)


class Stop(Exception):
    """End the client's call with this status."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


@dataclass(frozen=True)
class DecodeFailure:
    stop: Stop
    worker_down: bool  # the decode worker itself is unreachable: route around it until it answers again


def decode_failure(exc: grpc.aio.AioRpcError, decode: str, prefill: str) -> DecodeFailure:
    """The client's status for a decode call that failed with `exc`.

    The decode worker's own messages are plain already, except where they carry a hop's transport text; a
    transport failure (or a server-side cancel: a worker dying or draining) becomes UNAVAILABLE.
    """
    code, details = exc.code(), exc.details() or ""
    if code in _GONE:
        if details.startswith("prefill worker"):
            return DecodeFailure(
                Stop(grpc.StatusCode.UNAVAILABLE, _retry(f"prefill worker {prefill} failed")), False
            )
        if details.startswith("KV transfer failed"):
            what = f"the KV transfer from prefill worker {prefill} to decode worker {decode} failed"
            return DecodeFailure(Stop(grpc.StatusCode.UNAVAILABLE, _retry(what)), False)
        if details == SHUTTING_DOWN:
            return DecodeFailure(
                Stop(grpc.StatusCode.UNAVAILABLE, _retry(f"decode worker {decode} is shutting down")), False
            )
        return DecodeFailure(
            Stop(grpc.StatusCode.UNAVAILABLE, _retry(f"decode worker {decode} became unavailable")), True
        )
    if code == grpc.StatusCode.INTERNAL:
        return DecodeFailure(
            Stop(code, f"decode worker {decode} failed on this request (an internal error)"), False
        )
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DecodeFailure(Stop(code, "the request ran past its deadline"), False)
    return DecodeFailure(
        Stop(code, details or f"decode worker {decode} refused the request ({code.name})"), False
    )


def _retry(what: str) -> str:
    return f"{what}; retry the request"
