"""Tool calls picked out of a choice's text (gateway/tools.py): the same calls however the text is cut into
stream pieces, the whole response equal to the streamed one, text that holds no call kept as content, and the
schemas named and required tool choices hold the output to."""

from __future__ import annotations

import json

import pytest

from gateway.call_stream import Delta, HermesCalls, Llama3JsonCalls, NamedCall, RequiredCalls
from gateway.list_calls import MistralCalls, PythonicCalls
from gateway.protocol import ChatCompletionRequest
from gateway.responses import Choice, Formatter, TokenText, Totals
from gateway.tools import ToolPlan, required_schema
from protos import pdserve_pb2 as pb

HERMES = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "note": "a </tool_call> b"}}'
    '\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n'
)
REQUIRED = (
    '[{"name": "get_weather", "parameters": {"city": "P}]{ \\"x"}}, {"name": "get_time", "parameters": {}}]'
)
LLAMA = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}'
MISTRAL = 'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "P]"}}, {"name": "get_time", "arguments": {}}]'
PYTHONIC = ' [get_weather(city="Paris", days=[1, 2]), get_time()]'


def run(stream, text: str, size: int) -> Delta:
    out = Delta()
    for i in range(0, len(text), size):
        out.add(stream.feed(text[i : i + size]))
    out.add(stream.finish())
    return out


def calls(delta: Delta) -> list[tuple[int, str, dict]]:
    return [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in delta.calls]


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_every_parser_finds_the_same_calls_however_the_text_is_cut(size):
    # hermes: a closing tag inside a JSON string is the string's
    hermes = run(HermesCalls(), HERMES, size)
    assert calls(hermes) == [
        (0, "get_weather", {"city": "Paris", "note": "a </tool_call> b"}),
        (1, "get_time", {}),
    ]
    assert hermes.content == "Let me check."  # the whitespace next to a call is dropped
    required = run(RequiredCalls(), REQUIRED, size)
    assert calls(required) == [(0, "get_weather", {"city": 'P}]{ "x'}), (1, "get_time", {})]
    assert required.content == ""
    llama = run(Llama3JsonCalls(), LLAMA, size)
    assert (
        calls(llama) == [(0, "get_weather", {"city": "Paris"}), (1, "get_time", {})] and llama.content == ""
    )
    named = run(NamedCall("f"), '{"a": [1, 2]}', size)
    assert (
        calls(named) == [(0, "f", {"a": [1, 2]})]
        and named.calls[0]["function"]["arguments"] == '{"a": [1, 2]}'
    )
    assert len({c["id"] for c in [*hermes.calls, *required.calls, *llama.calls]}) == 6  # ids are unique


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_the_mistral_and_pythonic_parsers_find_the_same_calls_however_the_text_is_cut(size):
    mistral = run(MistralCalls(), MISTRAL, size)
    assert (
        calls(mistral) == [(0, "get_weather", {"city": "P]"}), (1, "get_time", {})]
        and mistral.content == "Sure."
    )
    pythonic = run(PythonicCalls(), PYTHONIC, size)
    assert calls(pythonic) == [(0, "get_weather", {"city": "Paris", "days": [1, 2]}), (1, "get_time", {})]
    assert pythonic.content == ""
    # what is no list of literal keyword calls stays content, as written
    for plain in ("It is [sunny].", "[f(1)]", "[f(x=y)]", "[f(x={1, 2})]", "[" * 5000, " [a, b]", "[f(x=1)"):
        out = run(PythonicCalls(), plain, size)
        assert (out.content, out.calls) == (plain, []), plain
    for plain in ("No calls. [TOOL", "x [TOOL_CALLS] not json", "x [TOOL_CALLS][1, 2]", "a \n"):
        out = run(MistralCalls(), plain, size)
        assert (out.content, out.calls) == (plain, []), plain


# the first calls' strings hold brackets, quotes and escapes that must not end them early
MISTRAL_TWO = (
    'Sure. [TOOL_CALLS][{"name": "search", "arguments": {"q": "a ] } \\" ["}}, '
    '{"name": "get_time", "arguments": {}}]'
)
PYTHONIC_TWO = "[search(s='x)]', t=\"[(\", u='''a']''', v='', w=\"\\\"]\"), get_time()]"
MISTRAL_ARGS = {"q": 'a ] } " ['}
PYTHONIC_ARGS = {"s": "x)]", "t": "[(", "u": "a']", "v": "", "w": '"]'}


def sent_at(stream, text: str) -> list[int]:
    """Fed one character at a time: after which character each call goes out."""
    return [i for i, ch in enumerate(text) for _ in stream.feed(ch).calls]


