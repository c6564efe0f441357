"""Text and chat prompts to token ids, with bounded work per request and none of it on the event loop.

Tokenizing runs in a small pool of threads of its own. The work queued or running is bounded twice: at most
`max_pending` prompts and at most `max_pending_chars` characters of them (a prompt is always taken when
nothing else is pending). A prompt beyond either is refused (`Overloaded`), so a burst of huge prompts cannot
starve the router's polls and health answers or queue without bound, while a burst of ordinary ones queues. Before any of that, `min_tokens` bounds a
prompt's length from its size alone: no token is longer than `max_token_chars` characters, so a prompt of
C characters has at least ceil(C / max_token_chars) tokens, and one that cannot fit is refused unread
(`check_fits_by_size`; ModelInfo carries the bound, so the gateway refuses such a prompt before sending it).
Detokenizing and token strings (the Router's Tokenize and Detokenize calls) share the pool and its bounds,
each id counted as a character.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from engine.tokenizer import Tokenizer
from protos import pdserve_pb2 as pb

T = TypeVar("T")


class Overloaded(Exception):
    """Too many prompts are being tokenized already."""


def longest_token_chars(tokenizer: Tokenizer) -> int:
    """An upper bound on how many characters of input one token covers.

    The longer of each vocabulary entry's spelling (byte-level BPE spells each byte as one character, so the
    spelling is never shorter than the text) and its decoded text. A normalizer could fold several input
    characters into one (Unicode composition), so with one the bound is taken four times over.
    """
    backend = tokenizer.backend
    vocab = backend.get_vocab(with_added_tokens=True)
    longest = max(
        max(map(len, vocab), default=1),
        max((len(backend.decode([i], skip_special_tokens=False)) for i in vocab.values()), default=1),
    )
    has_normalizer = json.loads(backend.to_str()).get("normalizer") is not None
    return max(1, longest) * (4 if has_normalizer else 1)


def prompt_chars(request: pb.GenerateRequest) -> int:
    """Characters of prompt text: the text, or every chat message's content (the template adds more, and
    may leave tools and calls out: a bound on the prompt's tokens counts only these)."""
    if request.WhichOneof("prompt") == "chat":
        return sum(len(m.content) for m in request.chat.messages)
    return len(request.text)


def work_chars(request: pb.GenerateRequest) -> int:
    """Characters a prompt's encoding reads: prompt_chars', with a chat's tools, calls and template variables."""
    chars = prompt_chars(request)
    if request.WhichOneof("prompt") == "chat":
        chat = request.chat
        chars += len(chat.tools_json) + len(chat.template_kwargs_json)
        chars += sum(len(m.tool_calls_json) for m in chat.messages)
    return chars


class PromptEncoder:
    def __init__(
        self,
        tokenizer: Tokenizer,
        threads: int = 2,
        max_pending: int = 1024,
        max_pending_chars: int = 1 << 24,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_token_chars = longest_token_chars(tokenizer)
        self.max_pending = max_pending
        self.max_pending_chars = max_pending_chars
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="tokenize")
        self._lock = threading.Lock()
        # queued or running; released when the thread is done, even for a cancelled wait
        self._pending = 0
        self._pending_chars = 0

    async def encode(self, request: pb.GenerateRequest) -> list[int]:
        """The prompt's token ids (ValueError for a prompt that cannot be encoded; Overloaded)."""
        return await self._run(work_chars(request), self._encode, request)

    async def decode(self, ids: list[int]) -> str:
        """Token ids back to text, special tokens kept; in the pool, each id counted as a character."""
        return await self._run(len(ids), self.tokenizer.decode, ids, False)

    async def token_strs(self, ids: list[int]) -> list[str]:
        """Each id's entry in the vocabulary ("" for none); in the pool, each id counted as a character."""
        return await self._run(len(ids), lambda: [self.tokenizer.backend.id_to_token(i) or "" for i in ids])

    async def _run(self, chars: int, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) in the pool, counted as `chars` characters of pending work (Overloaded beyond the bounds)."""
        with self._lock:
            crowded = self._pending and self._pending_chars + chars > self.max_pending_chars
            if self._pending >= self.max_pending or crowded:
                raise Overloaded
            self._pending += 1
            self._pending_chars += chars
        future = self._pool.submit(fn, *args)
        future.add_done_callback(lambda _: self._release(chars))
        return await asyncio.wrap_future(future)

    def _release(self, chars: int) -> None:
        with self._lock:
            self._pending -= 1
            self._pending_chars -= chars

    def _encode(self, request: pb.GenerateRequest) -> list[int]:
        tok = self.tokenizer
        if request.WhichOneof("prompt") == "chat":
            chat = request.chat
            tools = _json_array(chat.tools_json, "tools_json") if chat.tools_json else None
            messages = [_message(i, m) for i, m in enumerate(chat.messages)]
            kwargs = _template_kwargs(chat.template_kwargs_json) if chat.template_kwargs_json else {}
            text = tok.apply_chat_template(
                messages, add_generation_prompt=chat.add_generation_prompt, tools=tools, **kwargs
            )
            return tok.encode(text, add_special_tokens=False)
        return tok.encode(request.text)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _message(i: int, m: pb.ChatMessage) -> dict[str, Any]:
    """A chat message as Hugging Face chat templates read it: tool_calls, tool_call_id and name where set."""
    message: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls_json:
        message["tool_calls"] = _json_array(m.tool_calls_json, f"messages[{i}].tool_calls_json")
    if m.tool_call_id:
        message["tool_call_id"] = m.tool_call_id
    if m.name:
        message["name"] = m.name
    return message


# the template's own variables, which the request's fields set
_RESERVED_KWARGS = frozenset(
    {"messages", "tools", "add_generation_prompt", "chat_template", "bos_token", "eos_token"}
)


def _template_kwargs(text: str) -> dict[str, Any]:
    """vLLM's chat_template_kwargs: a JSON object of template variables; ValueError naming the field or the
    variable otherwise."""
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"chat_template_kwargs is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError("chat_template_kwargs must be a JSON object")
    taken = sorted(_RESERVED_KWARGS & value.keys())
    if taken:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(taken)}: the request's own fields do")
    return value


def _json_array(text: str, field: str) -> list[Any]:
    """A request field holding a JSON array of objects; ValueError naming the field otherwise."""
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"{field} is not valid JSON: {e}") from None
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise ValueError(f"{field} must be a JSON array of objects")
    return value
