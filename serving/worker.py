"""Start a worker: its engine process, then a grpc.aio server in front of it; on SIGINT/SIGTERM, drain."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable
from typing import Any, Protocol

import grpc
import numpy as np

from engine.sampling_params import embedding_params
from protos import pdserve_pb2 as pb
from serving.drain import SHUTTING_DOWN, Drain
from serving.engine_proc import EngineProcess
from serving.grpc_common import add_health_and_reflection, mark_serving, pooling_from_proto
from serving.logs import bind_request, identify
from serving.messages.from_engine import Embedded, Error
from serving.messages.to_engine import Abort, Embed
from serving.mux import RpcAbort
from serving.tls import PLAINTEXT, TLSConfig

logger = logging.getLogger(__name__)

_STOP_GRACE_S = 2.0  # for calls that are not requests (load, health) when the server stops after the drain
_UNWIND_S = 5.0  # for requests the engine aborted at the drain timeout to end their calls

STATUS = {
    "INVALID_ARGUMENT": grpc.StatusCode.INVALID_ARGUMENT,
    "RESOURCE_EXHAUSTED": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "UNAVAILABLE": grpc.StatusCode.UNAVAILABLE,
    "INTERNAL": grpc.StatusCode.INTERNAL,
}


_LOAD_FIELDS = frozenset(pb.WorkerLoad.DESCRIPTOR.fields_by_name)


def worker_load(engine: EngineProcess, draining: bool = False) -> pb.WorkerLoad:
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
        draining=draining,
        **{k: v for k, v in engine.load.items() if k in _LOAD_FIELDS},  # the rest is for /metrics only
    )


async def serve_embed(
    engine: EngineProcess, drain: Drain, request: pb.WorkerEmbedRequest, context: grpc.aio.ServicerContext
) -> pb.EmbedResponse:
    """Either role's Embed: the prompt computed by this worker's engine (Embed), its Embedded answered. Refused
    while draining; counted by the drain while it runs; the engine forgets it when the caller goes."""

    async def one(req: pb.WorkerEmbedRequest, _: Any):
        rid = req.request_id
        try:
            params = embedding_params(pooling_from_proto(req.pooling))
        except ValueError as exc:
            raise RpcAbort(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from exc
        if not engine.alive:
            raise RpcAbort(
                grpc.StatusCode.UNAVAILABLE, f"the {engine.info.get('role', '')} engine is not running"
            )
        stream = engine.open(rid)
        done = False
        try:
            ids = np.array(req.prompt_token_ids, dtype=np.int64)
            engine.send(Embed(rid, ids, params, req.priority, req.cache_salt or None))
            msg = await stream.get()
            done = True
            if isinstance(msg, Error):
                raise RpcAbort(STATUS[msg.code], msg.details)
            assert isinstance(msg, Embedded), msg
            yield pb.EmbedResponse(
                request_id=rid, embedding=msg.embedding, prompt_tokens=len(req.prompt_token_ids),
                cached_tokens=msg.num_cached_tokens,
            )  # fmt: skip
        finally:
            if not done:
                engine.send(Abort(rid))
            engine.close(rid)

    bind_request(request.request_id)
    try:
        async with contextlib.aclosing(drain.admit(one)(request, None)) as replies:
            async for reply in replies:
                return reply
    except RpcAbort as abort:
        await context.abort(abort.code, abort.details)
    raise AssertionError("an embedding call ended without its answer")


class Servicer(Protocol):
    async def close(self) -> None:
        """Called once every request has ended, before the server stops: close the worker's own calls."""


async def run_worker(
    core_path: str,
    config: Any,
    service_name: str,
    add_servicer: Callable[[Any, grpc.aio.Server], None],
    make_servicer: Callable[[EngineProcess, Drain], Servicer],
    address: str,
    drain_timeout_s: float = 30.0,
    metrics_port: int | None = None,
    metrics_compat: str | None = None,
    tls: TLSConfig = PLAINTEXT,
) -> None:
    """Serve until SIGTERM/SIGINT, then drain: NOT_SERVING and `draining` in GetLoad at once, new requests
    refused, those in flight finished within `drain_timeout_s` (past it ended with UNAVAILABLE), then the
    server and the engine process stop. Exits 1 (SystemExit) if the engine process died or never started."""
    stop = _stop_on_signals()
    server = tls.aio_server()
    port = tls.add_port(server, address)
    identify(address=f"{address.rpartition(':')[0]}:{port}")  # before the engine process takes the setup
    engine = EngineProcess(core_path, config)
    drain = Drain()
    servicer = make_servicer(engine, drain)
    health = add_health_and_reflection(server, [service_name])
    add_servicer(servicer, server)
    await server.start()  # health answers NOT_SERVING while the model loads
    logger.info("%s listening on port %d (%s), loading the model", service_name, port, tls.describe())
    if not await _start_engine(engine, stop):
        await server.stop(0)
        await engine.shutdown()
        if stop.is_set():
            return  # asked to stop while the model loaded
        raise SystemExit(1)
    mark_serving(health, [service_name])
    if metrics_port:
        from serving.worker_metrics import EngineMetrics, serve_metrics

        metrics = EngineMetrics(
            lambda: engine.load,
            lambda: engine.counters,
            engine.info["model"],
            lambda: engine.histograms,
            engine.info.get("role", "decode"),
            metrics_compat,
            lambda: tuple(engine.history),
        )
        serve_metrics(metrics_port, metrics)
        logger.info("%s serves /metrics on port %d", service_name, metrics_port)
    logger.info("%s ready on port %d", service_name, port)
    watch = asyncio.create_task(_watch_engine(engine, stop))
    await stop.wait()
    watch.cancel()
    mark_serving(health, [service_name], serving=False)
    await _drain(engine, drain, drain_timeout_s)
    if not await drain.wait_streams_ended(_UNWIND_S):  # each ends once its calls have (serving/mux.py)
        logger.warning("shared streams still open after the drain: the server's stop ends them")
    await servicer.close()
    await server.stop(grace=_STOP_GRACE_S)
    await engine.shutdown()
    await asyncio.gather(watch, return_exceptions=True)
    logger.info("%s on port %d stopped", service_name, port)
    if engine.died:
        raise SystemExit(1)


def _stop_on_signals() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def _start_engine(engine: EngineProcess, stop: asyncio.Event) -> bool:
    """Start the engine process; False if it failed or a stop was asked for first."""
    start = asyncio.create_task(engine.start())
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait([start, stopped], return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if not start.done():
        start.cancel()
    try:
        await start
    except asyncio.CancelledError:
        return False
    except RuntimeError as exc:
        logger.error("%s", exc)
        return False
    return True


async def _drain(engine: EngineProcess, drain: Drain, timeout: float) -> None:
    drain.start()
    if drain.active:
        logger.info("draining: %d requests in flight, up to %g s", drain.active, timeout)
    if await drain.wait_idle(timeout):
        return
    n = engine.abort_all("UNAVAILABLE", SHUTTING_DOWN)
    logger.warning("drain timeout: %d requests still running after %g s were ended", n, timeout)
    if not await drain.wait_idle(_UNWIND_S):
        logger.warning("%d requests did not end after the engine aborted them", drain.active)


async def _watch_engine(engine: EngineProcess, stop: asyncio.Event) -> None:
    while engine.alive:
        await asyncio.sleep(0.5)
    logger.error("the engine process died: stopping this worker")
    await asyncio.sleep(0.5)  # let the streams report UNAVAILABLE
    stop.set()