@pytest.mark.parametrize(
    ("stream", "text", "first_end", "last", "args"),
    [
        # an object ends its element at its "}"; a Python call's text may go on after ")", so at "," or "]"
        (MistralCalls, MISTRAL_TWO, '["}}', "}", MISTRAL_ARGS),
        (PythonicCalls, PYTHONIC_TWO, '"\\"]"),', "]", PYTHONIC_ARGS),
    ],
)
def test_each_call_goes_out_once_its_element_is_complete(stream, text, first_end, last, args):
    cut = text.index(first_end) + len(first_end)
    assert sent_at(stream(), text) == [cut - 1, text.rindex(last)]
    parser = stream()
    head = parser.feed(text[:cut])  # the feed that completes the first element, none of the second fed
    assert [(c["index"], c["function"]["name"]) for c in head.calls] == [(0, "search")]
    assert json.loads(head.calls[0]["function"]["arguments"]) == args
    assert head.calls[0]["id"].startswith("chatcmpl-tool-") and "get_time" not in text[:cut]
    tail = parser.feed(text[cut:])
    tail.add(parser.finish())
    assert [(c["index"], c["function"]["name"]) for c in tail.calls] == [(1, "get_time")] and not tail.content


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        ("mistral", MISTRAL_TWO),
        ("pythonic", PYTHONIC_TWO),
        ("mistral", 'x [TOOL_CALLS][{"name": "f", "arguments": {}}, 5, {"name": "g", "arguments": {}}]'),
        ("mistral", 'x [TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}'),  # cut short (max_tokens)
        ("pythonic", "[f(a=1), g(1), h()]"),
        ("pythonic", "\n [f(a=1), # a comment, ] (\n g(b='''x\ny'''),]  "),
    ],
)
@pytest.mark.parametrize("size", [1, 3, 7])
def test_streamed_mistral_and_pythonic_calls_are_the_whole_texts(parser, text, size):
    plan = ToolPlan("auto", parser=parser)
    message, _ = plan.message(text, "stop")
    streamed = run(plan.stream(), text, size)
    assert (streamed.content or None) == message["content"]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in streamed.calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])
    ]


def test_mistral_content_streams_before_the_tag():
    parser = MistralCalls()
    assert parser.feed("Sure, ").content == "Sure,"  # its whitespace waits for what follows
    assert parser.feed("one moment. [TOOL").content == " one moment."  # the tag's start is held
    rest = parser.feed('_CALLS][{"name": "f", "arguments": {}}')
    assert (rest.content, [c["function"]["name"] for c in rest.calls]) == ("", ["f"])


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_a_list_that_stops_being_calls_after_some_is_content_from_there(size):
    """Calls that went out stay calls, and the text after the last of them is content; where none went out,
    the whole text is content, as written."""
    for stream, text, content in [
        (MistralCalls, 'x [TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, 5]', "x, 5]"),
        (PythonicCalls, "[f(a=1), g(1), h()]", ", g(1), h()]"),
        (PythonicCalls, "[f(a=1)] and then", "] and then"),
    ]:
        out = run(stream(), text, size)
        assert (out.content, calls(out)) == (content, [(0, "f", {"a": 1})]), text
    for stream, text in [
        (MistralCalls, 'x [TOOL_CALLS][{"nam": "f"}, {"name": "g", "arguments": {}}]'),
        (MistralCalls, 'x [TOOL_CALLS] {"name": "g", "arguments": {}}'),
        (PythonicCalls, "[g(1), f(a=1)]"),
        (PythonicCalls, "[f(a=1)(b=2), g()]"),
    ]:
        out = run(stream(), text, size)
        assert (out.content, out.calls) == (text, []), text


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_text_without_calls_stays_content(size):
    plain = "The weather is <b>fine</b> { not a call }"
    for stream in (HermesCalls(), Llama3JsonCalls()):
        out = run(stream, plain, size)
        assert (out.content, out.calls, stream.called) == (plain, [], 0)
    # whitespace is held back until what follows says; with no call after it, it is content
    for spaced in (" \n", "a \n", "a \n b\n\n"):
        assert run(HermesCalls(), spaced, size).content == spaced
    # a tag's first characters are held back, then sent as content when the text says they were not one
    assert run(HermesCalls(), "a <tool_ca", size).content == "a <tool_ca"
    # a block whose JSON is not a call is content as written
    for bad in ('<tool_call>{"no name": 1}</tool_call> after', 'a \n<tool_call>{"open</tool_call> after'):
        assert run(HermesCalls(), bad, size).content == bad
    # the text ends inside a block: its JSON, where whole, is still a call
    open_block = run(HermesCalls(), 'x<tool_call>{"name": "f", "arguments": {"q": 1}}', size)
    assert (open_block.content, calls(open_block)) == ("x", [(0, "f", {"q": 1})])
    # JSON nested deeper than the parser goes is no call either
    deep = "<tool_call>" + "[" * 50_000 + "</tool_call>"
    assert run(HermesCalls(), deep, max(size, 500)).content == deep
    # required cut short before any element closed (max_tokens): the text is the content
    cut = run(RequiredCalls(), '[{"name": "get_weather", "para', size)
    assert (cut.content, cut.calls) == ('[{"name": "get_weather", "para', [])


