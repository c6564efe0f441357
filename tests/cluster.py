"""Start a real local cluster (`pdserve up`) for integration tests, and talk to it."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property

import grpc
import httpx

from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc
from serving.roles import free_port


class _Lines:
    """A pipe read line by line on a thread: every line kept, new ones waited for, echoed to file
    descriptor `echo` (2: where pytest's capture shows it with a failing test)."""

    def __init__(self, pipe, echo: int | None) -> None:
        self.all: list[str] = []
        self._new: queue.Queue = queue.Queue()
        self._echo = echo
        threading.Thread(target=self._pump, args=(pipe,), daemon=True).start()

    def _pump(self, pipe) -> None:
        for line in pipe:
            self.all.append(line)
            self._new.put(line)
            if self._echo is not None:
                os.write(self._echo, line.encode())
        self._new.put("")  # the end

    def next(self, timeout: float) -> str | None:
        """The next line not taken yet; "" at the end of the pipe, None if none came within `timeout`."""
        try:
            return self._new.get(timeout=timeout)
        except queue.Empty:
            return None

    def text(self) -> str:
        return "".join(self.all)


@dataclass
class Cluster:
    proc: subprocess.Popen
    router: str
    workers: list[dict]
    stdout: _Lines | None = None
    stderr: _Lines | None = None  # the whole tree's: `pdserve up`'s and every child's
    router_pid: int = 0
    router_metrics_port: int | None = None  # with `pdserve up --metrics`

    def output(self) -> str:
        """Everything the cluster's processes printed so far, stdout then stderr."""
        return "".join(x.text() for x in (self.stdout, self.stderr) if x is not None)

    def wait_line(self, prefix: str, timeout: float) -> str:
        """The next stdout line starting with `prefix` (e.g. "pdserve restarted: "), its rest."""
        assert self.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.stdout.next(timeout=max(0.01, deadline - time.monotonic()))
            if line == "":
                raise AssertionError(f"pdserve up ended before printing {prefix!r}")
            if line is not None and line.startswith(prefix):
                return line[len(prefix) :].strip()
        raise AssertionError(f"no {prefix!r} line within {timeout:g} s")

    def stub(self) -> pb_grpc.RouterStub:
        return pb_grpc.RouterStub(grpc.insecure_channel(self.router))

    def loads(self) -> list[pb.WorkerLoad]:
        out = []
        for w in self.workers:
            stub_cls = pb_grpc.DecodeStub if w["role"] == "decode" else pb_grpc.PrefillStub
            with grpc.insecure_channel(w["address"]) as ch:
                try:
                    out.append(stub_cls(ch).GetLoad(pb.LoadRequest(), timeout=5))
                except grpc.RpcError:
                    continue  # a worker a test killed
        return out

    def wait_all_blocks_free(self, timeout: float = 10.0) -> list[pb.WorkerLoad]:
        deadline = time.monotonic() + timeout
        while True:
            loads = self.loads()
            if all(x.num_free_blocks == x.num_total_blocks and x.num_running == 0 for x in loads):
                return loads
            if time.monotonic() > deadline:
                raise AssertionError(f"blocks still held: {loads}")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def start_cluster(
    prefill: int,
    decode: int,
    transport: str,
    *extra: str,
    timeout: float = 300.0,
    log_level: str = "WARNING",
) -> Cluster:
    """`pdserve up` with these workers; `extra` flags go to `up` (its own, then the workers'). Its stdout and
    stderr are kept (Cluster.output), stderr echoed to this process's."""
    cmd = [
        sys.executable,
        "-m",
        "serving.cli",
        "--log-level",
        log_level,
        "up",
        "--prefill",
        str(prefill),
        "--decode",
        str(decode),
        "--port",
        "0",
        "--kv-transport",
        transport,
        "--cpu-kv-cache-space",
        "0.1",
        "--max-model-len",
        "1024",
        "--dtype",
        "float32",
        "--device",
        "cpu",
        *extra,
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    out = _Lines(proc.stdout, None)
    err = _Lines(proc.stderr, 2)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = out.next(timeout=1.0)
        if line is None:
            continue
        if line.startswith("pdserve cluster: "):
            info = json.loads(line.split(": ", 1)[1])
            router = info["router"]
            return Cluster(
                proc, router["address"], info["workers"], out, err, router["pid"], router.get("metrics_port")
            )
        if not line:
            raise RuntimeError(f"pdserve up exited with {proc.wait()}:\n{err.text()[-4000:]}")
    proc.kill()
    raise RuntimeError("the cluster did not start in time")


def greedy_request(ids: list[int], max_tokens: int, **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=ids),
        sampling=pb.SamplingParams(temperature=0, max_tokens=max_tokens, **sampling),
    )


def collect(stream) -> tuple[dict[int, list[int]], dict[int, str], pb.Usage | None]:
    tokens: dict[int, list[int]] = {}
    texts: dict[int, str] = {}
    usage = None
    for r in stream:
        if r.HasField("usage"):
            usage = r.usage
        if r.token_ids or r.text:
            tokens.setdefault(r.index, []).extend(r.token_ids)
            texts[r.index] = texts.get(r.index, "") + r.text
    return tokens, texts, usage


class Stream:
    """One Router.Generate call read on a thread: its tokens as they come, then its finish or its error."""

    def __init__(self, stub: pb_grpc.RouterStub, request: pb.GenerateRequest, timeout: float = 300.0) -> None:
        self.tokens: list[int] = []
        self.finish_reason = ""
        self.error: grpc.RpcError | None = None
        self._call = stub.Generate(request, timeout=timeout)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for reply in self._call:
                self.tokens.extend(reply.token_ids)
                self.finish_reason = reply.finish_reason or self.finish_reason
        except grpc.RpcError as exc:
            self.error = exc

    def cancel(self) -> None:
        self._call.cancel()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"the stream did not end within {timeout:g} s"


def wait_until(check, timeout: float, what: str, every: float = 0.05):
    """Poll `check()` until it returns something truthy (returned), failing after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:g} s")
        time.sleep(every)


def worker_load(worker: dict, timeout: float = 5.0) -> pb.WorkerLoad | None:
    """The worker's GetLoad reply, None if it does not answer."""
    stub_cls = pb_grpc.DecodeStub if worker["role"] == "decode" else pb_grpc.PrefillStub
    with grpc.insecure_channel(worker["address"]) as ch:
        try:
            return stub_cls(ch).GetLoad(pb.LoadRequest(), timeout=timeout)
        except grpc.RpcError:
            return None


def health(address: str, timeout: float = 5.0) -> str:
    """SERVING, NOT_SERVING, or the gRPC code of the failed check (e.g. UNAVAILABLE)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as ch:
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError as exc:
            return exc.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def process_state(pid: int) -> str | None:
    """The process's state letter from /proc (Z: a zombie), None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return None


def start_gateway(router: str, *extra: str, timeout: float = 60.0) -> tuple[subprocess.Popen, str]:
    """`python -m gateway.cli` in front of `router`, once its /health answers 200: (process, base url)."""
    port = free_port()
    cmd = [sys.executable, "-m", "gateway.cli", "--router", router, "--port", str(port), *extra]
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the gateway exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError("the gateway did not become healthy")


@dataclass
class OpenAIStack:
    """A cluster behind a gateway, with the official openai client on it."""

    router: str
    url: str
    model: str

    @cached_property
    def client(self):  # an openai.OpenAI (imported here: most users of this module need no openai)
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=180)

    def post(self, path: str, body: dict) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=180)


@contextmanager
def openai_stack(
    up_flags: tuple[str, ...] = (), gateway_flags: tuple[str, ...] = ()
) -> Iterator[OpenAIStack]:
    """`pdserve up` (a prefill and a decode worker over tcp, `up_flags`) behind a gateway (`gateway_flags`)."""
    cluster = start_cluster(1, 1, "tcp", *up_flags)
    try:
        proc, url = start_gateway(cluster.router, *gateway_flags)
        try:
            yield OpenAIStack(cluster.router, url, httpx.get(url + "/v1/models").json()["data"][0]["id"])
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    finally:
        cluster.stop()
