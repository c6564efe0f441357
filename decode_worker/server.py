"""gRPC Decode service: admits a request, gets its prompt's KV from the prefill worker, streams tokens."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Iterable

import grpc
import numpy as np

from engine import trace
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc
from serving.drain import Drain
from serving.engine_proc import EngineProcess
from serving.grpc_common import (
    logprobs_from_proto,
    logprobs_to_proto,
    params_from_proto,
    prompt_logprobs_to_proto,
)
from serving.logs import bind_request
from serving.messages.from_engine import BlocksReserved, Error, FirstToken, Landed, Tokens
from serving.messages.to_engine import Abort, Admit, KVArrived, KVFailed
from serving.mux import ManyCall, ManyStream, RpcAbort, serve_many
from serving.tls import PLAINTEXT, TLSConfig
from serving.worker import STATUS, serve_embed, worker_load

logger = logging.getLogger(__name__)

SERVICE_NAME = "pdserve.v1.Decode"


class DecodeServicer(pb_grpc.DecodeServicer):
    def __init__(
        self,
        engine: EngineProcess,
        drain: Drain | None = None,
        prefill_timeout_s: float = 600.0,
        tls: TLSConfig = PLAINTEXT,
    ) -> None:
        self.engine = engine
        self.tls = tls  # the channels to prefill workers
        self.drain = drain or Drain()
        self._admitted = self.drain.admit(lambda request, _: self._generate(request))
        self.prefill_timeout_s = prefill_timeout_s
        self._streams: dict[str, ManyStream] = {}  # prefill worker address -> its shared stream
        self._descriptor_json: str | None = None
        # blocks of prefills started ahead whose reservation the engine has not reported yet
        self._promised = 0

    async def Generate(self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext):
        try:
            async for chunk in self._admitted(request, None):
                yield chunk
        except RpcAbort as abort:
            await context.abort(abort.code, abort.details)

    async def GenerateMany(self, frames, context: grpc.aio.ServicerContext):
        """Generate calls multiplexed on one stream (the router's; serving/mux.py)."""
        replies = serve_many(frames, self._admitted, pb.DecodeReply, "chunk", self.drain.started)
        async for reply in self.drain.shared(replies):
            yield reply

    async def _generate(self, request: pb.DecodeRequest):
        """One request's chunks; raises RpcAbort with its status."""
        rid = request.request_id
        bind_request(rid)
        trace.mark(rid, "dserver.recv")
        try:
            params = params_from_proto(request.sampling)
            if params.n != 1:
                raise ValueError(
                    "a decode worker serves one completion per request (n=1); the router fans out"
                )
        except ValueError as exc:
            raise RpcAbort(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from exc
        if not self.engine.alive:
            raise RpcAbort(grpc.StatusCode.UNAVAILABLE, "the decode engine is not running")
        stream = self.engine.open(rid)
        prefill: asyncio.Task | None = None
        prefill_call: ManyCall | None = None
        grant: asyncio.Future | None = None
        finished = False
        promised = self._speculate(request)
        logger.info(
            "request %s: %d prompt tokens, prefill %s",
            rid,
            len(request.prompt_token_ids),
            request.prefill_address or "here",
        )
        if promised:  # the prefill starts now; the blocks our engine reserves follow
            self._promised += promised
            grant = asyncio.get_running_loop().create_future()
            # its frame is queued before anything else this request does: it is what the first token waits for
            prefill_call = self._open_prefill(request, None)
            prefill = asyncio.create_task(self._prefill(request, prefill_call, grant, stream))
        self.engine.send(
            Admit(
                rid,
                np.array(request.prompt_token_ids, dtype=np.int64),  # pickles ~15x faster than a list
                params,
                request.priority,
                request.cache_salt or None,
                prefill_remotely=bool(request.prefill_address),
            )
        )
        try:
            while not finished:
                msg = await stream.get()
                if trace.enabled:
                    trace.mark(rid, f"dserver.got_{type(msg).__name__}")
                if isinstance(msg, BlocksReserved) and grant is not None:  # for the prefill already running
                    self._promised, promised = self._promised - promised, 0
                    if not grant.done():
                        grant.set_result(msg)
                elif isinstance(msg, BlocksReserved):
                    prefill_call = self._open_prefill(request, msg)
                    prefill = asyncio.create_task(self._prefill(request, prefill_call, None, stream))
                elif isinstance(msg, Error):
                    finished = True
                    raise RpcAbort(STATUS[msg.code], msg.details)
                else:
                    finished = not isinstance(msg, FirstToken) and msg.finish_reason is not None
                    if finished:
                        logger.info("request %s finished: %s", rid, msg.finish_reason)  # type: ignore[union-attr]
                    if (chunk := _chunk(msg, request.prompt_token_ids)) is not None:
                        yield chunk
        finally:
            self._promised -= promised
            if not finished:  # cancelled by the caller, or this server is stopping
                self.engine.send(Abort(rid))
            if prefill is not None and not prefill.done():
                prefill.cancel()
                assert prefill_call is not None  # opened with the task; a task cancelled before it ran
                prefill_call.cancel()  # never got to cancel the call itself
            self.engine.close(rid)

    def _speculate(self, request: pb.DecodeRequest) -> int:
        """Start the prefill before our engine has reserved the prompt's blocks (they follow as a grant)
        when its last load report says they can be reserved at once, counting the blocks promised to
        other such prefills whose reservation has not shown yet: the decode-side admission (two hops
        through the engine process, ~2 ms at 4096 tokens on the H200 host) then overlaps the prefill
        instead of preceding it. Returns the blocks promised (0: no; the prefill waits for the
        reservation, as it does for prompts prefilled here)."""
        n, info, load = len(request.prompt_token_ids), self.engine.info, self.engine.load
        if not request.prefill_address or n <= info.get("local_prefill_threshold", 0):
            return 0
        need = -(-n // info["block_size"])
        free = load.get("num_free_blocks", 0) - self._promised
        return need if load.get("num_waiting", 1) == 0 and free >= 2 * need else 0

    def _open_prefill(self, request: pb.DecodeRequest, reserved: BlocksReserved | None) -> ManyCall:
        """Ask the prefill worker to fill our reserved blocks (with the receiver's token for them), or (None)
        the blocks our engine reserves next, sent as the call's second message (_write_grant). Queues the
        frame now."""
        call = self._prefill_stream(request.prefill_address).open(
            timeout=self.prefill_timeout_s,
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling=request.sampling,
            cache_salt=request.cache_salt,
            kv_descriptor=self._kv_descriptor,
            dst_block_ids=reserved.block_ids if reserved else (),
            kv_token=reserved.kv_token if reserved else "",
            priority=request.priority,
        )
        trace.mark(request.request_id, "dserver.call_prefill")
        return call

    async def _prefill(
        self,
        request: pb.DecodeRequest,
        call: ManyCall,
        grant: asyncio.Future | None,
        stream: asyncio.Queue,
    ) -> None:
        """Follow the prefill call (`_open_prefill`): send `grant`'s blocks when our engine has reserved
        them, put the prefill worker's first token on the request's `stream` at once (the KV is still on
        its way), and tell the engine how the transfer went."""
        rid = request.request_id
        writer = asyncio.create_task(self._write_grant(call, rid, grant)) if grant is not None else None
        first: FirstToken | None = None
        kv_done = False
        try:
            async for reply in call:
                if reply.kv_done:
                    kv_done = True
                    break
                if first is None:
                    trace.mark(rid, "dserver.first_token")
                    first = _first_token(rid, reply)
                    stream.put_nowait(first)
        except asyncio.CancelledError:
            call.cancel()
            raise
        except grpc.aio.AioRpcError as exc:
            code = exc.code().name if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED else "UNAVAILABLE"
            reason = f"prefill worker {request.prefill_address}: {exc.code().name}: {exc.details()}"
            self.engine.send(KVFailed(rid, reason if code != "INVALID_ARGUMENT" else exc.details()))
            return
        finally:
            if writer is not None:
                writer.cancel()
        if first is None or not kv_done:
            reason = (
                f"prefill worker {request.prefill_address} ended its reply before the KV transfer completed"
            )
            self.engine.send(KVFailed(rid, reason))
            return
        trace.mark(rid, "dserver.prefill_reply")
        self.engine.send(KVArrived(rid, first.token_id, first.logprobs, first.num_cached_tokens))

    async def _write_grant(self, call: ManyCall, rid: str, grant: asyncio.Future) -> None:
        """The call's second message, once our engine has reserved the blocks of a prefill started ahead."""
        reserved: BlocksReserved = await grant
        trace.mark(rid, "dserver.grant")
        with contextlib.suppress(grpc.aio.UsageError):  # the call ended: the reading side reports how
            await call.write(request_id=rid, dst_block_ids=reserved.block_ids, kv_token=reserved.kv_token)

    @property
    def _kv_descriptor(self) -> str:
        if self._descriptor_json is None:
            self._descriptor_json = json.dumps(self.engine.info["kv_descriptor"])
        return self._descriptor_json

    def _prefill_stream(self, address: str) -> ManyStream:
        """One shared stream per prefill worker (serving/mux.py), on one channel each."""
        stream = self._streams.get(address)
        if stream is None:
            channel = self.tls.aio_channel(address)
            stub = pb_grpc.PrefillStub(channel)
            stream = self._streams[address] = ManyStream(stub.PrefillMany, pb.PrefillFrame, "response")
        return stream

    async def Embed(
        self, request: pb.WorkerEmbedRequest, context: grpc.aio.ServicerContext
    ) -> pb.EmbedResponse:
        return await serve_embed(self.engine, self.drain, request, context)

    async def GetLoad(self, request: pb.LoadRequest, context: grpc.aio.ServicerContext) -> pb.WorkerLoad:
        if not self.engine.alive:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the decode engine is not running")
        return worker_load(self.engine, self.drain.draining)

    async def close(self) -> None:
        """End the streams to prefill workers (every request has ended: nothing is on them)."""
        for stream in self._streams.values():
            stream.close()
        self._streams.clear()


def _first_token(rid: str, reply: pb.PrefillResponse) -> FirstToken:
    logprobs = logprobs_from_proto(reply.first_logprobs) if reply.HasField("first_logprobs") else None
    prompt = tuple(logprobs_from_proto(lp) for lp in reply.prompt_logprobs)
    return FirstToken(rid, reply.first_token_id, logprobs, reply.num_cached_tokens, prompt)


def _chunk(msg: FirstToken | Tokens | Landed, prompt_ids: Iterable[int]) -> pb.DecodeChunk | None:
    """The router's chunk for a message on a request's stream (None: nothing to tell it)."""
    if isinstance(msg, FirstToken):  # the prefill worker's, streamed on before its KV transfer completes
        lps = [] if msg.logprobs is None else [logprobs_to_proto(msg.token_id, msg.logprobs)]
        return pb.DecodeChunk(
            token_ids=[msg.token_id],
            logprobs=lps,
            num_cached_tokens=msg.num_cached_tokens,
            prompt_logprobs=prompt_logprobs_to_proto(prompt_ids, msg.prompt_logprobs),
        )
    if isinstance(msg, Landed):  # that first token joined the batch: only whether it ended the completion
        if msg.finish_reason is None:
            return None
        return pb.DecodeChunk(finish_reason=msg.finish_reason, stop_reason=msg.stop_reason or "")
    return pb.DecodeChunk(
        token_ids=msg.token_ids,
        finish_reason=msg.finish_reason or "",
        stop_reason=msg.stop_reason or "",
        logprobs=[logprobs_to_proto(t, lp) for t, lp in zip(msg.token_ids, msg.logprobs)],
        num_cached_tokens=msg.num_cached_tokens,
        prompt_logprobs=prompt_logprobs_to_proto(prompt_ids, msg.prompt_logprobs),
    )


def add_servicer(servicer: DecodeServicer, server: grpc.aio.Server) -> None:
    pb_grpc.add_DecodeServicer_to_server(servicer, server)
