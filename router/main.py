"""Start the router: `pdserve router --prefill ADDR,... --decode ADDR,...`.

On SIGTERM or SIGINT it drains: health goes NOT_SERVING and new requests are refused with UNAVAILABLE
"server shutting down" at once; requests in flight may finish for `drain_timeout_s`, then the rest end
with that same status (their worker calls cancelled, freeing their blocks); then the server stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

from grpc_health.v1 import health

from router.server import SERVICE_NAME, RouterConfig, RouterServicer, add_servicer
from router.supervise import run_forever
from serving.grpc_common import add_health_and_reflection, mark_serving
from serving.logs import identify

logger = logging.getLogger(__name__)

_HEALTH_EVERY_S = 0.25
_UNWIND_S = 5.0  # for requests ended at the drain timeout to finish their calls


async def serve_router(config: RouterConfig, address: str) -> None:
    servicer = RouterServicer(config)
    server = config.tls.aio_server()
    health_servicer = add_health_and_reflection(server, [SERVICE_NAME])
    add_servicer(servicer, server)
    port = config.tls.add_port(server, address)
    identify(address=f"{address.rpartition(':')[0]}:{port}")
    if config.metrics_port:
        servicer.metrics.serve(config.metrics_port, compat=config.metrics_compat)
        logger.info("router metrics on port %d", config.metrics_port)
    await server.start()
    logger.info(
        "router listening on port %d (%s); serving once a prefill and a decode worker answer",
        port,
        config.tls.describe(),
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    follower = HealthFollower(servicer, health_servicer)
    tasks = [
        asyncio.create_task(servicer.poll_forever()),
        asyncio.create_task(run_forever("the health follower", follower.update, _HEALTH_EVERY_S, logger)),
    ]
    await stop.wait()
    await drain(servicer, health_servicer, config.drain_timeout_s)
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task
    await server.stop(grace=1.0)
    await servicer.close()
    logger.info("router stopped")


async def drain(servicer: RouterServicer, health_servicer: health.HealthServicer, timeout_s: float) -> None:
    servicer.draining = True
    mark_serving(health_servicer, [SERVICE_NAME], serving=False)
    logger.info(
        "router shutting down: refusing new requests; %d in flight, waiting up to %g s for them",
        servicer.in_flight,
        timeout_s,
    )
    if await servicer.wait_idle(timeout_s):
        return
    logger.warning("ending %d requests still in flight after %g s", servicer.end_all(), timeout_s)
    await servicer.wait_idle(_UNWIND_S)


class HealthFollower:
    """Keeps the gRPC health service SERVING while the router can serve, NOT_SERVING otherwise, and logs each
    change once with its reason."""

    def __init__(self, servicer: RouterServicer, health_servicer: health.HealthServicer) -> None:
        self.servicer = servicer
        self.health = health_servicer
        self.serving: bool | None = None
        self.reason: str | None = None
        self.ever_served = False

    async def update(self) -> None:
        reason = self.servicer.not_serving_reason()
        serving = reason is None
        if serving != self.serving:
            mark_serving(self.health, [SERVICE_NAME], serving=serving)
        if serving and not self.serving:
            logger.info("router serving" + (" again" if self.ever_served else ""))
            self.ever_served = True
        elif not serving and reason != self.reason and (self.serving or self.ever_served):
            logger.warning("router not serving: %s", reason)
        self.serving, self.reason = serving, reason
