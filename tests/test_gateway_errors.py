"""How router statuses become OpenAI-shaped HTTP errors (the cases a CPU cluster cannot easily provoke)."""

import grpc
import pytest

from gateway.errors import from_grpc


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


@pytest.mark.parametrize(
    "code, details, status, kind",
    [
        (grpc.StatusCode.INVALID_ARGUMENT, "the prompt is 9000 tokens long, but max_model_len is 8192", 400,
         "invalid_request_error"),
        (grpc.StatusCode.INVALID_ARGUMENT, "unknown model 'x'; this server serves 'y'", 404, "not_found_error"),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "decode worker d0 has 256 requests queued", 429, "rate_limit_error"),
        (grpc.StatusCode.UNAVAILABLE, "no live decode worker", 503, "server_error"),
    ],
)  # fmt: skip
def test_router_status_maps_to_http(code, details, status, kind):
    err = from_grpc(rpc_error(code, details))
    assert err.status == status
    body = err.body()["error"]
    assert body["type"] == kind and body["message"] == details
    assert set(body) == {"message", "type", "param", "code"}
