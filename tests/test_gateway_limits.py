"""The gateway under abuse and shutdown, against a scripted router: a real gRPC server in this process
whose replies the prompt chooses, and the gateway as its own process (`python -m gateway.cli`).

Prompts: "tokens N DELAY_S" streams N one-token chunks then finishes with "length"; "fail CODE N TEXT"
streams N chunks then ends the call with CODE and TEXT; "refuse CODE TEXT" ends it before any chunk.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc
from serving.roles import free_port

KEY = "sk-limits"
MODEL = "scripted"
LIMIT = 64 * 1024


class ScriptedRouter(pb_grpc.RouterServicer):
    def __init__(self, max_token_chars: int = 0) -> None:
        self.seen: set[str] = set()  # prompts whose call reached the router
        self.max_token_chars = max_token_chars

    def GetModelInfo(self, request, context):
        info = pb.ModelInfo(model=MODEL, max_model_len=1024, vocab_size=100, block_size=16)
        info.max_token_chars = self.max_token_chars
        return info

    def Generate(self, request, context):
        if request.WhichOneof("prompt") == "token_ids":
            prompt = f"tokens 1 0 ids {len(request.token_ids.ids)}"
        else:
            prompt = request.text or request.chat.messages[-1].content
        self.seen.add(prompt)
        words = prompt.split(" ", 3)
        if words[0] == "refuse":
            context.abort(grpc.StatusCode[words[1]], " ".join(words[2:]))
        count = int(words[1] if words[0] == "tokens" else words[2])
        delay = float(words[2]) if words[0] == "tokens" else 0.0
        for i in range(count):
            if not context.is_active():
                return
            yield pb.GenerateResponse(index=0, token_ids=[i], text=f"t{i} ")
            time.sleep(delay)
        if words[0] == "fail":
            context.abort(grpc.StatusCode[words[1]], words[3])
        usage = pb.Usage(prompt_tokens=3, completion_tokens=count)
        yield pb.GenerateResponse(index=0, finish_reason="length", usage=usage)


@pytest.fixture(scope="module")
def scripted():
    return ScriptedRouter()


@pytest.fixture(scope="module")
def router(scripted):
    yield from serve_router(scripted, health_pb2.HealthCheckResponse.SERVING)


def serve_router(servicer, status):
    """A gRPC server holding `servicer` whose health check answers `status`; yields its address."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=64))
    pb_grpc.add_RouterServicer_to_server(servicer, server)
    checks = health.HealthServicer()
    checks.set("", status)
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(grace=None)


@dataclass
class Gateway:
    proc: subprocess.Popen
    url: str
    log: Path

    def post(self, path: str, body, key: str | None = KEY, **kw) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.post(self.url + path, json=body, headers=headers, timeout=30, **kw)

    def output(self) -> str:
        return self.log.read_text()

    def wait_for_output(self, text: str, timeout: float = 10.0) -> str:
        deadline = time.monotonic() + timeout
        while text not in (out := self.output()):
            assert time.monotonic() < deadline, f"{text!r} not in the gateway's output:\n{out}"
            time.sleep(0.05)
        return out


def start_gateway(router: str, tmp: Path, *extra: str) -> Gateway:
    port = free_port()
    log = tmp / f"gateway-{port}.log"
    cmd = [sys.executable, "-m", "gateway.cli", "--router", router, "--port", str(port), "--api-key", KEY]
    cmd += ["--model", str(tmp), "--max-request-bytes", str(LIMIT), *extra]  # no tokenizer: token_id:N
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, log.read_text()
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return Gateway(proc, url, log)
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the gateway did not become healthy"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def gateway(router, tmp_path_factory):
    gw = start_gateway(router, tmp_path_factory.mktemp("gw"))
    yield gw
    gw.proc.terminate()
    gw.proc.wait(timeout=30)


def completion(prompt: str, stream: bool = False) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 5, "stream": stream}


def sse(response: httpx.Response) -> list[str]:
    return [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]


def assert_openai_error(body: dict, code: str) -> dict:
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code, body
    return error


# ---- request bodies --------------------------------------------------------------------------------


