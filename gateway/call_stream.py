"""Tool-call parsers: each fed one choice's text as it streams (`feed`, then `finish`), each answer a `Delta` of the
content and the calls whole so far. Here the shape they share and the block and object parsers: a named call, tool_choice
"required"'s JSON array, `hermes`'s `<tool_call>` blocks and `llama3_json`'s objects. gateway/list_calls.py has
`mistral`'s and `pythonic`'s lists; gateway/tools.py picks a request's parser.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
JSON_SPACE = " \t\n\r"


def call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class Delta:
    """What one piece of text adds to a choice's message: content, and OpenAI's tool_calls delta entries
    ({"index", "id", "type", "function": {"name", "arguments"}}, id, type and name on a call's first entry)."""

    content: str = ""
    calls: list[dict] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)

    def add(self, other: Delta) -> None:
        self.content += other.content
        for entry in other.calls:
            last = self.calls[-1] if self.calls else None
            if last is not None and last["index"] == entry["index"]:  # one entry per call in a delta
                last["function"]["arguments"] += entry["function"]["arguments"]
            else:
                self.calls.append({**entry, "function": dict(entry["function"])})


class CallStream:
    """One choice's tool calls, as its text streams in. `called`: whether a call has been made."""

    def __init__(self) -> None:
        self.called = 0
        self.space = ""  # whitespace at the content's end, held until what follows says (a call drops it)

    def _content(self, text: str) -> str:
        """Content that may go out now: the text after the held whitespace, less its own trailing whitespace."""
        text = self.space + text
        body = text.rstrip()
        self.space = text[len(body) :]
        return body

    def feed(self, text: str) -> Delta:
        raise NotImplementedError

    def finish(self) -> Delta:
        return Delta()

    def _call(self, name: str, arguments: str) -> dict:
        entry = {
            "index": self.called,
            "id": call_id(),
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }
        self.called += 1
        return entry

    def _parsed(self, raw: str, args_key: tuple[str, ...]) -> dict | None:
        """The call a JSON object's text holds ({"name", one of args_key}), or None where it holds none."""
        try:
            obj = json.loads(raw)
        except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args: Any = next((obj[k] for k in args_key if k in obj), {})
        text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        return self._call(obj["name"], text)


