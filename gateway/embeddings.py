"""OpenAI's /v1/embeddings over the router's Embed: every input its own router call, run side by side (at most
MAX_CONCURRENT at once), answered in input order as floats or base64 little-endian float32 (what the official
client asks for by default). vLLM's extras: truncate_prompt_tokens, normalize, priority, cache_salt."""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from typing import Annotated, Literal

import grpc
import numpy as np
from pydantic import Field

from gateway.errors import APIError, from_grpc
from gateway.protocol import INT32, Int32, TokenId, _Body
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc

MAX_INPUTS = 2048  # OpenAI's bound on inputs a request
MAX_CONCURRENT = 64  # router calls one request keeps open at once


class EmbeddingRequest(_Body):
    model: str
    input: str | list[str] | list[TokenId] | list[list[TokenId]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1, le=INT32)] | None = None
    user: str | None = None
    # vLLM's extras
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=INT32)] | None = None
    normalize: bool | None = None
    priority: Int32 = 0
    cache_salt: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """The inputs one by one: a string, a list of strings, one list of token ids, or lists of them."""
        x = self.input
        if isinstance(x, str):
            items: list[str | list[int]] = [x]
        elif x and all(isinstance(t, int) for t in x):
            items = [list(x)]  # type: ignore[arg-type]
        else:
            items = list(x)  # type: ignore[arg-type]
        if not items:
            raise APIError(400, "input must not be empty", "input", "invalid_request")
        if len(items) > MAX_INPUTS:
            raise APIError(
                400, f"input holds {len(items)} items; at most {MAX_INPUTS}", "input", "invalid_request"
            )
        for i, item in enumerate(items):
            if not item:
                raise APIError(400, f"input[{i}] is empty", "input", "invalid_request")
        return items

    def router_request(self, prompt: str | list[int], rid: str, salt: str | None) -> pb.EmbedRequest:
        req = pb.EmbedRequest(
            request_id=rid, model=self.model, priority=self.priority, cache_salt=salt or "",
            pooling=pb.PoolingParams(dimensions=self.dimensions, normalize=self.normalize),
        )  # fmt: skip
        if isinstance(prompt, str):
            req.text = prompt
        else:
            req.token_ids.ids.extend(prompt)
        if self.truncate_prompt_tokens is not None:
            req.truncate_prompt_tokens = self.truncate_prompt_tokens
        return req


class EmbedCalls:
    """A request's router calls: cancelled when the client goes, stopped with an error by the drain."""

    def __init__(self, stub: pb_grpc.RouterStub, requests: list[pb.EmbedRequest]) -> None:
        self.stub, self.requests = stub, requests
        self.error: APIError | None = None
        self._calls: set[grpc.aio.UnaryUnaryCall] = set()
        self._limit = asyncio.Semaphore(MAX_CONCURRENT)

    async def run(self) -> list[pb.EmbedResponse]:
        """Every input's answer, in order; the first failure raises its APIError and cancels the rest."""
        tasks = [asyncio.ensure_future(self._one(r)) for r in self.requests]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()
            self.cancel()

    async def _one(self, request: pb.EmbedRequest) -> pb.EmbedResponse:
        async with self._limit:
            if self.error is not None:
                raise self.error
            call = self.stub.Embed(request)
            self._calls.add(call)
            try:
                return await call
            except grpc.aio.AioRpcError as exc:
                raise from_grpc(exc) from None
            except asyncio.CancelledError:
                if self.error is not None:  # stopped by the drain, not by the client
                    raise self.error from None
                raise
            finally:
                self._calls.discard(call)

    def cancel(self) -> None:
        for call in list(self._calls):
            call.cancel()

    def stop(self, error: APIError) -> None:
        self.error = error
        self.cancel()


def embedding_response(body: EmbeddingRequest, model: str, replies: list[pb.EmbedResponse]) -> dict:
    def encoded(values) -> list[float] | str:  # type: ignore[no-untyped-def]
        if body.encoding_format == "base64":
            return base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode("ascii")
        return list(values)

    prompt_tokens = sum(r.prompt_tokens for r in replies)
    return {
        "id": f"embd-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": [
            {"index": i, "object": "embedding", "embedding": encoded(r.embedding)}
            for i, r in enumerate(replies)
        ],
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens, "completion_tokens": 0},
    }
