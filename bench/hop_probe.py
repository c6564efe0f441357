"""Diagnostic: what one message between two processes costs on this host, by mechanism.

    python -m bench.hop_probe [--out-dir DIR] [--n 300]

Why: on the H200 machines every gRPC hop of a served request took ~0.6-1.1 ms (the TTFT trace reports),
where the same hop takes ~0.15-0.5 ms on the CI machine. This times, one way (CLOCK_MONOTONIC is shared by
the processes), 16 KB messages (a 4096-token prompt's ids) each way:
  socket_block   a raw socket pair between processes, the receiver blocked in recv (woken by the kernel)
  socket_spin    the same, the receiver spinning on non-blocking recv (no wake-up)
  thread_wake    threading.Event.set -> wait() returning in another thread of one process
  grpc_new_call  grpc.aio: a new server-streaming call per message (request there, first reply back)
  grpc_stream    grpc.aio: messages on one open bidirectional stream
Messages go --gap-ms apart (default 2), as requests arrive apart. Median of n after 50 warm-ups.
--pm-qos holds /dev/cpu_dma_latency at 0 while it runs (Linux PM QoS: idle CPUs poll instead of halting;
root only), to tell the cost of waking an idle CPU from the cost of the mechanism.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import statistics
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MSG = 16 * 1024
GAP_S = 0.002  # --gap-ms
WARM = 50
_T = struct.Struct("d")


def _ms(xs: list[float]) -> float:
    return round(statistics.median(xs[WARM:]) * 1e3, 4)


def _echo(sock: socket.socket, spin: bool) -> None:
    if spin:
        sock.setblocking(False)
    buf = bytearray()
    while True:
        try:
            data = sock.recv(1 << 20)
        except BlockingIOError:
            continue
        if not data:
            return
        buf += data
        if len(buf) >= MSG:
            t = time.perf_counter()
            del buf[:MSG]
            sock.setblocking(True)
            sock.sendall(_T.pack(t) + b"x" * (MSG - _T.size))
            if spin:
                sock.setblocking(False)


def socket_pair(n: int, spin: bool) -> dict[str, float]:
    a, b = socket.socketpair()
    p = mp.get_context("spawn").Process(target=_echo, args=(b, spin), daemon=True)
    p.start()
    b.close()
    there, back = [], []
    for _ in range(n + WARM):
        t0 = time.perf_counter()
        a.sendall(b"x" * MSG)
        got = b""
        while len(got) < MSG:
            got += a.recv(1 << 20)
        t2 = time.perf_counter()
        t1 = _T.unpack(got[: _T.size])[0]
        there.append(t1 - t0)
        back.append(t2 - t1)
        time.sleep(GAP_S)
    a.close()
    p.join(5)
    return {"there_ms": _ms(there), "back_ms": _ms(back)}


def thread_wake(n: int) -> dict[str, float]:
    ev, stamps = threading.Event(), []

    def waiter() -> None:
        for _ in range(n + WARM):
            ev.wait()
            stamps.append(time.perf_counter())
            ev.clear()

    th = threading.Thread(target=waiter)
    th.start()
    lat = []
    for i in range(n + WARM):
        time.sleep(GAP_S)
        t0 = time.perf_counter()
        ev.set()
        while len(stamps) <= i:
            time.sleep(0)
        lat.append(stamps[i] - t0)
    th.join()
    return {"wake_ms": _ms(lat)}


def _ident(x: bytes) -> bytes:
    return x


async def _tick(period_s: float) -> None:
    """Wake the event loop every period_s (--tick-ms): does a process that never idles long answer faster?"""
    while True:
        await asyncio.sleep(period_s)


async def _serve(address: str, ready: Any, tick_s: float = 0.0) -> None:
    import grpc

    ticker = asyncio.create_task(_tick(tick_s)) if tick_s else None

    async def uni(req: bytes, ctx: Any):
        yield _T.pack(time.perf_counter()) + b"x" * (MSG - _T.size)

    async def bidi(reqs: Any, ctx: Any):
        async for _ in reqs:
            yield _T.pack(time.perf_counter()) + b"x" * (MSG - _T.size)

    server = grpc.aio.server()
    handlers = {
        "S": grpc.unary_stream_rpc_method_handler(uni, _ident, _ident),
        "B": grpc.stream_stream_rpc_method_handler(bidi, _ident, _ident),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("probe.P", handlers),))
    server.add_insecure_port(address)
    await server.start()
    ready.set()
    await server.wait_for_termination()
    if ticker is not None:
        ticker.cancel()


def _grpc_server(address: str, ready: Any, tick_s: float) -> None:
    asyncio.run(_serve(address, ready, tick_s))


async def _warm(ch: Any, period_s: float) -> None:
    """--warm-ms: a tiny message each way on a stream of its own every period_s, keeping both processes'
    gRPC paths busy between the measured messages."""
    call = ch.stream_stream("/probe.P/B", request_serializer=_ident, response_deserializer=_ident)()
    try:
        while True:
            await call.write(b"w")
            await call.read()
            await asyncio.sleep(period_s)
    finally:
        call.cancel()


async def _grpc_client(address: str, n: int, tick_s: float = 0.0, warm_s: float = 0.0) -> dict[str, float]:
    import grpc

    ticker = asyncio.create_task(_tick(tick_s)) if tick_s else None
    out: dict[str, float] = {}
    async with grpc.aio.insecure_channel(address) as ch:
        warmer = asyncio.create_task(_warm(ch, warm_s)) if warm_s else None
        uni = ch.unary_stream("/probe.P/S", request_serializer=_ident, response_deserializer=_ident)
        there, back = [], []
        for _ in range(n + WARM):
            t0 = time.perf_counter()
            async for reply in uni(b"x" * MSG):
                t2 = time.perf_counter()
                t1 = _T.unpack(reply[: _T.size])[0]
                there.append(t1 - t0)
                back.append(t2 - t1)
                break
            await asyncio.sleep(GAP_S)
        out["new_call_there_ms"], out["new_call_back_ms"] = _ms(there), _ms(back)
        call = ch.stream_stream("/probe.P/B", request_serializer=_ident, response_deserializer=_ident)()
        there, back = [], []
        for _ in range(n + WARM):
            t0 = time.perf_counter()
            await call.write(b"x" * MSG)
            reply = await call.read()
            t2 = time.perf_counter()
            t1 = _T.unpack(reply[: _T.size])[0]
            there.append(t1 - t0)
            back.append(t2 - t1)
            await asyncio.sleep(GAP_S)
        out["stream_there_ms"], out["stream_back_ms"] = _ms(there), _ms(back)
        call.cancel()
        if warmer is not None:
            warmer.cancel()
    if ticker is not None:
        ticker.cancel()
    return out


def grpc_hops(n: int, tick_s: float = 0.0, warm_s: float = 0.0) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ready = ctx.Event()
    p = ctx.Process(target=_grpc_server, args=(f"127.0.0.1:{port}", ready, tick_s), daemon=True)
    p.start()
    ready.wait(30)
    try:
        return asyncio.run(_grpc_client(f"127.0.0.1:{port}", n, tick_s, warm_s))
    finally:
        p.terminate()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--out-dir", type=Path, default=None)
    ap.add_argument("--gap-ms", type=float, default=2.0)
    ap.add_argument("--pm-qos", action="store_true")
    ap.add_argument("--name", default="hop_probe_grpc_stream_there_ms")
    ap.add_argument("--only-grpc", action="store_true", help="skip the socket and thread timings")
    ap.add_argument("--tick-ms", type=float, default=0.0, help="grpc: both event loops also wake this often")
    ap.add_argument("--warm-ms", type=float, default=0.0, help="grpc: a tiny message each way this often")
    args = ap.parse_args()
    global GAP_S
    GAP_S = args.gap_ms / 1e3
    qos = None
    if args.pm_qos:
        qos = open("/dev/cpu_dma_latency", "wb", buffering=0)  # noqa: SIM115 (held open while it runs)
        qos.write(struct.pack("i", 0))
    from bench.record import device_name, record

    res: dict[str, Any] = {}
    if not args.only_grpc:
        res["socket_block"] = socket_pair(args.n, spin=False)
        res["socket_spin"] = socket_pair(args.n, spin=True)
        res["thread_wake"] = thread_wake(args.n)
    res["grpc"] = grpc_hops(args.n, args.tick_ms / 1e3, args.warm_ms / 1e3)
    res["tick_ms"], res["warm_ms"] = args.tick_ms, args.warm_ms
    res["grpc_experiments"] = os.environ.get("GRPC_EXPERIMENTS", "")
    print(json.dumps(res, indent=1))
    if qos is not None:
        qos.close()
    record(
        args.name,
        res["grpc"]["stream_there_ms"],
        "ms",
        baseline=res["grpc"]["new_call_there_ms"],
        baseline_name="the same message as a new grpc.aio call",
        out_dir=args.out_dir,
        command="python -m bench.hop_probe",
        extra={
            "all": res,
            "device": device_name(),
            "message_bytes": MSG,
            "n": args.n,
            "gap_ms": args.gap_ms,
            "pm_qos_0": args.pm_qos,
        },
    )


if __name__ == "__main__":
    main()
