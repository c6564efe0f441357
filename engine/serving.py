"""Start a worker: its engine process, then a grpc.aio server in front of it, until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from typing import Any

import grpc

from engine.engine_proc import EngineProcess
from engine.grpc_common import CHANNEL_OPTIONS, add_health_and_reflection, mark_serving
from protos import pdserve_pb2 as pb

logger = logging.getLogger(__name__)

STATUS = {
    "INVALID_ARGUMENT": grpc.StatusCode.INVALID_ARGUMENT,
    "RESOURCE_EXHAUSTED": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "UNAVAILABLE": grpc.StatusCode.UNAVAILABLE,
    "INTERNAL": grpc.StatusCode.INTERNAL,
}


def worker_load(engine: EngineProcess) -> pb.WorkerLoad:
    """The worker's identity and limits (fixed at start) with its engine's latest load report."""
    info = engine.info
    return pb.WorkerLoad(
        worker_id=info["worker_id"],
        role=info["role"],
        block_size=info["block_size"],
        model=info["model"],
        max_model_len=info["max_model_len"],
        vocab_size=info["vocab_size"],
        epoch=info["epoch"],
        **engine.load,
    )


async def run_worker(
    core_path: str,
    config: Any,
    service_name: str,
    add_servicer: Callable[[Any, grpc.aio.Server], None],
    make_servicer: Callable[[EngineProcess], Any],
    address: str,
) -> None:
    engine = EngineProcess(core_path, config)
    server = grpc.aio.server(options=CHANNEL_OPTIONS)
    health = add_health_and_reflection(server, [service_name])
    add_servicer(make_servicer(engine), server)
    port = server.add_insecure_port(address)
    await server.start()  # health answers NOT_SERVING while the model loads
    logger.info("%s listening on port %d, loading the model", service_name, port)
    try:
        await engine.start()
    except RuntimeError as exc:
        logger.error("%s", exc)
        await server.stop(0)
        raise SystemExit(1) from exc
    mark_serving(health, [service_name])
    logger.info("%s ready on port %d", service_name, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    watch = asyncio.create_task(_watch_engine(engine, stop))
    await stop.wait()
    watch.cancel()
    mark_serving(health, [service_name], serving=False)
    await server.stop(grace=1.0)
    engine.shutdown()
    if not engine.alive and engine.proc.exitcode not in (0, None):
        raise SystemExit(1)


async def _watch_engine(engine: EngineProcess, stop: asyncio.Event) -> None:
    while engine.alive:
        await asyncio.sleep(0.5)
    logger.error("the engine process died: stopping this worker")
    await asyncio.sleep(0.5)  # let the streams report UNAVAILABLE
    stop.set()
