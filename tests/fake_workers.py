"""Small stand-in prefill and decode workers (real grpc.aio servers) for the router's fault tests.

A `FakePrefill` answers GetLoad and GetKVEvents from a block set the test controls (`store`), numbered
batches under a random epoch, a snapshot on a gap or another epoch, as a real prefill worker does. A
`FakeDecode` answers GenerateMany (on serving/mux.py's shared stream) with `tokens` tokens, `delay_s` apart,
and records which prefill worker each call names. Either can refuse or stall its GetLoad answers, and a
FakeDecode's streams can go mute.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator

import grpc

from engine.block_hash import BlockHash
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc
from serving.kv_events import BlockStored, EventBatch, Snapshot
from serving.mux import RpcAbort, serve_many

BLOCK_SIZE = 16


class _Load:
    role = "prefill"

    def __init__(self, vocab_size: int, max_model_len: int) -> None:
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.epoch = secrets.randbits(63) or 1
        self.draining = False
        self.polls = 0
        self.load_refusal: grpc.StatusCode | None = None  # GetLoad fails with this (a server shutting down)
        self.load_delay_s = 0.0  # GetLoad answers this late (a busy or wedged worker)

    async def GetLoad(self, request: pb.LoadRequest, context: grpc.aio.ServicerContext) -> pb.WorkerLoad:
        self.polls += 1
        if self.load_refusal is not None:
            await context.abort(self.load_refusal, "refused")
        await asyncio.sleep(self.load_delay_s)
        return pb.WorkerLoad(
            role=self.role,
            num_free_blocks=1000,
            num_total_blocks=1000,
            block_size=BLOCK_SIZE,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            epoch=self.epoch,
            draining=self.draining,
        )


class FakePrefill(_Load, pb_grpc.PrefillServicer):
    def __init__(self, vocab_size: int = 1000, max_model_len: int = 1024) -> None:
        super().__init__(vocab_size, max_model_len)
        self.held: set[BlockHash] = set()
        self.batches: list[EventBatch] = []
        self.snapshots = 0
        self.corrupt = 0  # answer this many GetKVEvents calls with bytes that do not parse

    def store(self, hashes: list[BlockHash]) -> None:
        self.held.update(hashes)
        self.batches.append(
            EventBatch("w", self.epoch, len(self.batches) + 1, (BlockStored(tuple(hashes)),), time.time())
        )

    async def GetKVEvents(
        self, request: pb.KVEventsRequest, context: grpc.aio.ServicerContext
    ) -> pb.KVEventsResponse:
        if self.corrupt > 0:
            self.corrupt -= 1
            return pb.KVEventsResponse(epoch=self.epoch, batches=[b"not a batch"])
        if request.epoch == self.epoch:
            newer = [b.to_bytes() for b in self.batches if b.seq > request.after_seq]
            return pb.KVEventsResponse(epoch=self.epoch, batches=newer)
        self.snapshots += 1
        snap = Snapshot("w", self.epoch, len(self.batches), tuple(self.held), time.time())
        return pb.KVEventsResponse(epoch=self.epoch, snapshot=snap.to_bytes())


class FakeDecode(_Load, pb_grpc.DecodeServicer):
    role = "decode"

    def __init__(self, vocab_size: int = 1000, max_model_len: int = 1024) -> None:
        super().__init__(vocab_size, max_model_len)
        self.tokens = 2
        self.delay_s = 0.0
        self.prefill_of: dict[str, str] = {}  # request id -> the prefill worker it named
        self.cancelled: list[str] = []
        self.open = 0
        self.mute = False  # its streams send nothing more, pongs included (a wedged worker)

    async def GenerateMany(self, frames, context: grpc.aio.ServicerContext):
        async for reply in serve_many(frames, self._generate, pb.DecodeReply, "chunk"):
            if self.mute:
                await asyncio.Event().wait()  # until the caller cancels the stream
            yield reply

    async def _generate(
        self, request: pb.DecodeRequest, more: AsyncIterator
    ) -> AsyncIterator[pb.DecodeChunk]:
        self.prefill_of[request.request_id] = request.prefill_address
        if self.draining:
            raise RpcAbort(grpc.StatusCode.UNAVAILABLE, "server shutting down")
        self.open += 1
        try:
            for i in range(self.tokens):
                await asyncio.sleep(self.delay_s)
                last = i == self.tokens - 1
                yield pb.DecodeChunk(token_ids=[7], finish_reason="length" if last else "")
        except asyncio.CancelledError:
            self.cancelled.append(request.request_id)
            raise
        finally:
            self.open -= 1


async def start(servicer: FakePrefill | FakeDecode, port: int = 0) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    if isinstance(servicer, FakeDecode):
        pb_grpc.add_DecodeServicer_to_server(servicer, server)
    else:
        pb_grpc.add_PrefillServicer_to_server(servicer, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, f"127.0.0.1:{port}"
