"""OpenAI's /v1/embeddings over the router's Embed: every input its own router call, run side by side
(gateway/router_calls.py), answered in input order as floats or base64 little-endian float32 (what the official
client asks for by default). vLLM's extras: truncate_prompt_tokens, normalize, priority, cache_salt, and chat
`messages` in place of `input` (one embedding of the conversation rendered with the model's chat template, no
generation prompt unless add_generation_prompt).

vLLM's score and rerank APIs over the same calls, as vLLM answers them for embedding models: a pair's score
is the cosine similarity of the two texts' embeddings (`/score`: text_1 against each text_2, or pair by pair;
`/rerank`: the query against each document, best first)."""

from __future__ import annotations

import base64
import time
import uuid
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import Field

from gateway.errors import APIError
from gateway.protocol import INT32, ChatMessage, Int32, TokenId, _Body
from gateway.router_calls import RouterCalls
from gateway.router_client import Rendering, render_chat
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc

MAX_INPUTS = 2048  # OpenAI's bound on inputs a request


class EmbeddingRequest(_Body):
    model: str
    input: str | list[str] | list[TokenId] | list[list[TokenId]] | None = None
    # vLLM's chat embeddings: the conversation instead of input
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_generation_prompt: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1, le=INT32)] | None = None
    user: str | None = None
    # vLLM's extras
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=INT32)] | None = None
    normalize: bool | None = None
    priority: Int32 = 0
    cache_salt: str | None = None

    def prompts(self, rendering: Rendering) -> list[str | list[int] | pb.ChatMessages]:
        """The inputs one by one: a string, a list of strings, one list of token ids, or lists of them; or the
        one conversation of `messages`."""
        if (self.input is None) == (self.messages is None):
            raise APIError(400, "give either input or messages", "input", "invalid_request")
        if self.messages is not None:
            return [
                render_chat(
                    self.messages, self.add_generation_prompt, None, self.chat_template_kwargs, rendering
                )
            ]
        x = self.input
        if isinstance(x, str):
            items: list[str | list[int] | pb.ChatMessages] = [x]
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

    def router_request(
        self, prompt: str | list[int] | pb.ChatMessages, rid: str, salt: str | None
    ) -> pb.EmbedRequest:
        req = pb.EmbedRequest(
            request_id=rid, model=self.model, priority=self.priority, cache_salt=salt or "",
            pooling=pb.PoolingParams(dimensions=self.dimensions, normalize=self.normalize),
        )  # fmt: skip
        if isinstance(prompt, str):
            req.text = prompt
        elif isinstance(prompt, pb.ChatMessages):
            req.chat.CopyFrom(prompt)
        else:
            req.token_ids.ids.extend(prompt)
        if self.truncate_prompt_tokens is not None:
            req.truncate_prompt_tokens = self.truncate_prompt_tokens
        return req


class EmbedCalls(RouterCalls):
    """A request's Embed calls (gateway/router_calls.py)."""

    def __init__(self, stub: pb_grpc.RouterStub, requests: list[pb.EmbedRequest]) -> None:
        super().__init__(stub)
        self.requests = requests

    async def run(self) -> list[pb.EmbedResponse]:
        """Every input's answer, in order."""
        return await self.each(self.requests, self.stub.Embed, _answer)


async def _answer(call: Any) -> Any:
    return await call


class ScoreRequest(_Body):
    """vLLM's /score: text_1 (one, or as many as text_2) against text_2."""

    model: str
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=INT32)] | None = None
    priority: Int32 = 0

    def pairs(self) -> tuple[list[str], list[tuple[int, int]]]:
        """The distinct texts to embed, and each pair as (index of its first, of its second) among them."""
        first = [self.text_1] if isinstance(self.text_1, str) else list(self.text_1)
        second = [self.text_2] if isinstance(self.text_2, str) else list(self.text_2)
        if not first or not second:
            raise APIError(400, "text_1 and text_2 must not be empty", None, "invalid_request")
        if len(first) != 1 and len(first) != len(second):
            msg = f"text_1 holds {len(first)} texts and text_2 {len(second)}: give one text_1, or one per text_2"
            raise APIError(400, msg, "text_1", "invalid_request")
        texts = first + second
        if len(texts) > MAX_INPUTS:
            raise APIError(400, f"{len(texts)} texts to score; at most {MAX_INPUTS}", None, "invalid_request")
        pairs = [(0 if len(first) == 1 else i, len(first) + i) for i in range(len(second))]
        return texts, pairs


class RerankRequest(_Body):
    """vLLM's /rerank (Jina's and Cohere's shape): the documents ordered by their score against the query."""

    model: str
    query: str
    documents: list[str]
    top_n: Annotated[int, Field(ge=0, le=INT32)] | None = None  # 0 or unset: all of them
    return_documents: bool = True
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=INT32)] | None = None
    priority: Int32 = 0

    def pairs(self) -> tuple[list[str], list[tuple[int, int]]]:
        if not self.documents:
            raise APIError(400, "documents must not be empty", "documents", "invalid_request")
        return ScoreRequest(model=self.model, text_1=self.query, text_2=self.documents).pairs()


def embedding_requests(
    texts: list[str], body: ScoreRequest | RerankRequest, rids: list[str], salt: str | None
) -> list[pb.EmbedRequest]:
    """Each text's Embed call, normalized: a dot product of two is then their cosine similarity."""
    out = []
    for text, rid in zip(texts, rids):
        if not text:
            raise APIError(400, "a text to score is empty", None, "invalid_request")
        req = pb.EmbedRequest(request_id=rid, model=body.model, text=text, priority=body.priority,
                              cache_salt=salt or "", pooling=pb.PoolingParams(normalize=True))  # fmt: skip
        if body.truncate_prompt_tokens is not None:
            req.truncate_prompt_tokens = body.truncate_prompt_tokens
        out.append(req)
    return out


def cosine(a, b) -> float:  # type: ignore[no-untyped-def]
    """The cosine similarity of two embeddings, in float64."""
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    denom = float(np.linalg.norm(x) * np.linalg.norm(y))
    return float(x @ y) / denom if denom else 0.0


def score_response(
    model: str, replies: list[pb.EmbedResponse], pairs: list[tuple[int, int]], rerank: RerankRequest | None
) -> dict:
    scores = [cosine(replies[i].embedding, replies[j].embedding) for i, j in pairs]
    tokens = sum(r.prompt_tokens for r in replies)
    if rerank is None:
        return {
            "id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
        }  # fmt: skip
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    if rerank.top_n:
        order = order[: rerank.top_n]
    results = []
    for i in order:
        result: dict = {"index": i, "relevance_score": scores[i]}
        if rerank.return_documents:
            result["document"] = {"text": rerank.documents[i]}
        results.append(result)
    return {
        "id": f"rerank-{uuid.uuid4().hex}", "model": model, "results": results,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }  # fmt: skip


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