def test_required_schema_is_an_array_of_each_tools_call():
    schema = required_schema(
        [("a", {"type": "object", "properties": {"x": {"type": "integer"}}}), ("b", None)], True
    )
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    a, b = schema["items"]["anyOf"]
    assert a["properties"]["name"] == {"type": "string", "enum": ["a"]}
    assert a["properties"]["parameters"]["properties"] == {"x": {"type": "integer"}}
    assert b["properties"]["parameters"] == {"type": "object"} and a["required"] == ["name", "parameters"]
    assert required_schema([("a", None)], parallel=False)["maxItems"] == 1


def response(index: int, text: str, finish: str = "") -> pb.GenerateResponse:
    return pb.GenerateResponse(index=index, token_ids=[1], text=text, finish_reason=finish)


@pytest.mark.parametrize(
    ("plan", "text", "finish"),
    [
        (ToolPlan("auto", parser="hermes"), HERMES, "tool_calls"),
        (ToolPlan("required"), REQUIRED, "tool_calls"),
        (ToolPlan("auto", parser="llama3_json"), LLAMA, "tool_calls"),
        (ToolPlan("auto", parser="mistral"), MISTRAL, "tool_calls"),
        (ToolPlan("auto", parser="pythonic"), PYTHONIC, "tool_calls"),
        (ToolPlan("auto", parser="pythonic"), "[f(a=1), g(1)]", "tool_calls"),  # content after a call
        (ToolPlan("named", name="f"), '{"a": 1}', "stop"),  # a named call keeps the engine's reason
        (ToolPlan("auto", parser="hermes"), "No call here.", "stop"),
    ],
)
def test_a_streamed_choice_carries_what_the_whole_response_carries(plan, text, finish):
    """Chunks as OpenAI streams them (role first, each call's id and name on its first entry, arguments
    after), summed as the openai client sums them, equal the whole response's message."""
    fmt = Formatter(True, "m", None, TokenText(None), tools=plan)
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]
    chunks = [
        fmt.stream(0, response(0, p, "stop" if i == len(pieces) - 1 else "")) for i, p in enumerate(pieces)
    ]
    deltas = [c["choices"][0] for chunk in chunks for c in chunk]
    assert deltas[0]["delta"]["role"] == "assistant" and deltas[-1]["finish_reason"] == finish
    content, summed = "", {}
    for d in deltas:
        content += d["delta"].get("content") or ""
        for entry in d["delta"].get("tool_calls", []):
            call = summed.setdefault(entry["index"], {"id": entry.get("id"), "name": "", "arguments": ""})
            call["name"] += entry["function"].get("name", "")
            call["arguments"] += entry["function"]["arguments"]
    fmt = Formatter(True, "m", None, TokenText(None), tools=plan)
    whole = fmt.whole({0: Choice(text=[text], finish_reason="stop")}, Totals())["choices"][0]
    message = whole["message"]
    assert whole["finish_reason"] == finish and (message["content"] or "") == content
    got = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
    assert got == [(summed[i]["name"], summed[i]["arguments"]) for i in sorted(summed)]
    assert all(summed[i]["id"].startswith("chatcmpl-tool-") for i in summed)


def body(**kw) -> ChatCompletionRequest:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=tools, **kw)


@pytest.mark.parametrize(
    ("kw", "field", "words"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice", "not among tools"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {"tools": [{"function": {"name": "f"}}, {"function": {"name": "f"}}], "tool_choice": "required"},
            "tools",
            "more than once",
        ),
    ],
)
def test_tool_choices_that_cannot_be_met_are_refused(kw, field, words):
    params = {"tools": [{"type": "function", "function": {"name": "f"}}], **kw}
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **params)
    found = request.conflict()
    assert found is not None and found[0] == field and words in found[1]


def test_the_choice_defaults_to_auto_where_tools_are_given():
    assert body().choice_name() == "auto" and body(tool_choice="none").choice_name() == "none"
    assert (
        ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}]).choice_name() == "none"
    )


def test_a_calls_arguments_go_to_the_template_as_an_object_where_they_parse():
    def call(arguments: str) -> dict:
        message = {
            "role": "assistant",
            "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": arguments}}],
        }
        request = ChatCompletionRequest(model="m", messages=[message])
        assert request.messages[0].tool_calls is not None
        return request.messages[0].tool_calls[0].for_template()["function"]

    assert call('{"city": "Paris"}') == {"name": "f", "arguments": {"city": "Paris"}}
    for kept in ("not json", "[" * 50_000):  # as the client wrote them, nested too deep included
        assert call(kept)["arguments"] == kept
