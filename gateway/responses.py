"""Router responses -> OpenAI JSON: whole responses, stream chunks, logprobs, prompt logprobs, echo, usage."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.tokenizer import Tokenizer
from gateway.call_stream import CallStream, Delta
from gateway.reasoning import Reasoning, ReasoningStream
from gateway.tools import ToolPlan
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


def completion_logprobs(
    lps: Sequence[pb.TokenLogprobs], k: int, text: TokenText, offset: int, unscored: Sequence[int] = ()
) -> dict:
    """OpenAI's completions logprobs of `lps`, after `unscored`: tokens that have none (echo's first prompt
    token), null as vLLM gives them. `offset`: where the first token's text starts in the choice's."""
    tokens = [text(t) for t in unscored] + [text(lp.token_id) for lp in lps]
    offsets = []
    for s in tokens:
        offsets.append(offset)
        offset += len(s)
    none = [None] * len(unscored)
    return {
        "tokens": tokens,
        "token_logprobs": [*none, *(lp.logprob for lp in lps)],
        "top_logprobs": [
            *none,
            *(
                {
                    text(t.token_id): t.logprob
                    for t in [*_top(lp, k), pb.TopLogprob(token_id=lp.token_id, logprob=lp.logprob)]
                }
                for lp in lps
            ),
        ],
        "text_offset": offsets,
    }


def prompt_logprobs_json(lps: Sequence[pb.TokenLogprobs], k: int, text: TokenText) -> list[dict | None]:
    """vLLM's prompt_logprobs: null for the first prompt token (nothing predicts it), then per token
    {token id: {logprob, rank, decoded_token}} holding the prompt's token and the top k. A rank is the place
    among those top k (1: the likeliest), so the prompt's token has null where it is not among them: vLLM
    gives its place in the whole vocabulary there, which the engine does not compute."""
    out: list[dict | None] = [None]
    for lp in lps:
        top = _top(lp, k)
        rank = {t.token_id: r for r, t in enumerate(top, 1)}
        entry = {str(lp.token_id): _prompt_entry(lp.logprob, rank.get(lp.token_id), text(lp.token_id))}
        for t in top:
            entry.setdefault(str(t.token_id), _prompt_entry(t.logprob, rank[t.token_id], text(t.token_id)))
        out.append(entry)
    return out


def _prompt_entry(logprob: float, rank: int | None, decoded: str) -> dict:
    return {"logprob": logprob, "rank": rank, "decoded_token": decoded}


@dataclass(frozen=True)
class Echo:
    """/v1/completions' echo, per prompt: its text and its token ids (a text prompt's only with logprobs).
    `only` (max_tokens 0): the prompt alone; the one token generated for it is dropped."""

    texts: list[str]
    token_ids: list[list[int]]
    only: bool


@dataclass
class Choice:
    text: list[str] = field(default_factory=list)
    logprobs: list[pb.TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | None = None
    num_chars: int = 0  # text already streamed (completions' text_offset)
    num_tokens: int = 0  # tokens already streamed (continuous usage stats)


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
    """One HTTP request's responses. `chat` picks the chat or the completions shape; `n` completions of each
    prompt are choices i * n ... i * n + n - 1. `prompt_logprobs`: the top ones vLLM's prompt_logprobs field
    shows (None: not asked for); each prompt's come with its completion 0's first message (`saw`)."""

    def __init__(
        self,
        chat: bool,
        model: str,
        num_logprobs: int | None,
        token_text: TokenText,
        n: int = 1,
        prompt_logprobs: int | None = None,
        echo: Echo | None = None,
        tools: ToolPlan | None = None,
        continuous_usage: bool = False,
        reasoning: Reasoning | None = None,
    ) -> None:
        self.chat = chat
        self.reasoning = reasoning  # chat's reasoning split off (gateway/reasoning.py), None: none
        self.thinking: dict[int, ReasoningStream] = {}  # a stream's choices' reasoning parsers
        self.continuous_usage = continuous_usage  # every chunk carries its choice's usage so far (vLLM's)
        self.tools = tools  # chat's tool calls (gateway/tools.py), None: plain text
        self.calls: dict[int, CallStream] = {}  # a stream's choices' tool-call parsers
        self.model = model
        self.num_logprobs = num_logprobs
        self.text = token_text
        self.n = n
        self.num_prompt_logprobs = prompt_logprobs
        self.echo = echo
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.prompts: dict[int, list[pb.TokenLogprobs]] = {}  # prompt i -> its logprobs
        self.streamed: dict[int, Choice] = {}  # a stream's choices so far
        # prompt i -> (choice, message) of its stream held back until its logprobs come
        self._held: dict[int, list[tuple[int, pb.GenerateResponse]]] = {}

    def saw(self, offset: int, resp: pb.GenerateResponse) -> None:
        """Every router message of the call whose choices start at `offset`: keeps its prompt's logprobs."""
        prompt = offset // self.n
        if resp.index == 0 and (resp.token_ids or resp.prompt_logprobs) and prompt not in self.prompts:
            self.prompts[prompt] = list(resp.prompt_logprobs)

    def _logprobs(
        self, lps: Sequence[pb.TokenLogprobs], offset: int, unscored: Sequence[int] = ()
    ) -> dict | None:
        if self.num_logprobs is None:
            return None
        if self.chat:
            return chat_logprobs(list(lps), self.num_logprobs, self.text)
        return completion_logprobs(lps, self.num_logprobs, self.text, offset, unscored)

    def _echoed(
        self, index: int, text: str, lps: Sequence[pb.TokenLogprobs], first: bool
    ) -> tuple[str, Sequence[pb.TokenLogprobs], list[int]]:
        """Choice `index`'s text and logprobs with echo's prompt before them in its first part, and the
        prompt's tokens that have no logprobs (its first; all of them where the engine sent none)."""
        if self.echo is None:
            return text, lps, []
        if self.echo_only:
            text, lps = "", []
        if not first:
            return text, lps, []
        prompt = index // self.n
        scored, ids = self.prompts.get(prompt, []), self.echo.token_ids[prompt]
        return self.echo.texts[prompt] + text, [*scored, *lps], ids[: max(len(ids) - len(scored), 0)]

    @property
    def echo_only(self) -> bool:
        return self.echo is not None and self.echo.only

    def _finish(self, finish: str | None) -> str | None:
        return "length" if finish and self.echo_only else finish

    def _prompt_logprobs(self, prompt: int) -> list[dict | None]:
        assert self.num_prompt_logprobs is not None
        return prompt_logprobs_json(self.prompts.get(prompt, []), self.num_prompt_logprobs, self.text)

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
            text, lps, unscored = self._echoed(i, "".join(c.text), c.logprobs, first=True)
            item: dict = {
                "index": i,
                "logprobs": self._logprobs(lps, 0, unscored),
                "finish_reason": self._finish(c.finish_reason),
            }
            if self.chat:
                item["message"], item["finish_reason"] = self._message(text, item["finish_reason"])
            else:
                item["text"] = text
            item["stop_reason"] = None if self.echo_only else c.stop_reason
            if self.num_prompt_logprobs is not None and not self.chat:  # vLLM's: on each completions choice
                item["prompt_logprobs"] = self._prompt_logprobs(i // self.n)
            out.append(item)
        body = {**self._envelope(self.object, out), "usage": totals.to_json()}
        if self.num_prompt_logprobs is not None and self.chat:  # vLLM's: on the chat response itself
            body["prompt_logprobs"] = self._prompt_logprobs(0)
        return body

    def stream(self, index: int, resp: pb.GenerateResponse) -> list[dict]:
        """The stream chunks for a router message of choice `index`. An echo with logprobs holds a choice's
        chunks back until its prompt's logprobs have come (with completion 0's first message), then sends them
        in order."""
        prompt = index // self.n
        if self.echo is not None and self.num_logprobs is not None and prompt not in self.prompts:
            self._held.setdefault(prompt, []).append((index, resp))
            return []
        chunks = [self._chunk(i, r) for i, r in [*self._held.pop(prompt, []), (index, resp)]]
        return [c for c in chunks if c is not None]

    def flush(self) -> list[dict]:
        """The chunks still held when the calls end (a prompt whose completion 0 failed)."""
        held, self._held = self._held, {}
        chunks = [self._chunk(i, r) for p in sorted(held) for i, r in held[p]]
        return [c for c in chunks if c is not None]

    def _message(self, text: str, finish: str | None) -> tuple[dict, str | None]:
        """A whole chat choice's message: its reasoning split off, its tool calls picked out of the rest."""
        reasoning = ""
        if self.reasoning is not None:
            reasoning, text = self.reasoning.split(text)
        if self.tools is not None:
            message, finish = self.tools.message(text, finish)
        else:
            message = {"role": "assistant", "content": text if text or self.reasoning is None else None}
        if reasoning and self.reasoning is not None and self.reasoning.show:
            message["reasoning"] = message["reasoning_content"] = reasoning
        return message, finish

    def _parsed(self, index: int, text: str, finish: str | None) -> tuple[str, str, list[dict], str | None]:
        """A streamed chat piece through the reasoning and tool-call parsers: (reasoning, content, tool_calls
        entries, finish reason)."""
        reasoning = ""
        if self.reasoning is not None:
            thinking = self.thinking.setdefault(index, self.reasoning.stream())
            reasoning, text = thinking.feed(text)
            if finish:
                more, rest = thinking.finish()
                reasoning, text = reasoning + more, text + rest
            reasoning = reasoning if self.reasoning.show else ""
        if self.tools is None:
            return reasoning, text, [], finish
        calls = self.calls.setdefault(index, self.tools.stream())
        found = Delta()
        found.add(calls.feed(text))
        if finish:
            found.add(calls.finish())
            finish = self.tools.finish_reason(finish, calls)
        return reasoning, found.content, found.calls, finish

    def _chunk(self, index: int, resp: pb.GenerateResponse) -> dict | None:
        first = index not in self.streamed
        choice = self.streamed.setdefault(index, Choice())
        choice.num_tokens += len(resp.token_ids)
        finish = self._finish(resp.finish_reason or None)
        text, lps, unscored = self._echoed(index, resp.text, resp.logprobs, first)
        if self.echo_only and not (first or finish):
            return None  # the token generated for it, dropped
        delta: dict = {"role": "assistant"} if first else {}
        if self.chat and (self.tools is not None or self.reasoning is not None):
            reasoning, text, calls, finish = self._parsed(index, text, finish)
            if not (first or reasoning or text or calls or finish or lps):
                return None  # text a parser holds back (a tag's start, a call being read)
            if reasoning:
                delta["reasoning"] = delta["reasoning_content"] = reasoning
            delta["content"] = text or (None if calls or reasoning else "")
            if calls:
                delta["tool_calls"] = calls
        else:
            delta["content"] = text
        item: dict = {"index": index, "logprobs": None, "finish_reason": finish}
        if lps or unscored:
            item["logprobs"] = self._logprobs(lps, choice.num_chars, unscored)
        if self.chat:
            item["delta"] = delta
        else:
            item["text"] = text
        if finish:
            item["stop_reason"] = None if self.echo_only else (resp.stop_reason or None)
        choice.num_chars += len(text)
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        chunk = self._envelope(obj, [item])
        if self.continuous_usage:
            chunk["usage"] = {
                "prompt_tokens": resp.prompt_tokens,
                "completion_tokens": choice.num_tokens,
                "total_tokens": resp.prompt_tokens + choice.num_tokens,
            }
        if self.num_prompt_logprobs is not None and first and resp.index == 0:  # where `saw` found them
            where = chunk if self.chat else item
            where["prompt_logprobs"] = self._prompt_logprobs(index // self.n)
        return chunk

    def usage_chunk(self, totals: Totals) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._envelope(obj, []), "usage": totals.to_json()}