def test_declared_oversized_body_gets_413_without_being_read(gateway):
    body = b'{"model": "x", "prompt": "' + b"a" * (20 * 1024 * 1024) + b'"}'
    start = time.monotonic()
    r = httpx.post(
        gateway.url + "/v1/completions",
        content=body,
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 413
    error = assert_openai_error(r.json(), "request_too_large")
    assert error["type"] == "invalid_request_error" and error["param"] is None
    assert str(LIMIT) in error["message"]
    assert time.monotonic() - start < 5


def test_chunked_oversized_body_gets_413(gateway):
    def chunks():
        for _ in range(64):
            yield b"[" * 4096  # no Content-Length: the limit counts the chunks as they come

    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    r = httpx.post(gateway.url + "/v1/completions", content=chunks(), headers=headers, timeout=30)
    assert r.status_code == 413
    assert_openai_error(r.json(), "request_too_large")


def test_body_at_the_limit_is_parsed(gateway):
    prompt = "tokens 1 0 " + "x" * (LIMIT - 200)
    body = json.dumps(completion(prompt))
    assert len(body) <= LIMIT
    assert gateway.post("/v1/completions", json.loads(body)).status_code == 200


def test_a_prompt_too_long_for_its_size_is_refused_before_the_router(tmp_path):
    """With the router's bound of 4 characters a token, a prompt of C characters holds at least C / 4 tokens:
    one that cannot fit gets the router's own 400 from the gateway and never reaches the router. Bodies
    this large are parsed off the event loop, bad JSON included."""
    scripted = ScriptedRouter(max_token_chars=4)
    for address in serve_router(scripted, health_pb2.HealthCheckResponse.SERVING):
        gw = start_gateway(address, tmp_path, "--max-request-bytes", str(4 * 2**20))
        try:
            fits = "tokens 1 0 " + "x" * 4000  # at least 1003 tokens, and 5 to generate: 1008 of 1024
            assert gw.post("/v1/completions", completion(fits)).status_code == 200
            too_long = "tokens 1 0 " + "y" * (300 * 1024)
            r = gw.post("/v1/completions", completion(too_long))
            assert r.status_code == 400, r.text
            least = -(-len(too_long) // 4)
            assert assert_openai_error(r.json(), "context_length_exceeded")["message"] == (
                f"this model's maximum context length is 1024 tokens, but at least {least + 5} were requested "
                f"(at least {least} in the prompt, 5 to generate): shorten the prompt or lower max_tokens"
            )
            turns = [{"role": "user", "content": "tokens 1 0 " + "z" * 3000} for _ in range(2)]
            r = gw.post("/v1/chat/completions", {"model": MODEL, "messages": turns})  # up to the context
            assert r.status_code == 400, r.text
            message = assert_openai_error(r.json(), "context_length_exceeded")["message"]
            assert message.endswith(
                "the prompt alone is at least 1506 tokens long (6022 characters): shorten the prompt"
            )
            ids = gw.post("/v1/completions", {"model": MODEL, "prompt": [7] * 1020, "max_tokens": 5})
            assert ids.status_code == 400, ids.text
            assert assert_openai_error(ids.json(), "context_length_exceeded")["message"] == (
                "this model's maximum context length is 1024 tokens, but 1025 were requested (1020 in the prompt, "
                "5 to generate): shorten the prompt or lower max_tokens"
            )
            many = gw.post("/v1/completions", {"model": MODEL, "prompt": [7] * 300_000, "max_tokens": 5})
            assert assert_openai_error(many.json(), "context_length_exceeded")["message"] == (
                "the prompt is 300000 tokens long, but max_model_len is 1024"
            )
            fitting_ids = gw.post("/v1/completions", {"model": MODEL, "prompt": [7] * 1019, "max_tokens": 5})
            assert fitting_ids.status_code == 200, fitting_ids.text
            assert scripted.seen == {fits, "tokens 1 0 ids 1019"}
            unterminated = b'{"model": "scripted", "prompt": "' + b"a" * (300 * 1024)
            headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
            r = httpx.post(gw.url + "/v1/completions", content=unterminated, headers=headers, timeout=30)
            assert r.status_code == 400, r.text
            assert assert_openai_error(r.json(), "invalid_request")["message"].startswith(
                "the body is not valid JSON"
            )
        finally:
            gw.proc.terminate()
            gw.proc.wait(timeout=30)


@pytest.mark.parametrize("depth", [65, 1000, 9000])
def test_deeply_nested_json_is_a_400(gateway, depth):
    for raw in (
        "[" * depth,
        "[" * depth + "]" * depth,
        '{"model": ' + '{"a": ' * depth + "1" + "}" * depth + "}",
    ):
        headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
        r = httpx.post(gateway.url + "/v1/chat/completions", content=raw, headers=headers, timeout=30)
        assert r.status_code == 400, r.text
        assert_openai_error(r.json(), "json_too_deep")


def test_nesting_within_the_limit_is_an_ordinary_validation_error(gateway):
    prompt = [[[1]]]
    r = gateway.post("/v1/completions", {"model": MODEL, "prompt": json.loads("[" * 60 + "1" + "]" * 60)})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
    assert gateway.post("/v1/completions", {"model": MODEL, "prompt": prompt}).status_code == 400


# ---- auth ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER", "bEaReR"])
def test_bearer_scheme_is_case_insensitive(gateway, scheme):
    headers = {"Authorization": f"{scheme} {KEY}"}
    r = httpx.post(gateway.url + "/v1/completions", json=completion("tokens 1 0"), headers=headers)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("header", [f"Basic {KEY}", "Bearer", f"Bearer {KEY}x", f"Bearer{KEY}", ""])
def test_wrong_credentials_are_401(gateway, header):
    r = httpx.post(
        gateway.url + "/v1/completions", json=completion("tokens 1 0"), headers={"Authorization": header}
    )
    assert r.status_code == 401
    assert_openai_error(r.json(), "invalid_api_key")


# ---- router failures -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "code, text, status, kind, message",
    [
        ("UNAVAILABLE", "Stream removed (sendmsg: Connection reset by peer (104))", 503, "unavailable",
         "a worker became unavailable; retry the request"),
        ("UNAVAILABLE", "decode worker 127.0.0.1:4 became unavailable; retry the request", 503, "unavailable",
         "decode worker 127.0.0.1:4 became unavailable; retry the request"),
        ("CANCELLED", "server shutting down", 503, "unavailable", "server shutting down"),
        ("CANCELLED", "Socket closed", 503, "unavailable", "a worker became unavailable; retry the request"),
        ("DEADLINE_EXCEEDED", "Deadline Exceeded", 504, "timeout", "Deadline Exceeded"),
        ("RESOURCE_EXHAUSTED", "decode worker d0 has 256 requests queued", 429, "overloaded",
         "decode worker d0 has 256 requests queued"),
        ("INTERNAL", "Exception calling application: <class 'KeyError'>", 500, "internal_error",
         "the server failed to handle the request"),
        ("UNKNOWN", "Exception iterating responses: boom", 500, "internal_error",
         "the server failed to handle the request"),
    ],
)  # fmt: skip
def test_router_failures_reach_clients_as_plain_openai_errors(gateway, code, text, status, kind, message):
    r = gateway.post("/v1/completions", completion(f"refuse {code} {text}"))
    assert r.status_code == status
    error = assert_openai_error(r.json(), kind)
    assert error["message"] == message
    if status >= 500:
        assert error["type"] == "server_error"
    with httpx.stream(
        "POST", gateway.url + "/v1/completions", json=completion(f"fail {code} 2 {text}", stream=True),
        headers={"Authorization": f"Bearer {KEY}"}, timeout=30,
    ) as r:  # fmt: skip
        assert r.status_code == 200
        events = sse(r)
    assert events[-1] == "[DONE]" and len(events) == 4, events
    error = assert_openai_error(json.loads(events[-2]), kind)
    assert error["message"] == message


def test_access_log_gives_a_failed_streams_final_status(gateway):
    marker = f"fail UNAVAILABLE 3 Socket closed {time.monotonic()}"
    with httpx.stream(
        "POST", gateway.url + "/v1/completions", json=completion(marker, stream=True),
        headers={"Authorization": f"Bearer {KEY}"}, timeout=30,
    ) as r:  # fmt: skip
        assert r.status_code == 200
        sse(r)
    assert gateway.post("/v1/completions", completion("tokens 4 0")).status_code == 200
    out = gateway.wait_for_output("completion_tokens=4 ")
    lines = [x for x in out.splitlines() if "pdserve.access" in x and "/v1/completions" in x]
    assert any('"POST /v1/completions" 503 ' in x and "ttft=" in x for x in lines), lines
    assert any('"POST /v1/completions" 200 prompt_tokens=3 completion_tokens=4 ' in x for x in lines), lines
    assert "Traceback" not in out


def test_client_disconnect_is_499_in_the_access_log(gateway):
    with httpx.stream(
        "POST", gateway.url + "/v1/completions", json=completion("tokens 1000 0.01", stream=True),
        headers={"Authorization": f"Bearer {KEY}"}, timeout=30,
    ) as r:  # fmt: skip
        for i, _ in enumerate(r.iter_lines()):
            if i == 4:
                break
    out = gateway.wait_for_output('"POST /v1/completions" 499 ')
    assert "Traceback" not in out


def test_abuse_does_not_stall_other_requests(gateway):
    async def run():
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as client:

            async def big(size: int) -> tuple[int, float]:
                start = time.monotonic()
                body = b'{"model": "scripted", "prompt": "' + b"a" * size + b'"}'
                r = await client.post(gateway.url + "/v1/completions", content=body)
                return r.status_code, time.monotonic() - start

            async def normal() -> int:
                return (
                    await client.post(gateway.url + "/v1/completions", json=completion("tokens 3 0"))
                ).status_code

            return await asyncio.gather(
                *(big(2 * 1024 * 1024) for _ in range(10)), big(20 * 1024 * 1024), normal()
            )

    *refused, ok = asyncio.run(run())
    assert ok == 200
    assert all(status == 413 and took < 5 for status, took in refused), refused


# ---- draining --------------------------------------------------------------------------------------


def _open_streams(gw: Gateway, prompt: str, count: int):
    client = httpx.Client(headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    streams = []
    for _ in range(count):
        cm = client.stream("POST", gw.url + "/v1/completions", json=completion(prompt, stream=True))
        r = cm.__enter__()
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")  # running
        streams.append((cm, lines))
    return client, streams


def _rest(lines) -> list[str]:
    return [x.removeprefix("data: ") for x in lines if x.startswith("data: ")]


def _refuses_while_draining(gw: Gateway) -> None:
    deadline = time.monotonic() + 5
    while (h := httpx.get(gw.url + "/health", timeout=5)).status_code == 200:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert h.status_code == 503 and h.json()["reason"] == "draining"
    r = gw.post("/v1/completions", completion("tokens 1 0"))
    assert r.status_code == 503
    error = assert_openai_error(r.json(), "unavailable")
    assert error["message"] == "server shutting down" and error["type"] == "server_error"


def test_sigterm_lets_streams_finish_within_the_drain_timeout(router, tmp_path):
    gw = start_gateway(router, tmp_path, "--drain-timeout-s", "30")
    try:
        client, streams = _open_streams(gw, "tokens 30 0.05", 4)
        gw.proc.send_signal(signal.SIGTERM)
        _refuses_while_draining(gw)
        for cm, lines in streams:
            events = _rest(lines)
            assert (
                events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
            )
            cm.__exit__(None, None, None)
        assert gw.proc.wait(timeout=30) == 0
    finally:
        gw.proc.kill()
    out = gw.output()
    assert "Traceback" not in out and "every request finished" in out


def test_sigterm_past_the_drain_timeout_ends_streams_with_an_error_event(router, scripted, tmp_path):
    gw = start_gateway(router, tmp_path, "--drain-timeout-s", "1")
    try:
        client, streams = _open_streams(gw, "tokens 100000 0.02", 4)
        prompt = f"tokens 100000 0.02 whole {time.monotonic()}"  # and a whole-response request in flight
        whole: list[httpx.Response] = []
        waiter = threading.Thread(target=lambda: whole.append(gw.post("/v1/completions", completion(prompt))))
        waiter.start()
        deadline = time.monotonic() + 10
        while prompt not in scripted.seen:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        gw.proc.send_signal(signal.SIGTERM)
        _refuses_while_draining(gw)
        for cm, lines in streams:
            events = _rest(lines)
            assert events[-1] == "[DONE]", events[-3:]
            assert json.loads(events[-2]) == {
                "error": {"message": "server shutting down", "type": "server_error", "param": None,
                          "code": "unavailable"}
            }  # fmt: skip
            cm.__exit__(None, None, None)
        waiter.join(timeout=30)
        assert whole and whole[0].status_code == 503
        assert assert_openai_error(whole[0].json(), "unavailable")["message"] == "server shutting down"
        assert gw.proc.wait(timeout=30) == 0
    finally:
        gw.proc.kill()
    out = gw.output()
    assert "Traceback" not in out and "stopped" in out


def test_a_second_signal_ends_the_drain_at_once(router, tmp_path):
    gw = start_gateway(router, tmp_path, "--drain-timeout-s", "600")
    try:
        client, streams = _open_streams(gw, "tokens 100000 0.02", 2)
        gw.proc.send_signal(signal.SIGINT)  # Ctrl-C drains as SIGTERM does
        _refuses_while_draining(gw)
        gw.proc.send_signal(signal.SIGTERM)
        for cm, lines in streams:
            events = _rest(lines)
            assert events[-1] == "[DONE]"
            assert (
                assert_openai_error(json.loads(events[-2]), "unavailable")["message"]
                == "server shutting down"
            )
            cm.__exit__(None, None, None)
        assert gw.proc.wait(timeout=30) == 0
    finally:
        gw.proc.kill()
    assert "Traceback" not in gw.output()


class UnroutableRouter(pb_grpc.RouterServicer):
    """A router whose workers are gone: NOT_SERVING, and GetModelInfo says why."""

    REASON = "no live decode worker (1 known: 127.0.0.1:9 down)"

    def GetModelInfo(self, request, context):
        context.abort(grpc.StatusCode.UNAVAILABLE, self.REASON)


@pytest.fixture
def unroutable():
    yield from serve_router(UnroutableRouter(), health_pb2.HealthCheckResponse.NOT_SERVING)


def test_health_gives_the_routers_reason_when_it_cannot_route(unroutable, tmp_path):
    port = free_port()
    log = tmp_path / "gateway.log"
    cmd = [sys.executable, "-m", "gateway.cli", "--router", unroutable, "--port", str(port)]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
                break
            except httpx.HTTPError:
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
        assert r.status_code == 503
        assert r.json() == {"status": "unavailable", "reason": UnroutableRouter.REASON}
    finally:
        proc.terminate()
        proc.wait(timeout=30)
