"""`--log-format json` end to end: every process of the stack writes JSON lines, one request id travels
gateway -> router -> decode -> prefill, and the gateway's access line matches the response; plus the
formatter and the request context in one process."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import httpx
import openai
import pytest

from serving import logs
from serving.roles import free_port
from tests.cluster import Cluster, start_cluster

REQUIRED = ("timestamp", "level", "logger", "message", "role", "address")
# lines `pdserve up` and the gateway print for tools (not log records): the cluster's listing and the URL
ANNOUNCEMENTS = ("pdserve ready: ", "pdserve cluster: ", "pdserve gateway: http://")


@pytest.fixture
def json_setup():
    before = logs.current()
    stream = io.StringIO()
    logs.setup_logging(logs.LogSetup("json", "INFO"))
    logs.identify("decode", "127.0.0.1:5")
    root = logging.getLogger()
    root.handlers[0].setStream(stream)  # type: ignore[attr-defined]
    try:
        yield stream
    finally:
        logs.setup_logging(before)


def test_json_lines_carry_the_task_s_request_id_and_extra_fields(json_setup) -> None:
    log = logging.getLogger("pdserve.test")

    async def serve(rid: str) -> None:
        logs.bind_request(rid)
        await asyncio.sleep(0)
        await asyncio.create_task(asyncio.sleep(0))  # a task it starts inherits the id
        log.info("serving %s", rid)

    async def main() -> None:
        await asyncio.gather(serve("a"), serve("b"))
        log.warning("no request here", extra={"fields": {"status": 200}})

    asyncio.run(main())
    lines = [json.loads(x) for x in json_setup.getvalue().splitlines()]
    assert [(x["message"], x.get("request_id")) for x in lines] == [
        ("serving a", "a"),
        ("serving b", "b"),
        ("no request here", None),
    ]
    assert lines[2]["status"] == 200
    for line in lines:
        assert (line["role"], line["address"], line["logger"]) == ("decode", "127.0.0.1:5", "pdserve.test")
        assert line["timestamp"].endswith("Z")
        assert datetime.fromisoformat(line["timestamp"]).utcoffset().total_seconds() == 0
    assert [x["level"] for x in lines] == ["INFO", "INFO", "WARNING"]


def test_text_format_is_the_plain_one() -> None:
    before = logs.current()
    try:
        logs.setup_logging(logs.LogSetup("text", "INFO"))
        handler = logging.getLogger().handlers[0]
        record = logging.LogRecord("pdserve.x", logging.INFO, __file__, 1, "hello %s", ("there",), None)
        assert handler.format(record).endswith(" INFO pdserve.x: hello there")
    finally:
        logs.setup_logging(before)


def test_an_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError, match="log format"):
        logs.LogSetup("yaml")


@pytest.mark.parametrize(
    ("value", "taken"),
    [
        (b"abc-123_x.y:z", "abc-123_x.y:z"),
        (b"a" * 128, "a" * 128),
        (b"a" * 129, ""),  # too long
        (b"two words", ""),
        (b"tab\there", ""),
        ("caf\u00e9".encode("latin-1"), ""),
        (b"", ""),
    ],
)
def test_the_client_s_request_id_is_taken_only_as_a_plain_token(value: bytes, taken: str) -> None:
    from gateway.access import client_request_id

    scope = {"headers": [(b"content-type", b"application/json"), (b"x-request-id", value)]}
    assert client_request_id(scope) == taken
    assert client_request_id({"headers": []}) == ""


def test_router_calls_get_unique_ids_that_contain_the_request_s() -> None:
    from gateway.access import AccessRecord
    from gateway.app import router_ids

    assert router_ids(AccessRecord(), 1) == [""]  # the router makes it
    client = AccessRecord(request_id="abc")
    one, again = router_ids(client, 1), router_ids(client, 1)
    assert one != again and all(x.startswith("abc-") and len(x) == 12 for x in one + again)
    three = router_ids(client, 3)
    assert len(set(three)) == 3 and all(x.startswith("abc-") for x in three)
    several = AccessRecord()
    ids = router_ids(several, 2)
    assert several.request_id is not None and several.request_id.startswith("r-")
    assert ids == [f"{several.request_id}-0", f"{several.request_id}-1"]


# ---- the stack, end to end ----------------------------------------------------------------------------


class Gateway:
    def __init__(self, router: str, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = [sys.executable, "-m", "serving.cli", "--log-level", "INFO", "gateway", "--log-format", "json"]
        cmd += ["--router", router, "--port", str(self.port)]
        with log.open("w") as out:
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 60
        while True:
            assert self.proc.poll() is None, f"the gateway exited:\n{log.read_text()}"
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"the gateway did not become healthy:\n{log.read_text()}"
            time.sleep(0.2)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        sys.stderr.write(self.log.read_text())  # shown with a failing test


def records(text: str) -> list[dict]:
    """Every line as JSON (the announcements for tools aside); fails on the first that is not."""
    out = []
    for line in text.splitlines():
        if not line.strip() or line.startswith(ANNOUNCEMENTS):
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pytest.fail(f"not a JSON log line: {line!r}")
    return out


def roles_with(rid: str, lines: list[dict]) -> set[str]:
    return {x["role"] for x in lines if rid in (x.get("request_id") or "")}


@pytest.fixture(scope="module")
def json_stack(bundled_model_dir, tmp_path_factory):
    cluster = start_cluster(1, 1, "tcp", "--log-format", "json", log_level="INFO")
    try:
        gateway = Gateway(cluster.router, tmp_path_factory.mktemp("gateway") / "gateway.log")
        try:
            yield cluster, gateway
        finally:
            gateway.stop()
    finally:
        cluster.stop()


def all_records(cluster: Cluster, gateway: Gateway) -> list[dict]:
    return records(cluster.output()) + records(gateway.log.read_text())


@pytest.mark.slow
def test_one_request_id_through_every_process_in_json_lines(json_stack) -> None:
    cluster, gateway = json_stack
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="-", max_retries=0, timeout=120)
    model = client.models.list().data[0].id

    raw = client.completions.with_raw_response.create(
        model=model, prompt="The capital of France is", max_tokens=5, temperature=0,
        extra_headers={"X-Request-Id": "client-id-7f3a"},
    )  # fmt: skip
    given = raw.parse()
    assert raw.headers["x-request-id"] == "client-id-7f3a"

    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    minted = raw.headers["x-request-id"]
    chunks = list(raw.parse())
    minted_usage = chunks[-1].usage
    assert minted.startswith("r-") and minted_usage is not None

    deadline = time.monotonic() + 30
    want = {"gateway", "router", "decode", "prefill"}
    while not all(
        roles_with(rid, all_records(cluster, gateway)) >= want for rid in ("client-id-7f3a", minted)
    ):
        assert time.monotonic() < deadline, {
            rid: roles_with(rid, all_records(cluster, gateway)) for rid in ("client-id-7f3a", minted)
        }
        time.sleep(0.2)

    lines = all_records(cluster, gateway)
    for line in lines:
        assert all(key in line for key in REQUIRED), line
        assert datetime.fromisoformat(line["timestamp"]).utcoffset().total_seconds() == 0, line
        if line["role"] != "up":  # `pdserve up` itself listens nowhere
            assert line["address"], line
    addresses = {x["role"]: x["address"] for x in lines if x["role"] in want}
    assert addresses["router"] == cluster.router
    assert addresses["gateway"] == f"127.0.0.1:{gateway.port}"
    assert {addresses["prefill"], addresses["decode"]} == {w["address"] for w in cluster.workers}

    access = {x.get("request_id"): x for x in lines if x["logger"] == "pdserve.access"}
    assert access[None]["path"] in ("/health", "/v1/models")  # no router call: no id
    for rid, usage, path in (
        ("client-id-7f3a", given.usage, "/v1/completions"),
        (minted, minted_usage, "/v1/chat/completions"),
    ):
        line = access[rid]
        assert (line["method"], line["path"], line["status"]) == ("POST", path, 200)
        assert usage is not None and usage.completion_tokens > 0
        assert (line["prompt_tokens"], line["completion_tokens"]) == (
            usage.prompt_tokens,
            usage.completion_tokens,
        )
        assert 0 < line["ttft_s"] <= line["duration_s"]
