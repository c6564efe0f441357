"""Reasoning split off chat answers (gateway/reasoning.py, vLLM's --reasoning-parser): the same split however
the text is cut into stream pieces, a streamed choice equal to the whole one, tool calls looked for in the
content only, and include_reasoning false leaving it out."""

from __future__ import annotations

import pytest

from gateway.reasoning import Reasoning
from gateway.responses import Choice, Formatter, TokenText, Totals
from gateway.tools import ToolPlan
from protos import pdserve_pb2 as pb

THOUGHT = "<think>\nParis is in France, so: weather.\n</think>\n\nIt is sunny."


def pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]


def split_streamed(reasoning: Reasoning, text: str, size: int) -> tuple[str, str]:
    stream, r, c = reasoning.stream(), "", ""
    for p in pieces(text, size):
        dr, dc = stream.feed(p)
        r, c = r + dr, c + dc
    dr, dc = stream.finish()
    return r + dr, c + dc


@pytest.mark.parametrize("size", [1, 2, 5, 1000])
@pytest.mark.parametrize(
    ("parser", "constrained", "text", "want"),
    [
        ("deepseek_r1", False, THOUGHT, ("\nParis is in France, so: weather.\n", "\n\nIt is sunny.")),
        ("qwen3", False, THOUGHT, ("\nParis is in France, so: weather.\n", "\n\nIt is sunny.")),
        # DeepSeek-R1's template opens the tag in the prompt: the text starts inside the reasoning
        ("deepseek_r1", False, "thinking</think>answer", ("thinking", "answer")),
        ("deepseek_r1", False, "never closed <thi", ("never closed <thi", "")),
        ("qwen3", False, "  no thinking, </think> kept", ("", "  no thinking, </think> kept")),
        ("qwen3", False, "<think>cut short", ("cut short", "")),
        # structured output holds the text from its first token: only an explicit <think> opens reasoning
        ("deepseek_r1", True, '{"a": 1}', ("", '{"a": 1}')),
        ("deepseek_r1", True, "<think>x</think>{}", ("x", "{}")),
        ("qwen3", False, "", ("", "")),
    ],
)
def test_every_cut_of_the_text_splits_the_same(size, parser, constrained, text, want):
    reasoning = Reasoning(parser, constrained=constrained)
    assert reasoning.split(text) == want
    assert split_streamed(reasoning, text, size) == want


def chunks_of(fmt: Formatter, text: str) -> list[dict]:
    parts = pieces(text, 3)
    out = []
    for i, p in enumerate(parts):
        finish = "stop" if i == len(parts) - 1 else ""
        out += fmt.stream(0, pb.GenerateResponse(index=0, token_ids=[1], text=p, finish_reason=finish))
    return [c["choices"][0] for c in out]


@pytest.mark.parametrize("show", [True, False])
def test_a_streamed_choice_carries_the_whole_ones_reasoning_content_and_calls(show):
    text = THOUGHT.replace("It is sunny.", '<tool_call>{"name": "w", "arguments": {"c": "P"}}</tool_call>')
    plan = ToolPlan("auto", parser="hermes")
    reasoning = Reasoning("qwen3", show=show)
    deltas = chunks_of(Formatter(True, "m", None, TokenText(None), tools=plan, reasoning=reasoning), text)
    got = {
        k: "".join(d["delta"].get(k) or "" for d in deltas)
        for k in ("reasoning", "reasoning_content", "content")
    }
    calls = [e for d in deltas for e in d["delta"].get("tool_calls", [])]
    fmt = Formatter(True, "m", None, TokenText(None), tools=plan, reasoning=reasoning)
    whole = fmt.whole({0: Choice(text=[text], finish_reason="stop")}, Totals())["choices"][0]
    message = whole["message"]
    thought = "\nParis is in France, so: weather.\n"
    assert message.get("reasoning") == (thought if show else None) == message.get("reasoning_content")
    assert got["reasoning"] == got["reasoning_content"] == (thought if show else "")
    assert message["content"] is None and got["content"] == ""  # the whitespace before the call is dropped
    assert (
        [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
        == [(e["function"]["name"], e["function"]["arguments"]) for e in calls]
        == [("w", '{"c": "P"}')]
    )
    assert whole["finish_reason"] == deltas[-1]["finish_reason"] == "tool_calls"


def test_without_a_reasoning_parser_the_think_block_is_content():
    fmt = Formatter(True, "m", None, TokenText(None))
    whole = fmt.whole({0: Choice(text=[THOUGHT], finish_reason="stop")}, Totals())["choices"][0]
    assert whole["message"] == {"role": "assistant", "content": THOUGHT}
