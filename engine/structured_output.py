"""Structured output (vLLM's `structured_outputs`: a JSON schema, any JSON object, a regex or a choice): each
request's text is held to a regular language by masking, before every sampled token, the tokens that would
leave it. outlines-core compiles the regex (a JSON schema through its own translation) into an index over the
tokenizer's vocabulary, once per pattern (cached); each sequence walks it with a Guide of its own
(engine/sequence.py advances it with every token appended). EBNF grammars are refused: outlines-core compiles
regular languages only."""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from outlines_core import Guide, Index, Vocabulary

    from engine.tokenizer import Tokenizer

INDEX_CACHE = 64  # compiled patterns kept per engine (a JSON-object pattern takes seconds to compile)


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's StructuredOutputsParams: exactly one of a JSON schema (a dict or its JSON text), `json_object`
    (any JSON object), a regex, or a list of choices. `grammar` (EBNF) is refused: regular languages only."""

    json: dict | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    json_object: bool | None = None
    grammar: str | None = None
    # a reasoning model's (start, end) markers, each a token of its own: the output is free until the end marker
    # (its thinking), then held to the pattern, as vLLM holds it with a reasoning parser. A prompt whose last
    # marker is the end one (thinking off: "<think></think>" in the template) is held from its first token.
    reasoning: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        if self.reasoning is not None:
            markers = tuple(self.reasoning)
            if len(markers) != 2 or not all(isinstance(m, str) and m for m in markers):
                raise ValueError(f"reasoning must be two markers (start, end), got {self.reasoning!r}")
            object.__setattr__(self, "reasoning", markers)
        given = [n for n in ("json", "regex", "choice", "json_object", "grammar") if getattr(self, n)]
        if len(given) != 1:
            raise ValueError(
                "structured output takes exactly one of json, regex, choice or json_object, got "
                + (", ".join(given) or "none")
            )
        if self.grammar:
            raise ValueError(
                "structured output by grammar (EBNF) is not supported: give a JSON schema, a regex or a choice"
            )
        if self.choice is not None:
            if any(not isinstance(c, str) or not c for c in self.choice):
                raise ValueError(
                    f"structured output choices must be non-empty strings, got {list(self.choice)[:5]!r}"
                )
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.regex is not None:
            try:
                re.compile(self.regex)
            except re.error as exc:
                raise ValueError(f"structured output regex does not compile: {exc}") from None
        if self.json is not None and isinstance(self.json, str):
            try:
                json.loads(self.json)
            except json.JSONDecodeError as exc:
                raise ValueError(f"structured output JSON schema is not JSON: {exc}") from None

    def pattern(self) -> str:
        """The regular expression the output must match whole."""
        from outlines_core.json_schema import build_regex_from_schema

        if self.regex is not None:
            return self.regex
        if self.choice is not None:
            return "(" + "|".join(re.escape(c) for c in self.choice) + ")"
        schema = {"type": "object"} if self.json_object else self.json
        text = schema if isinstance(schema, str) else json.dumps(schema)
        try:
            return build_regex_from_schema(text)
        except Exception as exc:  # outlines-core raises its own errors for schemas it cannot translate
            raise ValueError(f"structured output JSON schema is not supported: {exc}") from None


THINK_MARKERS = ("<think>", "</think>")  # the reasoning markers of DeepSeek-R1, Qwen3 and QwQ


def reasoning_ended(token_ids: Sequence[int], start: int, end: int) -> bool:
    """Whether the reasoning is over at the end of `token_ids`: its last marker is the end one."""
    for token in reversed(token_ids):
        if token == end:
            return True
        if token == start:
            return False
    return False


class GuideFactory:
    """Guides for one tokenizer: its vocabulary as byte strings (built on first use) and an LRU cache of
    compiled indexes by pattern. `vocab_size` is the model's: mask words cover it, tokens past the
    tokenizer's stay masked."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_id = min(tokenizer.eos_token_ids) if tokenizer.eos_token_ids else None
        self._vocab: Vocabulary | None = None
        self._indexes: OrderedDict[str, Future[Index]] = OrderedDict()
        self._lock = threading.Lock()
        # one compiling thread: outlines-core's Rust lets the engine's loop run meanwhile (a JSON-object pattern
        # takes seconds), and a request waits for its pattern without stalling the others (engine/scheduler.py)
        self._pool: ThreadPoolExecutor | None = None

    def check(self, params: StructuredOutputsParams) -> None:
        """ValueError unless params can be compiled here: a tokenizer with an end-of-sequence token, a schema
        outlines-core translates (the pattern itself compiles in the background: index_future)."""
        if self.eos_id is None:
            raise ValueError("structured output needs an end-of-sequence token; this tokenizer has none")
        self.reasoning_ids(params)
        params.pattern()

    def reasoning_ids(self, params: StructuredOutputsParams) -> tuple[int, int] | None:
        """The token ids of params' reasoning markers (ValueError unless each is a token of its own)."""
        if params.reasoning is None:
            return None
        ids = []
        for marker in params.reasoning:
            i = self.tokenizer.backend.token_to_id(marker)
            if i is None:
                raise ValueError(f"reasoning marker {marker!r} is not a token of this model's vocabulary")
            ids.append(i)
        return ids[0], ids[1]

    def index_future(self, params: StructuredOutputsParams) -> Future[Index]:
        """params' pattern compiled into an index, in the background; cached by pattern."""
        self.check(params)
        pattern = params.pattern()
        with self._lock:
            future = self._indexes.get(pattern)
            if future is not None:
                self._indexes.move_to_end(pattern)
                return future
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="guide-compile")
            future = self._pool.submit(self._compile, pattern)
            self._indexes[pattern] = future
            while len(self._indexes) > INDEX_CACHE:
                self._indexes.popitem(last=False)
        return future

    def _compile(self, pattern: str) -> Index:
        from outlines_core import Index

        try:
            return Index(pattern, self.vocabulary())
        except Exception as exc:
            raise ValueError(f"structured output pattern cannot be compiled: {exc}") from None

    def index(self, params: StructuredOutputsParams) -> Index:
        """The compiled index for params' pattern, waited for; ValueError when it cannot be compiled."""
        return self.index_future(params).result()

    def guide(self, params: StructuredOutputsParams) -> Guide:
        from outlines_core import Guide

        return Guide(self.index(params))

    def vocabulary(self) -> Vocabulary:
        from outlines_core import Vocabulary

        with self._lock:
            if self._vocab is None:
                assert self.eos_id is not None
                self._vocab = Vocabulary(self.eos_id, token_bytes(self.tokenizer))
            return self._vocab

    def mask_words(self) -> int:
        return -(-self.vocab_size // 32)


def token_bytes(tokenizer: Tokenizer) -> dict[bytes, list[int]]:
    """Every ordinary token's text as bytes -> its ids: byte-level BPE (GPT-2's alphabet, Llama 3, Qwen,
    SmolLM2) mapped back to bytes, SentencePiece's "▁" as a space and its <0xHH> byte tokens as that byte.
    Added and special tokens are left out: no pattern's text can hold them."""
    backend = tokenizer.backend
    added = set(backend.get_added_tokens_decoder())
    decoder: dict[str, Any] = json.loads(backend.to_str()).get("decoder") or {}
    byte_level = _has_type(decoder, "ByteLevel")
    alphabet = _byte_level_alphabet() if byte_level else {}
    out: dict[bytes, list[int]] = {}
    for text, token_id in backend.get_vocab(with_added_tokens=False).items():
        if token_id in added:
            continue
        if byte_level:
            try:
                raw = bytes(alphabet[ch] for ch in text)
            except KeyError:
                continue
        else:
            m = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", text)
            raw = bytes([int(m.group(1), 16)]) if m else text.replace("\u2581", " ").encode("utf-8")
        if raw:
            out.setdefault(raw, []).append(token_id)
    return out


def _has_type(node: dict[str, Any], kind: str) -> bool:
    if node.get("type") == kind:
        return True
    return any(_has_type(d, kind) for d in node.get("decoders") or [] if isinstance(d, dict))


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-to-unicode table, inverted: the character standing for each byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def allowed_mask(guide: Guide, words: int) -> np.ndarray:
    """The guide's allowed tokens now, as `words` int32 words of bits (token t: bit t % 32 of word t // 32)."""
    mask = np.zeros(words, dtype=np.int32)
    guide.write_mask_into(mask.ctypes.data, mask.size, 4)
    return mask


def allows_other_than(mask: np.ndarray, tokens: tuple[int, ...]) -> bool:
    """Whether `mask` (allowed_mask's words) allows a token outside `tokens`."""
    left = mask.view(np.uint32).copy()
    for t in tokens:
        if t // 32 < left.size:
            left[t // 32] &= np.uint32(~(1 << (t % 32)) & 0xFFFFFFFF)
    return bool(left.any())
