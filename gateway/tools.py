"""OpenAI tool calling on chat completions, as vLLM's server does it.

A request's `tools` go to the chat template (the router renders them) whatever `tool_choice` is. Then:
- "none": plain text; no calls are looked for.
- a named function ({"type": "function", "function": {"name": N}}): structured output holds the text to N's
  parameters schema, and the text is that one call's arguments.
- "required": structured output holds the text to a JSON array of one or more {"name", "parameters"}
  objects, one shape per tool (`required_schema`); each element is a call.
- "auto", the default where tools are given: the model writes freely, and the gateway's tool-call parser
  (`--tool-call-parser`, with `--enable-auto-tool-choice`) picks the calls out of the text: `hermes`
  (`<tool_call>{"name", "arguments"}</tool_call>` blocks), `llama3_json` ({"name", "parameters"} objects
  separated by ";", after an optional `<|python_tag|>`), `mistral` (`[TOOL_CALLS]` and a JSON array) or
  `pythonic` (a Python list of calls, Llama 3.2's and 4's). Text outside the calls is the message's content.

Each mode is a parser fed one choice's text as it streams (`CallStream.feed`, then `finish`). A whole response
is the same parser fed the whole text, so a streamed response and a whole one carry the same calls.
"""

from __future__ import annotations

import ast
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from gateway.errors import APIError
from gateway.protocol import ChatCompletionRequest, NamedToolChoice, ToolDefinition

PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")
# parsers whose markers are special tokens, which the text leaves out unless asked for (vLLM's adjust_request)
SPECIAL_MARKERS = ("hermes", "mistral")
HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_TAG = "[TOOL_CALLS]"


def call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def parameters_schema(parameters: dict | None) -> dict:
    """A function's parameters as the schema its arguments are held to: any JSON object where none is given."""
    return parameters if parameters is not None else {"type": "object"}


def required_schema(functions: list[tuple[str, dict | None]], parallel: bool) -> dict:
    """tool_choice "required": a JSON array of one or more calls (one at most without parallel tool calls),
    each {"name": one of the tools' names, "parameters": that tool's parameters}."""
    shapes = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [name]},
                "parameters": parameters_schema(params),
            },
            "required": ["name", "parameters"],
        }
        for name, params in functions
    ]
    schema: dict = {"type": "array", "minItems": 1, "items": {"anyOf": shapes}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


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


class MistralCalls(CallStream):
    """`mistral`: content, then `[TOOL_CALLS]` and a JSON array of {"name", "arguments"} objects (Mistral's
    v0.3 format). The content streams; the array is read whole, so its calls go out when the text ends. An
    array that does not parse as calls is content, as written, tag and all."""

    def __init__(self) -> None:
        super().__init__()
        self.pending = ""  # content held back: a possible tag's start
        self.after: list[str] | None = None  # the text after the tag

    def feed(self, text: str) -> Delta:
        if self.after is not None:
            self.after.append(text)
            return Delta()
        self.pending += text
        at = self.pending.find(MISTRAL_TAG)
        if at >= 0:
            content = self._content(self.pending[:at])
            self.after, self.pending = [self.pending[at + len(MISTRAL_TAG) :]], ""
            return Delta(content=content)
        keep = held_prefix(self.pending, MISTRAL_TAG)
        content = self._content(self.pending[: len(self.pending) - keep])
        self.pending = self.pending[len(self.pending) - keep :]
        return Delta(content=content)

    def finish(self) -> Delta:
        space, self.space = self.space, ""
        if self.after is None:
            rest, self.pending = self.pending, ""
            return Delta(content=(space + rest) if rest.strip() or not self.called else "")
        text = "".join(self.after)
        try:
            found = json.loads(text)
        except (ValueError, RecursionError):
            found = None
        items = found if isinstance(found, list) and found else None
        if items is None or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in items):
            return Delta(content=space + MISTRAL_TAG + text)
        calls = [self._parsed(json.dumps(c), ("arguments", "parameters")) for c in items]
        return Delta(calls=[c for c in calls if c is not None])


