"""Reasoning outputs, as vLLM's `--reasoning-parser` gives them: the text a reasoning model writes between
`<think>` and `</think>` is the message's `reasoning` (and `reasoning_content`, its older name), the rest its
content; tool calls are looked for in the content only.

- `deepseek_r1`: everything up to `</think>` is reasoning, with or without `<think>` first (DeepSeek-R1's
  template writes the opening tag into the prompt); a text that never closes it is all reasoning.
- `qwen3`: a text that starts with `<think>` reasons until `</think>`; any other text is content (Qwen3 with
  `enable_thinking` off, through chat_template_kwargs).

Structured output (and so a named or required tool choice) holds the text from the end of the reasoning, as
vLLM's does, where the model's tokenizer has `<think>` and `</think>` as tokens of their own (the router's
ModelInfo.think_tokens): the workers leave the text free until `</think>`. With other tokenizers it holds the
text from its first token, and such a text reasons only where it opens with `<think>` itself (`constrained`).
Like the tool-call parsers (gateway/tools.py) it reads a choice's text as it streams (`ReasoningStream.feed`,
then `finish`), and a whole response is the same parser fed the whole text.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.structured_output import THINK_MARKERS
from gateway.call_stream import held_prefix

PARSERS = ("deepseek_r1", "qwen3")
START, END = THINK_MARKERS


@dataclass(frozen=True)
class Reasoning:
    """A request's reasoning settings: the gateway's parser; `show` (vLLM's include_reasoning) false drops the
    reasoning; `constrained`: structured output holds the text from its first token, so only an explicit
    `<think>` opens reasoning, whatever the parser."""

    parser: str
    show: bool = True
    constrained: bool = False

    def stream(self) -> ReasoningStream:
        return ReasoningStream("qwen3" if self.constrained else self.parser)

    def split(self, text: str) -> tuple[str, str]:
        """A whole text's (reasoning, content)."""
        stream = self.stream()
        r1, c1 = stream.feed(text)
        r2, c2 = stream.finish()
        return r1 + r2, c1 + c2


class ReasoningStream:
    """One choice's text split into (reasoning, content) pieces as it streams."""

    def __init__(self, parser: str) -> None:
        self.parser = parser
        self.state = "start"  # "start" (undecided), "reasoning", "content"
        self.pending = ""

    def feed(self, text: str) -> tuple[str, str]:
        self.pending += text
        reasoning = content = ""
        if self.state == "start":
            lead = self.pending.lstrip()
            if lead.startswith(START):
                self.state, self.pending = "reasoning", lead[len(START) :]
            elif START.startswith(lead):
                return "", ""  # whitespace, or the opening tag's start
            else:
                self.state = "reasoning" if self.parser == "deepseek_r1" else "content"
        if self.state == "reasoning":
            at = self.pending.find(END)
            if at < 0:
                keep = held_prefix(self.pending, END)
                reasoning, self.pending = (
                    self.pending[: len(self.pending) - keep],
                    self.pending[len(self.pending) - keep :],
                )
                return reasoning, ""
            reasoning, self.pending = self.pending[:at], self.pending[at + len(END) :]
            self.state = "content"
        if self.state == "content":
            content, self.pending = self.pending, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        rest, self.pending = self.pending, ""
        if self.state == "reasoning" or (self.state == "start" and self.parser == "deepseek_r1"):
            return rest, ""
        return "", rest
