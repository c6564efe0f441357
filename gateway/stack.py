"""The whole local stack in one command (`make serve`): `pdserve up` (router, one prefill and one decode
worker, the bundled model) plus the gateway on port 8000. Ctrl-C stops everything."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading


def start_cluster(
    prefill: int, decode: int, router_port: int, extra: list[str]
) -> tuple[subprocess.Popen, str]:
    """Start `pdserve up` and wait for its ready line; returns the process and the router's address."""
    cmd = [sys.executable, "-m", "engine.cli", "up", "--prefill", str(prefill), "--decode", str(decode)]
    cmd += ["--port", str(router_port), *extra]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    out = proc.stdout
    assert out is not None
    for line in out:
        sys.stdout.write(line)
        if line.startswith("pdserve cluster: "):
            threading.Thread(target=lambda: [sys.stdout.write(x) for x in out], daemon=True).start()
            return proc, json.loads(line.split(": ", 1)[1])["router"]["address"]
    raise SystemExit(f"pdserve up exited with {proc.wait()} before the cluster was ready")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def run_stack(
    prefill: int = 1,
    decode: int = 1,
    host: str = "127.0.0.1",
    port: int = 8000,
    router_port: int = 50051,
    api_key: str | None = None,
    extra: list[str] | None = None,
) -> int:
    """Start the cluster, then serve the gateway in this process until interrupted; stop the cluster after."""
    from gateway.cli import cmd_gateway

    # SIGTERM must end in `finally` too: uvicorn catches it, shuts the gateway down, then raises it
    # again under the handler it found, which by default kills this process before the cluster is stopped
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    proc, router = start_cluster(prefill, decode, router_port, list(extra or []))
    try:
        args = argparse.Namespace(
            router=router, host=host, port=port, api_key=api_key, model=None, uvicorn_log_level="warning"
        )
        return cmd_gateway(args)
    finally:
        stop(proc)
        signal.signal(signal.SIGTERM, previous)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gateway.stack", description=__doc__)
    p.add_argument("--prefill", type=int, default=1)
    p.add_argument("--decode", type=int, default=1)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--router-port", type=int, default=50051)
    p.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY") or None)
    args, extra = p.parse_known_args(argv)  # other flags go to `pdserve up` and its workers
    return run_stack(args.prefill, args.decode, args.host, args.port, args.router_port, args.api_key, extra)


if __name__ == "__main__":
    sys.exit(main())
