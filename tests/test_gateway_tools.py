"""Tool calling through the OpenAI gateway end to end: a real cluster (router + prefill + decode over tcp) whose
router renders a Hermes-style ChatML template (router/templates/chatml_hermes_tools.jinja, --chat-template),
the gateway with --enable-auto-tool-choice --tool-call-parser hermes, the official `openai` client, and
transformers held to the same schema as the reference for named and required tool choices."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.cluster import OpenAIStack, openai_stack, start_gateway
from tests.hf_reference import GuideMask, hf_greedy

pytestmark = pytest.mark.slow

TEMPLATE = Path(__file__).resolve().parents[1] / "router" / "templates" / "chatml_hermes_tools.jinja"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
        },
    },
}
TOOLS = [WEATHER, TIME]
CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def stack(bundled_model_dir):
    flags = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3")
    with openai_stack(("--chat-template", str(TEMPLATE)), flags) as stack:
        yield stack


@pytest.fixture(scope="module")
def tok(bundled_model_dir):
    from engine.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(bundled_model_dir)
    tok.chat_template = TEMPLATE.read_text()
    return tok


def prompt_ids(tok, messages: list[dict], tools: list[dict] | None) -> list[int]:
    text = tok.apply_chat_template(
        messages, add_generation_prompt=True, **({"tools": tools} if tools else {})
    )
    return tok.encode(text, add_special_tokens=False)


def held_to(tok, bundled_model_dir, ids: list[int], schema: dict, max_new: int) -> str:
    """transformers' greedy answer held to `schema`, as text."""
    from engine.structured_output import GuideFactory, StructuredOutputsParams

    guide = GuideFactory(tok, tok.vocab_size).guide(StructuredOutputsParams(json=schema))
    out = hf_greedy(
        bundled_model_dir, [ids], [max_new], [{"logits_processor": [GuideMask(guide, len(ids))]}]
    )[0]
    return tok.decode(out)


def streamed(stack: OpenAIStack, **kw) -> tuple[str, list[tuple[str, str]], str | None]:
    """A streamed choice summed as clients sum it: content, [(name, arguments)] by index, finish reason."""
    content, calls, finish = "", {}, None
    for chunk in stack.client.chat.completions.create(model=stack.model, stream=True, **kw):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for entry in choice.delta.tool_calls or ():
            call = calls.setdefault(entry.index, ["", ""])
            call[0] += entry.function.name or ""
            call[1] += entry.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish


