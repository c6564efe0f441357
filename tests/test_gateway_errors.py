"""How router statuses become OpenAI-shaped HTTP errors (the cases a CPU cluster cannot easily provoke),
and the gateway's cheap checks on what it is sent."""

import grpc
import pytest

from gateway.auth import bearer_token
from gateway.errors import from_grpc, is_plain
from gateway.limits import json_too_deep

WORKER_GONE = "a worker became unavailable; retry the request"


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


@pytest.mark.parametrize(
    "code, details, status, kind, error_code, message",
    [
        (grpc.StatusCode.INVALID_ARGUMENT, "the prompt is 9000 tokens long, but max_model_len is 8192", 400,
         "invalid_request_error", "context_length_exceeded", None),
        (grpc.StatusCode.INVALID_ARGUMENT, "unknown model 'x'; this server serves 'y'", 404, "not_found_error",
         "model_not_found", None),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "decode worker d0 has 256 requests queued", 429, "rate_limit_error",
         "overloaded", None),
        (grpc.StatusCode.UNAVAILABLE, "no live decode worker", 503, "server_error", "unavailable", None),
        (grpc.StatusCode.UNAVAILABLE, "decode worker 127.0.0.1:5 became unavailable; retry the request", 503,
         "server_error", "unavailable", None),
        (grpc.StatusCode.UNAVAILABLE, "Stream removed (sendmsg: Connection reset by peer (104))", 503,
         "server_error", "unavailable", WORKER_GONE),
        (grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses; last error: UNKNOWN: "
         "ipv4:127.0.0.1:1: Failed to connect to remote host: Connection refused", 503, "server_error",
         "unavailable", WORKER_GONE),
        (grpc.StatusCode.UNAVAILABLE, "", 503, "server_error", "unavailable", WORKER_GONE),
        (grpc.StatusCode.CANCELLED, "server shutting down", 503, "server_error", "unavailable", None),
        (grpc.StatusCode.CANCELLED, "Socket closed", 503, "server_error", "unavailable", WORKER_GONE),
        (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", 504, "server_error", "timeout", None),
        (grpc.StatusCode.INTERNAL, "Exception calling application: <class 'KeyError'>", 500, "server_error",
         "internal_error", "the server failed to handle the request"),
        (grpc.StatusCode.UNKNOWN, "Unexpected error", 500, "server_error", "internal_error", None),
    ],
)  # fmt: skip
def test_router_status_maps_to_http(code, details, status, kind, error_code, message):
    err = from_grpc(rpc_error(code, details))
    assert err.status == status
    body = err.body()["error"]
    assert body["type"] == kind and body["code"] == error_code
    assert body["message"] == (message or details)
    assert set(body) == {"message", "type", "param", "code"}


@pytest.mark.parametrize(
    "message, plain",
    [
        ("server shutting down", True),
        ("decode worker 127.0.0.1:7 became unavailable; retry the request", True),
        ("recvmsg:Connection reset by peer", False),
        ("Exception iterating responses: 'NoneType'", False),
        ("<class 'RuntimeError'>", False),
        ("   ", False),
    ],
)
def test_transport_text_is_not_plain(message, plain):
    assert is_plain(message) is plain


@pytest.mark.parametrize(
    "header, token",
    [
        (b"Bearer k1", b"k1"),
        (b"bearer k1", b"k1"),
        (b"BEARER  k1 ", b"k1"),
        (b"Basic k1", None),
        (b"Bearerk1", None),
        (b"", None),
    ],
)
def test_bearer_scheme_is_case_insensitive(header, token):
    assert bearer_token(header) == token


@pytest.mark.parametrize(
    "body, deep",
    [
        (b'{"messages": [{"role": "user", "content": "hi"}]}', False),
        (b"[" * 64 + b"]" * 64, False),
        (b"[" * 65 + b"]" * 65, True),
        (b"[" * 100_000, True),
        (b'{"a": "' + b"[" * 1000 + b'"}', False),  # brackets inside a string do not nest
        (b'{"a": "\\"' + b"[" * 1000 + b'"}', False),  # nor after an escaped quote
        (b"[" + b"[1]," * 10_000 + b"[1]]", False),  # wide, not deep
        (b'{"a": ' * 65 + b"1" + b"}" * 65, True),
    ],
)
def test_json_depth_scan(body, deep):
    assert json_too_deep(body) is deep
