"""Start the router: `pdserve router --prefill ADDR,... --decode ADDR,...`."""

from __future__ import annotations

import asyncio
import logging
import signal

import grpc

from engine.grpc_common import CHANNEL_OPTIONS, add_health_and_reflection, mark_serving
from router.server import SERVICE_NAME, RouterConfig, RouterServicer, add_servicer

logger = logging.getLogger(__name__)


async def serve_router(config: RouterConfig, address: str) -> None:
    servicer = RouterServicer(config)
    server = grpc.aio.server(options=CHANNEL_OPTIONS)
    health = add_health_and_reflection(server, [SERVICE_NAME])
    add_servicer(servicer, server)
    port = server.add_insecure_port(address)
    await server.start()
    poller = asyncio.create_task(servicer.poll_forever())
    while not servicer.ready():  # serving once a prefill and a decode worker have answered
        await asyncio.sleep(0.1)
    mark_serving(health, [SERVICE_NAME])
    logger.info("router ready on port %d", port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    watch = asyncio.create_task(_follow_workers(servicer, health))
    await stop.wait()
    watch.cancel()
    poller.cancel()
    await server.stop(grace=1.0)


async def _follow_workers(servicer: RouterServicer, health) -> None:
    """SERVING while a prefill and a decode worker are live, NOT_SERVING while a role has none."""
    serving = True
    while True:
        await asyncio.sleep(0.25)
        ready = servicer.ready()
        if ready != serving:
            mark_serving(health, [SERVICE_NAME], serving=ready)
            logger.warning(
                "router %s", "serving again" if ready else "not serving: a worker role has no live worker"
            )
            serving = ready
