"""OpenAI's Responses API through the gateway end to end: a real cluster (router + prefill + decode over tcp)
whose router renders tools (router/templates/chatml_hermes_tools.jinja), the official `openai` client's
`responses` resource, transformers as the reference for the text."""

from __future__ import annotations

import json

import openai
import pytest

from gateway.responses_api import ResponseStore
from tests.cluster import openai_stack
from tests.hf_reference import hf_greedy
from tests.test_gateway_tools import TEMPLATE, TOOLS

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"
WEATHER = {"type": "function", **TOOLS[0]["function"]}  # the Responses API's tools are flat


@pytest.fixture(scope="module")
def stack(bundled_model_dir):
    with openai_stack(("--chat-template", str(TEMPLATE))) as stack:
        yield stack


@pytest.fixture(scope="module")
def tok(bundled_model_dir):
    from engine.tokenizer import Tokenizer

    return Tokenizer.from_dir(bundled_model_dir, chat_template=TEMPLATE.read_text())


def ids_of(tok, messages: list[dict]) -> list[int]:
    return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False)


def test_a_text_response_is_transformers_answer(stack, tok, bundled_model_dir):
    """instructions are the system turn; the answer is one message item; usage counts the prompt as chat does;
    cut by max_output_tokens the response is incomplete."""
    messages = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": QUESTION}]
    ids = ids_of(tok, messages)
    want = hf_greedy(bundled_model_dir, [ids], [24])[0]
    r = stack.client.responses.create(
        model=stack.model,
        instructions="Answer in one word.",
        input=QUESTION,
        max_output_tokens=24,
        temperature=0,
    )
    assert r.status == "completed" and r.output_text == tok.decode(want) and r.id.startswith("resp_")
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert (r.usage.input_tokens, r.usage.output_tokens) == (len(ids), len(want))
    cut = stack.client.responses.create(model=stack.model, input=QUESTION, max_output_tokens=2, temperature=0)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.output[0].status == "incomplete"


def test_a_streamed_response_sends_the_events_of_the_whole_one(stack):
    kw = dict(model=stack.model, input=QUESTION, max_output_tokens=24, temperature=0)
    whole = stack.client.responses.create(**kw)
    events = list(stack.client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[2:5] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    assert kinds[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert (
        deltas == whole.output_text == final.output_text
        and final.usage.output_tokens == whole.usage.output_tokens
    )


def test_a_function_call_and_its_output_continue_the_conversation(stack, tok, bundled_model_dir):
    """A named tool choice gives a function_call item (its arguments held to the tool's parameters); the next
    request continues it by previous_response_id with the call's output, rendered as chat renders a tool turn;
    a stored response is read back and deleted."""
    first = stack.client.responses.create(
        model=stack.model, input="What is the weather in Paris?", tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=32, temperature=0,
    )  # fmt: skip
    (call,) = first.output
    assert (
        call.type == "function_call"
        and call.name == "get_weather"
        and call.call_id.startswith("chatcmpl-tool-")
    )
    assert isinstance(json.loads(call.arguments)["city"], str)
    second = stack.client.responses.create(
        model=stack.model, previous_response_id=first.id, tools=[WEATHER], tool_choice="none",
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "21 C, sunny"}],
        max_output_tokens=16, temperature=0,
    )  # fmt: skip
    tools = [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}]
    turns = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": "get_weather", "arguments": json.loads(call.arguments)}}
        ]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "21 C, sunny"},
    ]  # fmt: skip
    text = tok.apply_chat_template(turns, add_generation_prompt=True, tools=tools)
    ids = tok.encode(text, add_special_tokens=False)
    assert "<tool_response>\n21 C, sunny" in text and second.usage.input_tokens == len(ids)
    assert second.output_text == tok.decode(hf_greedy(bundled_model_dir, [ids], [16])[0])
    got = stack.client.responses.retrieve(second.id)
    assert (got.id, got.output_text, got.previous_response_id) == (second.id, second.output_text, first.id)
    stack.client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        stack.client.responses.retrieve(second.id)


def test_text_format_holds_the_output_to_a_schema(stack):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
    }
    r = stack.client.responses.create(
        model=stack.model, input=QUESTION, max_output_tokens=32, temperature=0,
        text={"format": {"type": "json_schema", "name": "city", "schema": schema}},
    )  # fmt: skip
    assert isinstance(json.loads(r.output_text)["city"], str)
    assert r.text.format.type == "json_schema"


@pytest.mark.parametrize(
    ("extra", "status", "param", "words"),
    [
        ({"background": True}, 400, "background", "background"),
        ({"reasoning": {"effort": "high"}}, 400, "reasoning", "reasoning"),
        ({"previous_response_id": "resp_nope"}, 404, "response_id", "resp_nope"),
        ({"tools": [{"type": "web_search"}]}, 400, None, "function"),
        ({"truncation": "auto"}, 400, None, "truncation"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format", "schema"),
        ({"tool_choice": "required"}, 400, "tool_choice", "needs tools"),
    ],
)
def test_what_cannot_be_met_gets_an_error_naming_it(stack, extra, status, param, words):
    r = stack.post("/v1/responses", {"model": stack.model, "input": "Hi", "max_output_tokens": 2, **extra})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert words in error["message"] and (param is None or error["param"] == param), error


def test_the_store_keeps_each_tenants_responses_and_drops_the_oldest():
    store = ResponseStore(max_responses=2)
    for i in range(3):
        store.put("a", {"id": f"r{i}", "output": []}, [{"role": "user", "content": "x"}])
    with pytest.raises(Exception, match="r0"):
        store.get("a", "r0")
    assert store.get("a", "r2")[0]["id"] == "r2"
    with pytest.raises(Exception, match="r2"):
        store.get("b", "r2")  # another tenant's
    big = ResponseStore(max_chars=100)
    big.put(None, {"id": "r", "output": []}, [{"role": "user", "content": "y" * 200}])
    with pytest.raises(Exception, match="not found"):
        big.get(None, "r")
