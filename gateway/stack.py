"""The whole local stack in one command (`make serve`): `pdserve up` (router, one prefill and one decode
worker, the bundled model) plus the gateway on port 8000.

SIGTERM or Ctrl-C stops it in order: the gateway drains first (`--drain-timeout-s`; the cluster behind it
keeps serving meanwhile), then `pdserve up` is stopped (it drains its workers), and the stack exits 0.
`pdserve up` runs in its own session, so a terminal's Ctrl-C reaches it only through this order.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from gateway.cli import add_serving_args
from serving.logs import LogSetup, add_log_format_arg, setup_logging

_CLUSTER_STOP_S = 30.0  # beyond its own drain timeout, for `pdserve up` to stop its processes


class _Interrupted(Exception):
    """SIGTERM or SIGINT before the gateway serves (or after it is done): stop in order."""


def launch_cluster(prefill: int, decode: int, router_port: int, extra: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "serving.cli", "up", "--prefill", str(prefill), "--decode", str(decode)]
    cmd += ["--port", str(router_port), *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)


def wait_ready(proc: subprocess.Popen) -> str:
    """Echo `pdserve up`'s output; returns the router's address once its ready line comes."""
    out = proc.stdout
    assert out is not None
    for line in out:
        sys.stdout.write(line)
        if line.startswith("pdserve cluster: "):
            threading.Thread(target=lambda: [sys.stdout.write(x) for x in out], daemon=True).start()
            return str(json.loads(line.split(": ", 1)[1])["router"]["address"])
    raise SystemExit(f"pdserve up exited with {proc.wait()} before the cluster was ready")


def stop(proc: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM `pdserve up` (a signal meanwhile is passed on to it) and wait; kill it past `timeout_s`."""
    if proc.poll() is not None:
        return
    with _signals(lambda signum, frame: proc.send_signal(signum)):
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            print("pdserve stack: pdserve up did not stop in time; killing it", file=sys.stderr)
            proc.kill()
            proc.wait()


def cluster_flags(drain_timeout_s: float) -> list[str]:
    """`--drain-timeout-s` for `pdserve up`, when it (or the workers it passes flags to) takes it."""
    from serving.cli import build_parser

    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    takes = any("--drain-timeout-s" in subparsers.choices[c]._option_string_actions for c in ("up", "decode"))
    return ["--drain-timeout-s", str(drain_timeout_s)] if takes else []


def run_stack(args: argparse.Namespace, extra: list[str]) -> int:
    """Start the cluster, then serve the gateway in this process until signalled; stop the cluster after."""
    from gateway.cli import cmd_gateway

    with _signals(_interrupt):
        proc = launch_cluster(
            args.prefill, args.decode, args.router_port, [*cluster_flags(args.drain_timeout_s), *extra]
        )
        try:
            router = wait_ready(proc)
            gateway = argparse.Namespace(**vars(args), router=router, model=None, uvicorn_log_level="warning")
            cmd_gateway(gateway)  # returns once drained
        except _Interrupted:
            pass
        finally:
            stop(proc, args.drain_timeout_s + _CLUSTER_STOP_S)
    return 0


@contextmanager
def _signals(handler) -> Iterator[None]:  # type: ignore[no-untyped-def]
    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _interrupt(signum: int, frame: object) -> None:
    raise _Interrupted


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gateway.stack", description=__doc__)
    p.add_argument("--prefill", type=int, default=1)
    p.add_argument("--decode", type=int, default=1)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--router-port", type=int, default=50051)
    p.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY") or None)
    add_serving_args(p)
    add_log_format_arg(p)
    args, extra = p.parse_known_args(argv)  # other flags go to `pdserve up` and its workers
    setup_logging(LogSetup(args.log_format))
    return run_stack(args, ["--log-format", args.log_format, *extra])


if __name__ == "__main__":
    sys.exit(main())
