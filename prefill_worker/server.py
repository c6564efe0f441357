"""gRPC Prefill service: compute a prompt's KV into the decode worker's blocks, return the first token."""

from __future__ import annotations

import logging

import grpc

from engine.engine_proc import EngineProcess
from engine.grpc_common import logprobs_to_proto, params_from_proto
from engine.serving import STATUS
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

SERVICE_NAME = "pdserve.v1.Prefill"


class PrefillServicer(pb_grpc.PrefillServicer):
    def __init__(self, engine: EngineProcess) -> None:
        self.engine = engine

    async def Prefill(
        self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> pb.PrefillResponse:
        rid = request.request_id
        try:
            params = params_from_proto(request.sampling)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if not self.engine.alive:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the prefill engine is not running")
        stream = self.engine.open(rid)
        done = False
        try:
            self.engine.send(
                (
                    "prefill",
                    rid,
                    list(request.prompt_token_ids),
                    params,
                    request.cache_salt or None,
                    request.kv_descriptor,
                    list(request.dst_block_ids),
                )
            )
            msg = await stream.get()
            done = True
            if msg[0] == "error":
                await context.abort(STATUS[msg[2]], msg[3])
            _, _, token, logprobs, cached = msg
            reply = pb.PrefillResponse(first_token_id=token, num_cached_tokens=cached)
            if logprobs is not None:
                reply.first_logprobs.CopyFrom(logprobs_to_proto(token, logprobs))
            return reply
        finally:
            if not done:
                self.engine.send(("abort", rid))
            self.engine.close(rid)

    async def GetLoad(self, request: pb.LoadRequest, context: grpc.aio.ServicerContext) -> pb.WorkerLoad:
        if not self.engine.alive:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the prefill engine is not running")
        load = self.engine.load
        info = self.engine.info
        return pb.WorkerLoad(
            worker_id=info["worker_id"],
            role="prefill",
            block_size=info["block_size"],
            model=info["model"],
            max_model_len=info["max_model_len"],
            vocab_size=info["vocab_size"],
            **load,
        )


def add_servicer(servicer: PrefillServicer, server: grpc.aio.Server) -> None:
    pb_grpc.add_PrefillServicer_to_server(servicer, server)
