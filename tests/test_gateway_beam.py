"""vLLM's use_beam_search through the gateway (gateway/beam.py) on `pdserve up` with the bundled model: the n
choices are the engine's own beam search (engine/beam_search.py, checked against transformers there) run in one
process, best first, for completions and chat; what beam search would ignore is refused by name."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from engine import LLM
from engine.beam_search import BeamSearchParams
from tests.cluster import OpenAIStack, openai_stack

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def stack() -> Iterator[OpenAIStack]:
    with openai_stack() as s:
        yield s


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(device="cpu", dtype="float32", cpu_kv_cache_space=0.05, max_model_len=512)


def test_beams_are_the_engines_own(stack: OpenAIStack, llm: LLM) -> None:
    params = BeamSearchParams(beam_width=3, max_tokens=6, length_penalty=0.5)
    want = llm.beam_search(PROMPT, params)[0].sequences
    got = stack.client.completions.create(
        model=stack.model, prompt=PROMPT, n=3, max_tokens=6, temperature=0,
        extra_body={"use_beam_search": True, "length_penalty": 0.5},
    )  # fmt: skip
    assert [c.text for c in got.choices] == [b.text for b in want]
    assert [c.finish_reason for c in got.choices] == [b.finish_reason for b in want]
    assert got.usage.completion_tokens == sum(len(b.tokens) for b in want) - 3 * got.usage.prompt_tokens
    messages = [{"role": "user", "content": "Name a color."}]
    prompt = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ids = llm.tokenizer.encode(prompt, add_special_tokens=False)
    chat_want = llm.beam_search({"prompt_token_ids": ids}, BeamSearchParams(beam_width=2, max_tokens=5))[0]
    chat = stack.client.chat.completions.create(
        model=stack.model, messages=messages, n=2, max_tokens=5, extra_body={"use_beam_search": True}
    )
    assert [c.message.content for c in chat.choices] == [b.text for b in chat_want.sequences]


@pytest.mark.parametrize(
    ("extra", "field"),
    [({"stop": ["\n"]}, "stop"), ({"stream": True}, "stream"), ({"logprobs": 2}, "logprobs"),
     ({"presence_penalty": 0.5}, "presence_penalty"), ({"top_p": 0.5}, "top_p")],
)  # fmt: skip
def test_what_beam_search_would_ignore_is_refused(stack: OpenAIStack, extra: dict, field: str) -> None:
    body = {"model": stack.model, "prompt": PROMPT, "n": 2, "max_tokens": 4, "use_beam_search": True, **extra}
    resp = stack.post("/v1/completions", body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["message"] == f"{field} is not supported with use_beam_search"
