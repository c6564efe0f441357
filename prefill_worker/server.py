"""gRPC Prefill service: compute a prompt's KV into the decode worker's blocks, return the first token."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from collections.abc import AsyncIterator, Iterable

import grpc
import numpy as np

from engine import trace
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc
from serving.drain import Drain
from serving.engine_proc import EngineProcess
from serving.grpc_common import logprobs_to_proto, params_from_proto, prompt_logprobs_to_proto
from serving.kv_events import EventBatch
from serving.logs import bind_request
from serving.messages.from_engine import Error, FirstToken, KVEvents, KVSent, Snapshot
from serving.messages.to_engine import Abort, Grant, PrefillPrompt, TakeSnapshot
from serving.mux import RpcAbort, serve_many
from serving.worker import STATUS, serve_embed, worker_load

logger = logging.getLogger(__name__)

SERVICE_NAME = "pdserve.v1.Prefill"


class PrefillServicer(pb_grpc.PrefillServicer):
    def __init__(self, engine: EngineProcess, drain: Drain | None = None, keep_batches: int = 4096) -> None:
        self.engine = engine
        self.drain = drain or Drain()
        self._admitted = self.drain.admit(self._prefill)  # a grant for an admitted call is not a new request
        self.events: deque[tuple[int, bytes]] = deque(maxlen=keep_batches)  # (seq, EventBatch bytes)
        self._snapshots = itertools.count()
        engine.handlers[KVEvents] = self._on_events

    def _on_events(self, msg: KVEvents) -> None:
        self.events.append((EventBatch.from_bytes(msg.data).seq, msg.data))

    async def GetKVEvents(
        self, request: pb.KVEventsRequest, context: grpc.aio.ServicerContext
    ) -> pb.KVEventsResponse:
        if not self.engine.alive:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the prefill engine is not running")
        epoch = self.engine.info["epoch"]
        kept_from = self.events[0][0] if self.events else None
        if request.epoch == epoch and (kept_from is None or kept_from <= request.after_seq + 1):
            return pb.KVEventsResponse(
                epoch=epoch, batches=[d for seq, d in self.events if seq > request.after_seq]
            )
        rid = f"snapshot-{next(self._snapshots)}"
        stream = self.engine.open(rid)
        try:
            self.engine.send(TakeSnapshot(rid))
            msg = await asyncio.wait_for(stream.get(), timeout=30)
        finally:
            self.engine.close(rid)
        if not isinstance(msg, Snapshot):
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"snapshot failed: {msg.details}")
        return pb.KVEventsResponse(epoch=epoch, snapshot=msg.data)

    async def Prefill(self, requests, context: grpc.aio.ServicerContext):
        """Reads the prompt (and later, when it came without them, the reserved blocks); streams the first
        token as soon as it is sampled, then {kv_done} once the KV is written."""
        try:
            request = await anext(aiter(requests))
        except StopAsyncIteration:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no PrefillRequest was sent")
            raise AssertionError("abort raises") from None
        try:
            async for reply in self._admitted(request, requests):
                yield reply
        except RpcAbort as abort:
            await context.abort(abort.code, abort.details)

    async def PrefillMany(self, frames, context: grpc.aio.ServicerContext):
        """Prefill calls multiplexed on one stream (a decode worker's; serving/mux.py)."""
        replies = serve_many(frames, self._admitted, pb.PrefillReply, "response", self.drain.started)
        async for reply in self.drain.shared(replies):
            yield reply

    async def _prefill(self, request: pb.PrefillRequest, later: AsyncIterator[pb.PrefillRequest]):
        """One call's replies; `later` yields the caller's next messages (the grant). Raises RpcAbort."""
        rid = request.request_id
        bind_request(rid)
        trace.mark(rid, "pserver.recv")
        try:
            params = params_from_proto(request.sampling)
        except ValueError as exc:
            raise RpcAbort(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from exc
        if not self.engine.alive:
            raise RpcAbort(grpc.StatusCode.UNAVAILABLE, "the prefill engine is not running")
        stream = self.engine.open(rid)
        done = False
        grant = None if request.dst_block_ids else asyncio.create_task(self._forward_grant(rid, later))
        try:
            self.engine.send(
                PrefillPrompt(
                    rid,
                    np.array(request.prompt_token_ids, dtype=np.int64),  # pickles ~15x faster than a list
                    params,
                    request.cache_salt or None,
                    request.kv_descriptor,
                    tuple(request.dst_block_ids),
                    request.priority,
                    request.kv_token,
                )
            )
            while True:
                msg = await stream.get()
                if isinstance(msg, Error):
                    done = True
                    raise RpcAbort(STATUS[msg.code], msg.details)
                if isinstance(msg, FirstToken):
                    trace.mark(rid, "pserver.first")
                    yield _first_token(msg, request.prompt_token_ids)
                elif isinstance(msg, KVSent):
                    done = True
                    trace.mark(rid, "pserver.kv_done")
                    logger.info("request %s: prefilled %d prompt tokens", rid, len(request.prompt_token_ids))
                    yield pb.PrefillResponse(kv_done=True)
                    return
        finally:
            if grant is not None:
                grant.cancel()
            if not done:
                self.engine.send(Abort(rid))
            self.engine.close(rid)

    async def _forward_grant(self, rid: str, later: AsyncIterator[pb.PrefillRequest]) -> None:
        """The caller's second message: the blocks it reserved, for a prompt that started without them."""
        async for request in later:
            if request.dst_block_ids:
                trace.mark(rid, "pserver.grant")
                self.engine.send(Grant(rid, tuple(request.dst_block_ids), request.kv_token))
                return

    async def Embed(
        self, request: pb.WorkerEmbedRequest, context: grpc.aio.ServicerContext
    ) -> pb.EmbedResponse:
        return await serve_embed(self.engine, self.drain, request, context)

    async def GetLoad(self, request: pb.LoadRequest, context: grpc.aio.ServicerContext) -> pb.WorkerLoad:
        if not self.engine.alive:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the prefill engine is not running")
        return worker_load(self.engine, self.drain.draining)

    async def close(self) -> None:
        """Nothing of its own to close: its calls are the decode workers'."""


def _first_token(msg: FirstToken, prompt_ids: Iterable[int]) -> pb.PrefillResponse:
    reply = pb.PrefillResponse(
        first_token_id=msg.token_id,
        num_cached_tokens=msg.num_cached_tokens,
        prompt_logprobs=prompt_logprobs_to_proto(prompt_ids, msg.prompt_logprobs),
    )
    if msg.logprobs is not None:
        reply.first_logprobs.CopyFrom(logprobs_to_proto(msg.token_id, msg.logprobs))
    return reply


def add_servicer(servicer: PrefillServicer, server: grpc.aio.Server) -> None:
    pb_grpc.add_PrefillServicer_to_server(servicer, server)
