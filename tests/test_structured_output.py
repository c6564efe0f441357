"""Structured output (vLLM's structured_outputs: a JSON schema, any JSON object, a regex, a choice) on the bundled
SmolLM2 (fp32, CPU): greedy output equals transformers' generate held to the same pattern by a logits processor
walking its own guide, the text matches the pattern (JSON parses to the schema's keys), batched beside plain
rows and sampled with n > 1; bad patterns are refused before anything runs, and nothing leaks."""

from __future__ import annotations

import json
import re

import pytest

from engine import LLM, SamplingParams
from engine.structured_output import GuideFactory, StructuredOutputsParams, token_bytes
from tests.hf_reference import GuideMask, hf_greedy

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "capital": {"type": "boolean"}},
    "required": ["city", "capital"],
}
CASES = [
    ("Is Paris the capital of France? Answer yes or no.", StructuredOutputsParams(choice=["yes", "no"])),
    ("Give me a phone number.", StructuredOutputsParams(regex=r"[0-9]{3}-[0-9]{4}")),
    ("Describe Paris as JSON.", StructuredOutputsParams(json=SCHEMA)),
    ("What is the capital of France?", None),  # a plain row beside them
]


@pytest.fixture(scope="module")
def llm(bundled_model_dir):
    return LLM(dtype="float32", device="cpu", cpu_kv_cache_space=0.1, max_model_len=512)


@pytest.fixture(scope="module")
def prompts(llm):
    tok = llm.engine.tokenizer
    chat = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        for q, _ in CASES
    ]
    return [tok.encode(c, add_special_tokens=False) for c in chat]


def no_leak(llm: LLM) -> bool:
    bm = llm.engine.block_manager
    return bm.num_free_blocks == bm.num_blocks and not llm.engine.has_unfinished_requests()


def test_greedy_output_equals_transformers_held_to_the_same_pattern(llm, prompts, bundled_model_dir):
    factory = GuideFactory(llm.engine.tokenizer, llm.engine.model_config.vocab_size)
    extra = [
        {"logits_processor": [GuideMask(factory.guide(so), len(p))]} if so else {}
        for p, (_, so) in zip(prompts, CASES)
    ]
    want = hf_greedy(bundled_model_dir, prompts, [40] * len(prompts), extra)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        [SamplingParams(temperature=0, max_tokens=40, structured_outputs=so) for _, so in CASES],
    )
    assert [o.outputs[0].token_ids for o in outs] == want
    texts = [o.outputs[0].text for o in outs]
    assert texts[0] in ("yes", "no") and re.fullmatch(r"[0-9]{3}-[0-9]{4}", texts[1])
    doc = json.loads(texts[2])
    assert set(doc) == {"city", "capital"} and isinstance(doc["capital"], bool)
    assert all(o.outputs[0].finish_reason == "stop" for o in outs[:3])
    assert no_leak(llm)


def test_sampled_completions_and_any_json_object_keep_to_the_pattern(llm, prompts):
    out = llm.generate(
        {"prompt_token_ids": prompts[1]},
        SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=12, structured_outputs=CASES[1][1]),
    )[0]
    assert all(re.fullmatch(r"[0-9]{3}-[0-9]{4}", c.text) for c in out.outputs)
    obj = llm.generate(
        {"prompt_token_ids": prompts[2]},
        SamplingParams(
            temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(json_object=True)
        ),
    )[0].outputs[0]
    assert obj.text.startswith("{")
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.text), dict)
    assert no_leak(llm)


def test_the_vocabulary_is_each_tokens_bytes_without_special_tokens(llm):
    tok = llm.engine.tokenizer
    table = token_bytes(tok)
    by_id = {i: b for b, ids in table.items() for i in ids}
    for text in ("Paris", " capital", "\n", "123"):
        for i in tok.encode(text, add_special_tokens=False):
            assert by_id[i] == tok.decode([i]).encode()
    assert not set(tok.eos_token_ids) & set(by_id) and len(by_id) > 40000


def test_a_pattern_that_ends_before_min_tokens_ends_the_output(llm, prompts):
    """min_tokens holds EOS back, but where the pattern's match is complete EOS is the only token it allows:
    the pattern wins, so every token stays inside it (greedy and sampled) and the output ends at the match."""
    choice = CASES[0][1]
    for temperature in (0.0, 1.0):
        params = [
            SamplingParams(
                temperature=temperature, seed=3, max_tokens=8, min_tokens=m, structured_outputs=choice
            )
            for m in (0, 6)
        ]
        free, held = (llm.generate({"prompt_token_ids": prompts[0]}, p)[0].outputs[0] for p in params)
        assert held.token_ids == free.token_ids and held.text in ("yes", "no")
        assert held.finish_reason == "stop"
    assert no_leak(llm)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"grammar": "root ::= 'a'"}, "grammar (EBNF) is not supported"),
        ({"regex": "a", "choice": ["a"]}, "exactly one of"),
        ({}, "exactly one of"),
        ({"regex": "(a"}, "regex does not compile"),
        ({"json": "{not json"}, "JSON schema is not JSON"),
        ({"choice": [""]}, "non-empty strings"),
    ],
)
def test_bad_structured_output_is_refused(kwargs, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        StructuredOutputsParams(**kwargs)


def test_a_pattern_compiling_holds_only_its_own_request(bundled_model_dir, prompts):
    """Any JSON object's pattern takes seconds to compile: meanwhile a plain request runs to its end and the
    structured one waits aside, then runs held to it. A pattern outlines-core cannot compile (lookahead, which
    Python's re takes) ends its request as aborted, with no text."""
    llm = LLM(dtype="float32", device="cpu", cpu_kv_cache_space=0.1, max_model_len=512)
    engine = llm.engine
    obj = engine.add_request(
        prompts[2],
        SamplingParams(
            temperature=0, max_tokens=24, structured_outputs=StructuredOutputsParams(json_object=True)
        ),
    )
    plain = engine.add_request(prompts[3], SamplingParams(temperature=0, max_tokens=6))
    bad = engine.add_request(
        prompts[1],
        SamplingParams(
            temperature=0, max_tokens=6, structured_outputs=StructuredOutputsParams(regex="(?=1)1")
        ),
    )
    done, order = {}, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
                order.append(out.request_id)
    assert order.index(plain) < order.index(obj)
    assert done[obj].outputs[0].text.startswith("{")
    assert (done[bad].outputs[0].finish_reason, done[bad].outputs[0].text) == ("abort", "")
    assert no_leak(llm)
