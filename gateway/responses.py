"""Router responses -> OpenAI JSON: whole responses, stream chunks, logprobs, usage."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from engine.tokenizer import Tokenizer
from protos import pdserve_pb2 as pb


class TokenText:
    """Token id -> its text for logprobs (vLLM's `token_id:N` when the gateway has no tokenizer)."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        text = self._cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._cache) < 200_000:
                self._cache[token_id] = text
        return text


def _top(lp: pb.TokenLogprobs, k: int) -> list[pb.TopLogprob]:
    return sorted(lp.top, key=lambda t: -t.logprob)[:k]


def chat_logprobs(lps: list[pb.TokenLogprobs], k: int, text: TokenText) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        s = text(token_id)
        return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8", "replace"))}

    return {
        "content": [
            {
                **entry(lp.token_id, lp.logprob),
                "top_logprobs": [entry(t.token_id, t.logprob) for t in _top(lp, k)],
            }
            for lp in lps
        ]
    }


def completion_logprobs(lps: list[pb.TokenLogprobs], k: int, text: TokenText, offset: int) -> dict:
    tokens = [text(lp.token_id) for lp in lps]
    offsets = []
    for s in tokens:
        offsets.append(offset)
        offset += len(s)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [
            {
                text(t.token_id): t.logprob
                for t in [*_top(lp, k), pb.TopLogprob(token_id=lp.token_id, logprob=lp.logprob)]
            }
            for lp in lps
        ],
        "text_offset": offsets,
    }


@dataclass
class Choice:
    text: list[str] = field(default_factory=list)
    logprobs: list[pb.TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | None = None
    num_chars: int = 0  # text already streamed (completions' text_offset)


@dataclass
class Totals:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def add(self, usage: pb.Usage) -> None:
        self.prompt_tokens += usage.prompt_tokens
        self.completion_tokens += usage.completion_tokens
        self.cached_tokens += usage.cached_tokens

    def to_json(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


class Formatter:
    """One HTTP request's responses. `chat` picks the chat or the completions shape."""

    def __init__(self, chat: bool, model: str, num_logprobs: int | None, token_text: TokenText) -> None:
        self.chat = chat
        self.model = model
        self.num_logprobs = num_logprobs
        self.text = token_text
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _logprobs(self, lps: list[pb.TokenLogprobs], offset: int) -> dict | None:
        if self.num_logprobs is None:
            return None
        if self.chat:
            return chat_logprobs(lps, self.num_logprobs, self.text)
        return completion_logprobs(lps, self.num_logprobs, self.text, offset)

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def whole(self, choices: dict[int, Choice], totals: Totals) -> dict:
        out = []
        for i in sorted(choices):
            c = choices[i]
            item: dict = {
                "index": i,
                "logprobs": self._logprobs(c.logprobs, 0),
                "finish_reason": c.finish_reason,
            }
            text = "".join(c.text)
            if self.chat:
                item["message"] = {"role": "assistant", "content": text}
            else:
                item["text"] = text
            item["stop_reason"] = c.stop_reason
            out.append(item)
        return {**self._envelope(self.object, out), "usage": totals.to_json()}

    def chunk(self, index: int, resp: pb.GenerateResponse, choice: Choice, first: bool) -> dict:
        """A stream chunk for one router message of choice `index`."""
        finish = resp.finish_reason or None
        item: dict = {"index": index, "logprobs": None, "finish_reason": finish}
        if resp.logprobs:
            item["logprobs"] = self._logprobs(list(resp.logprobs), choice.num_chars)
        if self.chat:
            delta: dict = {"role": "assistant", "content": resp.text} if first else {"content": resp.text}
            item["delta"] = delta
        else:
            item["text"] = resp.text
        if finish:
            item["stop_reason"] = resp.stop_reason or None
        choice.num_chars += len(resp.text)
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return self._envelope(obj, [item])

    def usage_chunk(self, totals: Totals) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._envelope(obj, []), "usage": totals.to_json()}
