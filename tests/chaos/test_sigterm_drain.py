"""`pdserve serve` (`make serve`) drains on SIGTERM: streams in flight finish within the drain timeout, or
past it end with a last error event and `data: [DONE]`; never a bare close, the exit status is 0, the log is
clean."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from serving.roles import free_port

pytestmark = pytest.mark.slow

STREAMS = 16
SMALL = ["--cpu-kv-cache-space", "0.1", "--max-model-len", "1024", "--dtype", "float32", "--device", "cpu"]


def start_stack(log: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    port, router_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "serving.cli", "serve", "--port", str(port)]
    cmd += ["--router-port", str(router_port)]
    with log.open("w") as out:
        proc = subprocess.Popen(
            [*cmd, *SMALL, *extra],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        assert proc.poll() is None, log.read_text()
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the stack did not come up"
        time.sleep(0.3)


async def stream(client: httpx.AsyncClient, url: str, body: dict, running: asyncio.Queue) -> list[str]:
    """The stream's data events; says so on `running` once the first one came."""
    events: list[str] = []
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
                if len(events) == 1:
                    running.put_nowait(None)
    return events


async def sigterm_during_streams(
    proc: subprocess.Popen, url: str, max_tokens: int, streaming: int
) -> list[list[str]]:
    """Send STREAMS streaming requests at once; SIGTERM the stack once `streaming` of them stream."""
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=STREAMS)) as client:
        model = (await client.get(url + "/v1/models")).json()["data"][0]["id"]
        running: asyncio.Queue = asyncio.Queue()
        tasks = []
        for i in range(STREAMS):
            messages = [{"role": "user", "content": f"Write story number {i}."}]
            body = {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": True}
            body.update(ignore_eos=True, temperature=0)
            tasks.append(asyncio.create_task(stream(client, url, body, running)))
        for _ in range(streaming):
            await asyncio.wait_for(running.get(), 240)
        finished = [t for t in tasks if t.done()]
        proc.send_signal(signal.SIGTERM)
        results = list(await asyncio.gather(*tasks))
        # the test's premise: no stream was over when the signal went
        assert not finished, f"{len(finished)} streams finished before SIGTERM: raise max_tokens"
        return results


def finish_reason(event: str) -> str | None:
    choices = json.loads(event)["choices"]
    return choices[0]["finish_reason"] if choices else None


def test_sigterm_lets_every_stream_finish(tmp_path):
    log = tmp_path / "stack.log"
    proc, url = start_stack(log, "--drain-timeout-s", "120")  # room for a slow host: the streams set the time
    try:
        # SIGTERM once every stream has its first token, so that all are in flight at the gateway however
        # slowly they arrived. The first to arrive is prefilled alone and decodes alone while the other 15 are
        # prefilled together (1.5-2.7 s on a 2-core host, where it makes about 16 tokens a second): 64 tokens
        # leave it far from done by then
        results = asyncio.run(sigterm_during_streams(proc, url, max_tokens=64, streaming=STREAMS))
        assert proc.wait(timeout=180) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    for events in results:
        assert events[-1] == "[DONE]"
        assert finish_reason(events[-2]) == "length"
        assert not any('"error"' in e for e in events)
    out = log.read_text()
    assert f"draining {STREAMS} requests" in out  # every one was in flight at SIGTERM
    assert "every request finished" in out
    assert "Traceback" not in out, out


def test_sigterm_past_the_drain_timeout_ends_every_stream_with_an_error_event(tmp_path):
    log = tmp_path / "stack.log"
    proc, url = start_stack(log, "--drain-timeout-s", "1")
    try:
        results = asyncio.run(sigterm_during_streams(proc, url, max_tokens=900, streaming=STREAMS))
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    shutdown = {
        "message": "server shutting down",
        "type": "server_error",
        "param": None,
        "code": "unavailable",
    }
    for events in results:
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2]) == {"error": shutdown}
    out = log.read_text()
    assert f"draining {STREAMS} requests" in out and "requests past the timeout stopped" in out
    assert "Traceback" not in out, out
