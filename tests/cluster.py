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
from dataclasses import dataclass

import grpc

from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc


@dataclass
class Cluster:
    proc: subprocess.Popen
    router: str
    workers: list[dict]

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
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def start_cluster(prefill: int, decode: int, transport: str, *extra: str, timeout: float = 300.0) -> Cluster:
    cmd = [
        sys.executable,
        "-m",
        "engine.cli",
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
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    stdout = proc.stdout
    assert stdout is not None
    lines: queue.Queue = queue.Queue()

    def pump() -> None:  # the cluster's stdout, line by line, then "" at its end
        for line in stdout:
            lines.put(line)
        lines.put("")

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1.0)
        except queue.Empty:
            continue
        if line.startswith("pdserve cluster: "):
            info = json.loads(line.split(": ", 1)[1])
            return Cluster(proc, info["router"]["address"], info["workers"])
        if not line:
            raise RuntimeError(f"pdserve up exited with {proc.wait()}")
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