class NamedCall(CallStream):
    """A named tool_choice: the text is the one call's arguments, streamed as they come."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def feed(self, text: str) -> Delta:
        if not self.called:
            return Delta(calls=[self._call(self.name, text)])
        return Delta(calls=[{"index": 0, "function": {"arguments": text}}]) if text else Delta()


class _Objects:
    """Top-level JSON objects in a text that streams in: `feed` returns, in order, each object's text once it
    closes and the text between objects (at `depth` = base, outside any string). base 1 takes the elements
    of one outer array."""

    def __init__(self, base: int) -> None:
        self.base = base
        self.depth = 0
        self.in_string = self.escaped = False
        self.current: list[str] = []  # the object being read
        self.between: list[str] = []  # text at the base depth since the last object

    def feed(self, text: str) -> list[tuple[str, str]]:
        """[(kind, text)]: kind "object" for a whole object, "between" for text outside them."""
        out: list[tuple[str, str]] = []
        for ch in text:
            inside = self.depth > self.base
            if inside:
                self.current.append(ch)
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                continue
            if ch == '"' and inside:
                self.in_string = True
            elif ch in "{[":
                if self.depth == self.base and ch == "{":
                    if self.between:
                        out.append(("between", "".join(self.between)))
                        self.between = []
                    self.current = [ch]
                self.depth += 1
            elif ch in "}]" and self.depth > 0:
                self.depth -= 1
                if self.depth == self.base and ch == "}":
                    out.append(("object", "".join(self.current)))
                    self.current = []
            if not inside and self.depth <= self.base and ch not in "{}":
                self.between.append(ch)
        return out

    def rest(self) -> str:
        """What has not been returned: text between objects, or an object left open."""
        rest = "".join(self.between) + "".join(self.current)
        self.between, self.current = [], []
        return rest


class RequiredCalls(CallStream):
    """tool_choice "required": each element of the JSON array is a call, sent once it closes. A text that
    ends before any element has (max_tokens) is the content, as written."""

    def __init__(self) -> None:
        super().__init__()
        self.objects = _Objects(base=1)
        self.seen: list[str] = []

    def finish(self) -> Delta:
        return Delta(content="" if self.called else "".join(self.seen))

    def feed(self, text: str) -> Delta:
        if not self.called:
            self.seen.append(text)
        out = Delta()
        for kind, raw in self.objects.feed(text):
            call = self._parsed(raw, ("parameters", "arguments")) if kind == "object" else None
            if call is not None:
                out.calls.append(call)
        return out


def held_prefix(text: str, tag: str) -> int:
    """How many characters at the end of `text` could begin `tag` (held back until the next text says)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class HermesCalls(CallStream):
    """`hermes`: calls in `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (a closing tag inside
    a JSON string is the string's); the text outside them is content, less the whitespace next to a call. A
    block whose JSON holds no call is content as written; one the text ends inside is a call where its JSON is
    whole."""

    def __init__(self) -> None:
        super().__init__()
        self.pending = ""  # text outside blocks not yet sent: a possible opening tag's start
        self.before = ""  # the whitespace held when the block being read opened
        self.block: list[str] | None = None  # the block being read
        self.in_string = self.escaped = False

    def feed(self, text: str) -> Delta:
        out = Delta()
        i = 0
        while i < len(text):
            if self.block is not None:
                i = self._read_block(text, i, out)
                continue
            self.pending += text[i:]
            i = len(text)
            at = self.pending.find(HERMES_START)
            if at >= 0:
                out.content += self._content(self.pending[:at])
                text, i, self.pending = self.pending[at + len(HERMES_START) :], 0, ""
                self.block, self.in_string, self.escaped = [], False, False
                self.before, self.space = self.space, ""
            else:
                keep = held_prefix(self.pending, HERMES_START)
                out.content += self._content(self.pending[: len(self.pending) - keep])
                self.pending = self.pending[len(self.pending) - keep :]
        return out

    def _read_block(self, text: str, i: int, out: Delta) -> int:
        """Reads the block on from text[i]; returns where the text after its closing tag starts (or the end)."""
        assert self.block is not None
        for j in range(i, len(text)):
            ch = text[j]
            self.block.append(ch)
            if self.in_string:
                self.escaped, self.in_string = (False, True) if self.escaped else (ch == "\\", ch != '"')
            elif ch == '"':
                self.in_string = True
            elif ch == ">" and "".join(self.block[-len(HERMES_END) :]) == HERMES_END:
                out.add(self._block("".join(self.block[: -len(HERMES_END)]), closed=True))
                self.block = None
                return j + 1
        return len(text)

    def finish(self) -> Delta:
        if self.block is not None:
            body, self.block = "".join(self.block), None
            return self._block(body, closed=False)
        rest, self.pending = self.pending, ""
        content = self._content(rest)
        space, self.space = self.space, ""
        return Delta(content=content if self.called else content + space)

    def _block(self, body: str, closed: bool) -> Delta:
        call = self._parsed(body.strip(), ("arguments", "parameters"))
        before, self.before = self.before, ""
        if call is not None:
            return Delta(calls=[call])
        return Delta(content=before + HERMES_START + body + (HERMES_END if closed else ""))


class Llama3JsonCalls(CallStream):
    """`llama3_json`: a text that starts (after whitespace and an optional `<|python_tag|>`) with "{" is
    {"name", "parameters"} objects separated by ";"; any other text is content."""

    def __init__(self) -> None:
        super().__init__()
        self.head = ""  # the text while it is unclear which it is
        self.objects: _Objects | None = None
        self.plain = False

    def feed(self, text: str) -> Delta:
        if self.plain:
            return Delta(content=text)
        if self.objects is None:
            self.head += text
            lead = self.head.lstrip()
            if lead.startswith(PYTHON_TAG):
                lead = lead[len(PYTHON_TAG) :].lstrip()
            elif PYTHON_TAG.startswith(lead):
                return Delta()  # whitespace, or the tag's start
            if not lead:
                return Delta()
            if not lead.startswith("{"):
                self.plain = True
                head, self.head = self.head, ""
                return Delta(content=head)
            self.objects, self.head, text = _Objects(base=0), "", lead
        out = Delta()
        for kind, raw in self.objects.feed(text):
            call = self._parsed(raw, ("parameters", "arguments")) if kind == "object" else None
            if call is not None:
                out.calls.append(call)
            elif kind == "object" or raw.strip(" \n\t;"):
                out.content += raw
        return out

    def finish(self) -> Delta:
        if self.objects is None:
            head, self.head = self.head, ""
            return Delta(content=head)
        rest = self.objects.rest()
        return Delta(content=rest if rest.strip(" \n\t;") else "")