def test_tools_reach_the_chat_template(stack, tok):
    """/tokenize counts the prompt Generate runs: the tools, an assistant turn's calls (its arguments as an
    object) and a tool turn's result, rendered by the router's --chat-template."""
    turns = [
        *CHAT,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "21 C, sunny"},
    ]
    r = stack.post("/tokenize", {"model": stack.model, "messages": turns, "tools": TOOLS})
    assert r.status_code == 200, r.text
    as_template = [{**t, "content": t["content"] or ""} for t in turns]
    as_template[1]["tool_calls"] = [{**as_template[1]["tool_calls"][0], "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]  # fmt: skip
    want = prompt_ids(tok, as_template, TOOLS)
    assert r.json()["tokens"] == want
    assert '"get_time"' in tok.decode(want) and "<tool_response>\n21 C, sunny" in tok.decode(want)


def test_chat_template_kwargs_reach_the_template(stack, tok):
    """vLLM's chat_template_kwargs are the template's variables (this template reads none, so the prompt is the
    same); one that a request field sets is a 400 naming it, on /tokenize and on chat alike."""
    body = {"model": stack.model, "messages": CHAT, "tools": TOOLS}
    plain = stack.post("/tokenize", body)
    given = stack.post("/tokenize", {**body, "chat_template_kwargs": {"enable_thinking": False}})
    assert plain.status_code == given.status_code == 200 and plain.json()["tokens"] == given.json()["tokens"]
    assert plain.json()["tokens"] == prompt_ids(tok, CHAT, TOOLS)
    for path in ("/tokenize", "/v1/chat/completions"):
        r = stack.post(path, {**body, "max_tokens": 2, "chat_template_kwargs": {"messages": []}})
        assert r.status_code == 400 and "chat_template_kwargs may not set messages" in r.text, r.text


def test_a_named_tool_choice_calls_it_with_transformers_answer_held_to_its_parameters(
    stack, tok, bundled_model_dir
):
    want = held_to(
        tok, bundled_model_dir, prompt_ids(tok, CHAT, TOOLS), WEATHER["function"]["parameters"], 32
    )
    r = stack.client.chat.completions.create(
        model=stack.model, messages=CHAT, tools=TOOLS, tool_choice=NAMED, max_tokens=32, temperature=0
    )
    choice = r.choices[0]
    assert choice.message.content is None and choice.finish_reason == "stop"
    (call,) = choice.message.tool_calls
    assert (call.type, call.function.name, call.function.arguments) == ("function", "get_weather", want)
    assert isinstance(json.loads(want)["city"], str) and call.id.startswith("chatcmpl-tool-")
    assert streamed(stack, messages=CHAT, tools=TOOLS, tool_choice=NAMED, max_tokens=32, temperature=0) == (
        "",
        [("get_weather", want)],
        "stop",
    )


def test_required_calls_are_the_structured_output_of_the_tools_array(stack):
    """The calls are what response_format's json_schema gives for the array of the tools' calls (the path the
    named choice's test and tests/test_structured_output.py hold to transformers), streamed the same; without
    parallel tool calls the array holds one call."""
    from gateway.tools import required_schema

    functions = [(t["function"]["name"], t["function"]["parameters"]) for t in TOOLS]
    base = dict(model=stack.model, messages=CHAT, tools=TOOLS, max_tokens=96, temperature=0)
    schema = {"name": "calls", "schema": required_schema(functions, True)}
    held = stack.client.chat.completions.create(
        **base, tool_choice="none", response_format={"type": "json_schema", "json_schema": schema}
    )
    expected = [
        (c["name"], json.dumps(c["parameters"], ensure_ascii=False))
        for c in json.loads(held.choices[0].message.content)
    ]
    choice = stack.client.chat.completions.create(**base, tool_choice="required").choices[0]
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == expected
    assert choice.finish_reason == "tool_calls" and choice.message.content is None and len(expected) >= 1
    kw = dict(messages=CHAT, tools=TOOLS, tool_choice="required", max_tokens=96, temperature=0)
    assert streamed(stack, **kw) == ("", expected, "tool_calls")
    one = stack.client.chat.completions.create(
        **base, tool_choice="required", parallel_tool_calls=False
    ).choices[0]
    assert len(one.message.tool_calls) == 1 and one.message.tool_calls[0].function.name in (
        "get_weather",
        "get_time",
    )
    assert one.finish_reason == "tool_calls"


def test_auto_picks_hermes_calls_out_of_the_text(stack):
    """The model's own text, held by a regex to a Hermes call, becomes a call; a text with none stays the
    message's content, as tool_choice "none" gives it."""
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    pattern = call.replace("{", r"\{").replace("}", r"\}")
    kw = dict(messages=CHAT, tools=TOOLS, max_tokens=40, temperature=0, extra_body={"guided_regex": pattern})
    r = stack.client.chat.completions.create(model=stack.model, **kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
        ("get_weather", '{"city": "Paris"}')
    ]
    assert streamed(stack, **kw) == ("", [("get_weather", '{"city": "Paris"}')], "tool_calls")
    plain = dict(messages=CHAT, tools=TOOLS, max_tokens=16, temperature=0)
    auto = stack.client.chat.completions.create(model=stack.model, tool_choice="auto", **plain).choices[0]
    none = stack.client.chat.completions.create(model=stack.model, tool_choice="none", **plain).choices[0]
    assert "<tool_call>" not in (none.message.content or "")
    assert (auto.message.content, auto.message.tool_calls, auto.finish_reason) == (
        none.message.content,
        None,
        none.finish_reason,
    )


def test_reasoning_is_split_off_and_calls_are_looked_for_after_it(stack):
    """--reasoning-parser qwen3: a <think> block (here held to by a regex) is the message's reasoning, and the
    call after it is a call; streamed the same; include_reasoning false leaves the reasoning out."""
    thought = "\nThe user wants the weather.\n"
    text = f'<think>{thought}</think>\n\n<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}\n</tool_call>'
    pattern = "".join("\\" + ch if ch in "{}." else ch for ch in text)
    kw = dict(messages=CHAT, tools=TOOLS, max_tokens=64, temperature=0, extra_body={"guided_regex": pattern})
    message = stack.client.chat.completions.create(model=stack.model, **kw).choices[0].message
    assert (message.reasoning, message.reasoning_content, message.content) == (thought, thought, None)
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [
        ("get_weather", '{"city": "Paris"}')
    ]
    reasoning = ""
    for chunk in stack.client.chat.completions.create(model=stack.model, stream=True, **kw):
        reasoning += getattr(chunk.choices[0].delta, "reasoning", None) or ""
    assert reasoning == thought
    hidden = dict(kw, extra_body={**kw["extra_body"], "include_reasoning": False})
    message = stack.client.chat.completions.create(model=stack.model, **hidden).choices[0].message
    assert (
        getattr(message, "reasoning", None) is None and message.tool_calls[0].function.name == "get_weather"
    )


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        (
            {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "not among tools",
        ),
        (
            {"tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
            "structured",
        ),
        ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, None, "tools"),
        ({"functions": [{"name": "f"}]}, "functions", "deprecated"),
    ],
)
def test_tool_requests_that_cannot_be_met_get_400(stack, extra, param, words):
    body = {"model": stack.model, "messages": CHAT, "tools": TOOLS, "max_tokens": 2, **extra}
    r = stack.post("/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert words in error["message"] and (param is None or error["param"] == param), error


def test_auto_needs_the_parser_flags_and_none_may_leave_tools_out(stack, tok):
    """A gateway without --enable-auto-tool-choice refuses "auto", the default where tools are given, as vLLM's
    server does; named and required choices need no flag. With --exclude-tools-when-tool-choice-none a "none"
    request's prompt has no tools in it."""
    proc, url = start_gateway(stack.router, "--exclude-tools-when-tool-choice-none")
    try:
        body = {"model": stack.model, "messages": CHAT, "tools": TOOLS, "max_tokens": 2}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400 and "--enable-auto-tool-choice" in r.json()["error"]["message"], r.text
        named = httpx.post(url + "/v1/chat/completions", json={**body, "tool_choice": NAMED}, timeout=180)
        assert named.status_code == 200 and named.json()["choices"][0]["message"]["tool_calls"], named.text
        assert named.json()["usage"]["prompt_tokens"] == len(prompt_ids(tok, CHAT, TOOLS))
        none = httpx.post(url + "/v1/chat/completions", json={**body, "tool_choice": "none"}, timeout=180)
        assert none.status_code == 200 and none.json()["usage"]["prompt_tokens"] == len(
            prompt_ids(tok, CHAT, None)
        )
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_gateway_refuses_a_parser_flag_it_does_not_know():
    from gateway.app import GatewayConfig

    with pytest.raises(ValueError, match="--tool-call-parser"):
        GatewayConfig(router="x:1", enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="not one of"):
        GatewayConfig(router="x:1", enable_auto_tool_choice=True, tool_call_parser="nope")
    for flags, words in ((("--tool-call-parser", "nope"), "--tool-call-parser"),
                         (("--default-chat-template-kwargs", "[1]"), "JSON object")):  # fmt: skip
        bad = subprocess.run(
            [sys.executable, "-m", "gateway.cli", *flags], capture_output=True, text=True, timeout=60
        )
        assert bad.returncode != 0 and words in bad.stderr, bad.stderr
