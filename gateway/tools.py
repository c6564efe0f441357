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

Each mode is a parser (gateway/call_stream.py, gateway/list_calls.py) fed one choice's text as it streams
(`CallStream.feed`, then `finish`); a call goes out
as soon as its text is whole (a block, an object, an element of the array or list; a named call's arguments
stream as they come), not when the text ends. A whole response is the same parser fed the whole text, so a
streamed response and a whole one carry the same calls.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from gateway.call_stream import CallStream, Delta, HermesCalls, Llama3JsonCalls, NamedCall, RequiredCalls
from gateway.errors import APIError
from gateway.list_calls import MistralCalls, PythonicCalls
from gateway.protocol import ChatCompletionRequest, NamedToolChoice, ToolDefinition

PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")
# parsers whose markers are special tokens, which the text leaves out unless asked for (vLLM's adjust_request)
SPECIAL_MARKERS = ("hermes", "mistral")


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
