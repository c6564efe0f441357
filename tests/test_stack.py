"""`make serve`'s stack (gateway + `pdserve up`): stopping it with SIGTERM, as a service manager or
`docker stop` does, stops every process it started and exits 0 (tests/test_stack_drain.py: with requests
in flight)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from serving.roles import free_port

pytestmark = pytest.mark.slow


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_sigterm_stops_the_gateway_and_the_whole_cluster():
    port, router_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "gateway.stack", "--port", str(port), "--router-port", str(router_port)]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    assert proc.stdout is not None
    try:
        pids: list[int] = []
        for line in proc.stdout:
            if line.startswith("pdserve cluster: "):
                info = json.loads(line.split(": ", 1)[1])
                pids = [info["router"]["pid"], *(w["pid"] for w in info["workers"])]
            if line.startswith("pdserve gateway: "):
                break
        assert pids, "the stack never reported its cluster"
        deadline = time.monotonic() + 60
        while True:  # the gateway answers once uvicorn is up
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    assert r.status == 200
                    break
            except OSError:
                assert time.monotonic() < deadline, "the gateway did not come up"
                time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0  # a stop that was asked for is a clean exit
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in pids if _alive(p)], "cluster processes outlived the stack"
    finally:
        if proc.poll() is None:
            proc.kill()