class PythonicCalls(CallStream):
    """`pythonic` (Llama 3.2 and 4): a text that is a Python list of calls with keyword arguments,
    `[get_weather(city="Paris"), get_time()]`; any other text is content. Such a list is read whole, so its
    calls go out when the text ends."""

    def __init__(self) -> None:
        super().__init__()
        self.text = ""
        self.plain = False

    def feed(self, text: str) -> Delta:
        if self.plain:
            return Delta(content=text)
        self.text += text
        lead = self.text.lstrip()
        if lead and not lead.startswith("["):
            self.plain = True
            held, self.text = self.text, ""
            return Delta(content=held)
        return Delta()

    def finish(self) -> Delta:
        if self.plain:
            return Delta()
        text, self.text = self.text, ""
        calls = _python_calls(text.strip())
        if calls is None:
            return Delta(content=text)
        return Delta(calls=[self._call(name, json.dumps(args, ensure_ascii=False)) for name, args in calls])


def _python_calls(text: str) -> list[tuple[str, dict]] | None:
    """[(name, keyword arguments)] of a Python list of calls whose arguments are literals, or None."""
    try:
        tree = ast.parse(text, mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        out = []
        for call in tree.elts:
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and not call.args):
                return None
            if any(k.arg is None for k in call.keywords):  # **kwargs
                return None
            out.append((call.func.id, {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg}))
        json.dumps(out)  # literals JSON cannot carry (sets, bytes, complex) are no call
        return out
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return None


@dataclass(frozen=True)
class ToolPlan:
    """How a request's choices carry tool calls: mode "named" (`name`), "required" or "auto" (`parser`)."""

    mode: str
    name: str | None = None
    parser: str | None = None

    def stream(self) -> CallStream:
        if self.mode == "named":
            assert self.name is not None
            return NamedCall(self.name)
        if self.mode == "required":
            return RequiredCalls()
        parsers = {"hermes": HermesCalls, "llama3_json": Llama3JsonCalls, "mistral": MistralCalls}
        return parsers.get(self.parser or "", PythonicCalls)()

    def finish_reason(self, finish: str | None, stream: CallStream) -> str | None:
        """OpenAI's: "tool_calls" where calls ended the choice ("auto", "required"); a named call's keeps the
        engine's reason, as OpenAI's does."""
        if finish == "stop" and stream.called and self.mode != "named":
            return "tool_calls"
        return finish

    def message(self, text: str, finish: str | None) -> tuple[dict, str | None]:
        """A whole choice's message and finish reason: the same parser fed the whole text."""
        stream = self.stream()
        delta = Delta()
        delta.add(stream.feed(text))
        delta.add(stream.finish())
        message: dict = {"role": "assistant", "content": delta.content or None}
        if delta.calls:
            message["tool_calls"] = [
                {"id": c["id"], "type": "function", "function": c["function"]} for c in delta.calls
            ]
        return message, self.finish_reason(finish, stream)


AUTO_NEEDS_FLAGS = '"auto" tool_choice requires --enable-auto-tool-choice and --tool-call-parser to be set'


def tool_plan(body: ChatCompletionRequest, parser: str | None) -> ToolPlan | None:
    """How `body`'s choices carry calls (None: they carry none). parser: the gateway's --tool-call-parser
    where --enable-auto-tool-choice is on, else None, and "auto" is then refused, as vLLM's server does."""
    mode = body.choice_name()
    if mode == "none":
        return None
    if mode == "auto":
        if parser is None:
            raise APIError(400, AUTO_NEEDS_FLAGS, "tool_choice", "invalid_request")
        return ToolPlan("auto", parser=parser)
    if isinstance(body.tool_choice, NamedToolChoice):
        return ToolPlan("named", name=body.tool_choice.function.name)
    return ToolPlan("required")


def plan_schema(plan: ToolPlan, body: ChatCompletionRequest) -> dict | None:
    """The JSON schema structured output holds a named or required choice's text to; None for "auto"."""
    functions = [(t.function.name, t.function.parameters) for t in body.tools or ()]
    if plan.mode == "named":
        assert plan.name is not None
        return parameters_schema(dict(functions)[plan.name])
    if plan.mode == "required":
        return required_schema(functions, body.parallel_tool_calls)
    return None


def tools_json(tools: list[ToolDefinition] | None) -> str:
    """A request's tools as the chat template takes them ("" for none)."""
    if not tools:
        return ""
    return json.dumps([t.model_dump(exclude_none=True) for t in tools], ensure_ascii=False)
