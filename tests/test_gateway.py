"""The OpenAI gateway end to end: real cluster (router + prefill + decode over tcp), the gateway in its own
process, the official `openai` client (sync and async, streaming and not), transformers as the reference."""

from __future__ import annotations

import asyncio
import re
import subprocess
import time

import httpx
import openai
import pytest
import torch

from tests.cluster import start_cluster, start_gateway
from tests.hf_reference import AllowOnly, BanWords, GuideMask, hf_greedy, hf_logits

pytestmark = pytest.mark.slow

KEY = "sk-test-key"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


class Stack:
    def __init__(self, cluster, proc: subprocess.Popen, url: str, model: str) -> None:
        self.cluster, self.proc, self.url, self.model = cluster, proc, url, model

    def client(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=120)

    def aclient(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0, timeout=120)

    def post(self, path: str, body, key: str | None = KEY) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.post(self.url + path, json=body, headers=headers, timeout=120)


@pytest.fixture(scope="module")
def stack(bundled_model_dir):
    cluster = start_cluster(1, 1, "tcp")
    try:
        proc, url = start_gateway(cluster.router, "--api-key", KEY)
        try:
            model = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()
            yield Stack(cluster, proc, url, model["data"][0]["id"])
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    finally:
        cluster.stop()


SMALL_LIMIT = 1024 * 1024


@pytest.fixture(scope="module")
def small_gateway(stack):
    """A second gateway on the same cluster that accepts bodies up to 1 MiB."""
    proc, url = start_gateway(stack.cluster.router, "--api-key", KEY, "--max-request-bytes", str(SMALL_LIMIT))
    try:
        yield Stack(stack.cluster, proc, url, stack.model)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def tok(bundled_model_dir):
    from engine.tokenizer import Tokenizer

    return Tokenizer.from_dir(bundled_model_dir)


@pytest.fixture(scope="module")
def chat_ids(tok):
    return tok.encode(tok.apply_chat_template(CHAT, add_generation_prompt=True), add_special_tokens=False)


@pytest.fixture(scope="module")
def chat_expected(bundled_model_dir, chat_ids):
    return hf_greedy(bundled_model_dir, [chat_ids], [24])[0]


def test_chat_greedy_matches_transformers(stack, tok, chat_ids, chat_expected):
    r = stack.client().chat.completions.create(model=stack.model, messages=CHAT, max_tokens=24, temperature=0)
    assert r.choices[0].message.content == tok.decode(chat_expected)
    assert r.choices[0].finish_reason == ("stop" if len(chat_expected) < 24 else "length")
    assert r.usage.prompt_tokens == len(chat_ids)
    assert r.usage.completion_tokens == len(chat_expected)
    assert r.usage.total_tokens == len(chat_ids) + len(chat_expected)
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_stream_async_matches_and_reports_usage(stack, tok, chat_ids, chat_expected):
    async def run():
        stream = await stack.aclient().chat.completions.create(
            model=stack.model,
            messages=CHAT,
            max_completion_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        parts, usage, finish = [], None, None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                parts.append(c.delta.content or "")
                finish = c.finish_reason or finish
        return "".join(parts), usage, finish

    text, usage, finish = asyncio.run(run())
    assert text == tok.decode(chat_expected)
    assert finish in ("stop", "length")
    assert usage.prompt_tokens == len(chat_ids) and usage.completion_tokens == len(chat_expected)
    assert usage.prompt_tokens_details.cached_tokens > 0  # the same prompt ran in the test before


def test_n3_gives_three_choices(stack):
    r = stack.client().chat.completions.create(
        model=stack.model, messages=CHAT, n=3, max_tokens=5, temperature=0.9, seed=7
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 15  # 3 x 5: a sampled 5-token answer rarely hits EOS
    assert all(c.finish_reason == "length" for c in r.choices)


def test_completions_stream_sync_many_prompts(stack, tok, bundled_model_dir):
    prompts = ["Once upon a time", "Water boils at"]
    ids = [tok.encode(p) for p in prompts]
    expected = hf_greedy(bundled_model_dir, ids, [6, 6])
    stream = stack.client().completions.create(
        model=stack.model, prompt=ids, max_tokens=6, temperature=0, stream=True
    )
    texts = ["", ""]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [tok.decode(e) for e in expected]


def test_stop_string_ends_the_text_before_it(stack):
    client, prompt = stack.client(), "def add(a, b):"
    full = client.completions.create(model=stack.model, prompt=prompt, max_tokens=20, temperature=0)
    text = full.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), text
    r = client.completions.create(model=stack.model, prompt=prompt, max_tokens=20, temperature=0, stop=[stop])
    assert r.choices[0].text == text[: text.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_logprobs_match_the_models_log_softmax(stack, tok, bundled_model_dir, chat_ids):
    ref = torch.log_softmax(hf_logits(bundled_model_dir, chat_ids)[-1], -1)
    top = ref.topk(5)
    r = stack.client().chat.completions.create(
        model=stack.model, messages=CHAT, max_tokens=1, temperature=0, logprobs=True, top_logprobs=5
    )
    first = r.choices[0].logprobs.content[0]
    assert first.logprob == pytest.approx(top.values[0].item(), abs=1e-3)
    assert [t.logprob for t in first.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-3)
    assert [t.token for t in first.top_logprobs] == [
        tok.decode([i], skip_special_tokens=False) for i in top.indices.tolist()
    ]
    c = stack.client().completions.create(
        model=stack.model, prompt=chat_ids, max_tokens=1, temperature=0, logprobs=3
    )
    assert c.choices[0].logprobs.token_logprobs[0] == pytest.approx(top.values[0].item(), abs=1e-3)
    # vLLM's return_tokens_as_token_ids: the same logprobs, each token named by its id
    ids = stack.client().chat.completions.create(
        model=stack.model, messages=CHAT, max_tokens=1, temperature=0, logprobs=True, top_logprobs=5,
        extra_body={"return_tokens_as_token_ids": True},
    ).choices[0].logprobs.content[0]  # fmt: skip
    assert ids.token == f"token_id:{top.indices[0].item()}"
    assert [t.token for t in ids.top_logprobs] == [f"token_id:{i}" for i in top.indices.tolist()]
    assert [t.logprob for t in ids.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-3)
    c = stack.client().completions.create(
        model=stack.model, prompt=chat_ids, max_tokens=1, temperature=0, logprobs=3,
        extra_body={"return_tokens_as_token_ids": True},
    )  # fmt: skip
    assert c.choices[0].logprobs.tokens == [f"token_id:{top.indices[0].item()}"]


PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def prompt_ref(tok, bundled_model_dir):
    """PROMPT's ids and transformers' fp32 log-softmax at each of its positions, (len, vocab)."""
    ids = tok.encode(PROMPT)
    return ids, torch.log_softmax(hf_logits(bundled_model_dir, ids), -1)


def scored(ids: list[int], ref: torch.Tensor) -> list[float]:
    """The reference logprob of each prompt token after the first, from the position before it."""
    return ref[torch.arange(len(ids) - 1), ids[1:]].tolist()


def check_prompt_logprobs(got, ids: list[int], ref: torch.Tensor, k: int, tok) -> None:
    """vLLM's prompt_logprobs: None, then per prompt token {id: {logprob, rank, decoded_token}} holding the token
    and the top k (ranked 1..k), as transformers computes them at the position before it."""
    assert got is not None and len(got) == len(ids) and got[0] is None
    for i in range(1, len(ids)):
        entry, want = got[i], ref[i - 1]
        top = want.topk(k).indices.tolist() if k else []
        assert set(entry) == {str(t) for t in [ids[i], *top]}, i
        for t, value in entry.items():
            assert value["logprob"] == pytest.approx(want[int(t)].item(), abs=1e-3), (i, t)
            rank = top.index(int(t)) + 1 if int(t) in top else None
            assert value["rank"] == rank and value["decoded_token"] == tok.decode(
                [int(t)], skip_special_tokens=False
            )


@pytest.mark.parametrize("max_tokens", [1, 0])
def test_echo_with_logprobs_scores_the_prompt_as_transformers(stack, tok, prompt_ref, max_tokens):
    """lm-eval's loglikelihood request: the prompt's text and tokens first, its first token without a logprob,
    the others' as transformers' log-softmax gives them; max_tokens 0 returns the prompt alone."""
    ids, ref = prompt_ref
    client = stack.client()
    r = client.completions.create(
        model=stack.model, prompt=PROMPT, echo=True, logprobs=1, max_tokens=max_tokens, temperature=0
    )
    c, n = r.choices[0], len(ids)
    assert c.logprobs.tokens[:n] == [tok.decode([i], skip_special_tokens=False) for i in ids]
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
    assert c.logprobs.token_logprobs[1:n] == pytest.approx(scored(ids, ref), abs=1e-3)
    for i in range(1, n):
        best = ref[i - 1].argmax().item()
        top = c.logprobs.top_logprobs[i]
        assert top[tok.decode([best], skip_special_tokens=False)] == pytest.approx(
            ref[i - 1, best].item(), abs=1e-3
        )
    assert c.logprobs.text_offset[0] == 0
    assert c.model_extra.get("prompt_logprobs") is None  # echo's own: the field only when asked for
    if max_tokens == 0:
        assert (c.text, len(c.logprobs.tokens), c.finish_reason) == (PROMPT, n, "length")
        return
    plain = client.completions.create(model=stack.model, prompt=PROMPT, max_tokens=1, temperature=0)
    assert c.text == PROMPT + plain.choices[0].text and len(c.logprobs.tokens) == n + 1
    assert c.logprobs.token_logprobs[n] == pytest.approx(ref[-1].max().item(), abs=1e-3)


def test_echo_streams_the_prompt_first_in_every_choice(stack, tok, prompt_ref):
    """Streaming, n = 2, a token-id prompt: each choice's first chunk holds the prompt's decoded text and its
    tokens' logprobs; the completion follows."""
    ids, ref = prompt_ref
    client, n = stack.client(), len(ids)
    stream = client.completions.create(
        model=stack.model, prompt=ids, echo=True, logprobs=1, max_tokens=3, n=2, temperature=0, stream=True
    )
    firsts: dict[int, str] = {}
    texts, lps = {0: "", 1: ""}, {0: [], 1: []}
    for chunk in stream:
        for c in chunk.choices:
            firsts.setdefault(c.index, c.text)
            texts[c.index] += c.text
            lps[c.index] += c.logprobs.token_logprobs if c.logprobs else []
    plain = client.completions.create(model=stack.model, prompt=ids, max_tokens=3, temperature=0)
    echoed = tok.decode(ids, skip_special_tokens=False)
    for i in (0, 1):
        assert firsts[i].startswith(echoed) and texts[i] == echoed + plain.choices[0].text
        assert lps[i][0] is None and lps[i][1:n] == pytest.approx(scored(ids, ref), abs=1e-3)
        assert len(lps[i]) == n + plain.usage.completion_tokens


def test_prompt_logprobs_on_completions_and_chat(stack, tok, prompt_ref, chat_ids, bundled_model_dir):
    """vLLM's extra field: on every completions choice of the prompt (n = 2: computed once, by completion 0),
    on the chat response itself, and on a stream's first chunk."""
    ids, ref = prompt_ref
    client = stack.client()
    r = client.completions.create(
        model=stack.model, prompt=PROMPT, max_tokens=2, n=2, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    assert len(r.choices) == 2
    for c in r.choices:
        check_prompt_logprobs(c.model_extra["prompt_logprobs"], ids, ref, 2, tok)
    chat_ref = torch.log_softmax(hf_logits(bundled_model_dir, chat_ids), -1)
    chat = client.chat.completions.create(
        model=stack.model, messages=CHAT, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    check_prompt_logprobs(chat.model_extra["prompt_logprobs"], chat_ids, chat_ref, 2, tok)
    stream = client.chat.completions.create(
        model=stack.model, messages=CHAT, max_tokens=3, temperature=0, stream=True,
        extra_body={"prompt_logprobs": 0},
    )  # fmt: skip
    got = [chunk.model_extra.get("prompt_logprobs") for chunk in stream]
    assert all(g is None for g in got[1:])
    check_prompt_logprobs(got[0], chat_ids, chat_ref, 0, tok)


def test_truncate_prompt_tokens_runs_the_prompts_last_tokens(stack, tok):
    """vLLM's truncate_prompt_tokens: a text prompt past max_model_len (1024 here) runs as its last 40 tokens,
    as those ids alone do; echo shows what ran; past max_model_len it is a 400 naming the field."""
    text = "Caches, pages and careful layouts matter. " * 200
    ids = tok.encode(text)
    assert len(ids) > 1024
    client = stack.client()
    alone = client.completions.create(model=stack.model, prompt=ids[-40:], max_tokens=4, temperature=0)
    for prompt in (text, ids):
        r = client.completions.create(
            model=stack.model, prompt=prompt, max_tokens=4, temperature=0, echo=True,
            extra_body={"truncate_prompt_tokens": 40},
        )  # fmt: skip
        kept = tok.decode(ids[-40:], skip_special_tokens=False)
        assert r.choices[0].text == kept + alone.choices[0].text
        assert r.usage.prompt_tokens == 40
    chat = client.chat.completions.create(
        model=stack.model, messages=[{"role": "user", "content": text}], max_tokens=2, temperature=0,
        extra_body={"truncate_prompt_tokens": 30},
    )  # fmt: skip
    assert chat.usage.prompt_tokens == 30
    for extra, words in [({"truncate_prompt_tokens": 2000}, "greater than max_model_len"),
                         ({"truncate_prompt_tokens": -3}, "greater than or equal to -1")]:  # fmt: skip
        for echo in (False, True):
            r = stack.post("/v1/completions", {"model": stack.model, "prompt": "Hi", "echo": echo, **extra})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == "truncate_prompt_tokens" and words in error["message"], error


def test_bad_prompt_logprobs_and_max_tokens_get_400(stack):
    for path, extra, param, words in [
        ("/v1/completions", {"prompt_logprobs": -1}, "prompt_logprobs", "greater than or equal to 0"),
        ("/v1/chat/completions", {"prompt_logprobs": 21}, "prompt_logprobs", "less than or equal to 20"),
        ("/v1/completions", {"prompt_logprobs": "all"}, "prompt_logprobs", "integer"),
        ("/v1/completions", {"max_tokens": 0}, "max_tokens", "only with echo"),
        ("/v1/completions", {"max_tokens": -1, "echo": True}, "max_tokens", "greater than or equal to 0"),
        ("/v1/chat/completions", {"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ]:
        body = {
            "model": stack.model,
            "max_tokens": 2,
            **({"messages": CHAT} if "chat" in path else {"prompt": "Hi"}),
        }
        r = stack.post(path, {**body, **extra})
        assert r.status_code == 400, (extra, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
        assert error["param"] == param and words in error["message"], (extra, error)
        assert error["code"] == "invalid_request", error


def test_penalties_reach_the_sampler(stack):
    body = dict(model=stack.model, prompt="one one one one one", max_tokens=12, temperature=0)
    plain = stack.client().completions.create(**body).choices[0].text
    penalized = stack.client().completions.create(
        **body, frequency_penalty=2.0, presence_penalty=2.0, extra_body={"repetition_penalty": 1.5}
    )
    assert penalized.choices[0].text != plain


def test_logit_bias_min_tokens_and_allowed_token_ids_match_transformers(
    stack, tok, bundled_model_dir, chat_ids, chat_expected
):
    """Through the gateway, the router and a prefill worker (the first token) and a decode worker (the rest)."""
    first = chat_expected[0]
    assert len(chat_expected) < 16  # the plain answer ends at EOS
    allowed = sorted(set(chat_expected) - {first})  # EOS among them
    want = hf_greedy(
        bundled_model_dir, [chat_ids] * 3, [24, 24, 10],
        [{"sequence_bias": {(first,): -100.0}}, {"min_new_tokens": 16, "sequence_bias": {(first,): 3.0}},
         {"logits_processor": [AllowOnly(allowed)]}],
    )  # fmt: skip
    assert want[0][0] != first and len(want[1]) >= 16 and set(want[2]) <= set(allowed)
    client = stack.client()
    biased = client.chat.completions.create(
        model=stack.model, messages=CHAT, max_tokens=24, temperature=0, logit_bias={str(first): -100}
    )
    assert biased.choices[0].message.content == tok.decode(want[0])
    assert biased.usage.completion_tokens == len(want[0])
    held = client.chat.completions.create(
        model=stack.model, messages=CHAT, max_tokens=24, temperature=0, logit_bias={str(first): 3},
        extra_body={"min_tokens": 16},
    )  # fmt: skip
    assert held.choices[0].message.content == tok.decode(want[1])
    assert held.usage.completion_tokens == len(want[1])
    kept = client.completions.create(
        model=stack.model,
        prompt=chat_ids,
        max_tokens=10,
        temperature=0,
        extra_body={"allowed_token_ids": allowed},
    )
    assert kept.choices[0].text == tok.decode(want[2])
    assert kept.usage.completion_tokens == len(want[2])


def test_bad_words_match_transformers(stack, tok, bundled_model_dir, chat_ids, chat_expected):
    """vLLM's bad_words through a prefill worker (the first token) and a decode worker (the rest): the answer
    is transformers' with the words' last tokens banned vLLM's way."""
    from engine.prompt_checks import bad_word_ids

    words = ["Paris", "capital of"]
    ids = bad_word_ids(words, lambda s: tok.encode(s, add_special_tokens=False))
    want = hf_greedy(
        bundled_model_dir, [chat_ids], [24], [{"logits_processor": [BanWords(ids, len(chat_ids))]}]
    )[0]
    assert want != chat_expected
    r = stack.client().chat.completions.create(
        model=stack.model, messages=CHAT, max_tokens=24, temperature=0, extra_body={"bad_words": words}
    )
    assert r.choices[0].message.content == tok.decode(want)
    assert r.usage.completion_tokens == len(want)
    blank = stack.post("/v1/completions", {"model": stack.model, "prompt": "Hi", "bad_words": [" "]})
    assert blank.status_code == 400 and "bad_words must be non-blank" in blank.json()["error"]["message"]


def test_structured_output_matches_transformers_held_to_the_pattern(stack, tok, bundled_model_dir, chat_ids):
    """response_format json_schema (chat), guided_choice and structured_outputs' regex (completions), through a
    prefill worker (the first token) and a decode worker (the rest): transformers' greedy answer under the same
    pattern; two ways at once and a grammar are 400s."""
    import json

    from engine.structured_output import GuideFactory, StructuredOutputsParams

    factory = GuideFactory(tok, tok.vocab_size)
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
    }
    want = hf_greedy(
        bundled_model_dir, [chat_ids] * 2, [32, 8],
        [{"logits_processor": [GuideMask(factory.guide(StructuredOutputsParams(json=schema)), len(chat_ids))]},
         {"logits_processor": [GuideMask(factory.guide(StructuredOutputsParams(choice=["Paris", "Lyon"])), len(chat_ids))]}],
    )  # fmt: skip
    client = stack.client()
    r = client.chat.completions.create(
        model=stack.model, messages=CHAT, max_tokens=32, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}},
    )  # fmt: skip
    assert r.choices[0].message.content == tok.decode(want[0]) and "city" in json.loads(
        r.choices[0].message.content
    )
    c = client.completions.create(
        model=stack.model,
        prompt=chat_ids,
        max_tokens=8,
        temperature=0,
        extra_body={"guided_choice": ["Paris", "Lyon"]},
    )
    assert c.choices[0].text == tok.decode(want[1]) and c.choices[0].text in ("Paris", "Lyon")
    phone = client.completions.create(
        model=stack.model, prompt="Call me at", max_tokens=12, temperature=0.8, seed=3, n=2,
        extra_body={"structured_outputs": {"regex": "[0-9]{3}-[0-9]{4}"}},
    )  # fmt: skip
    assert all(re.fullmatch("[0-9]{3}-[0-9]{4}", ch.text) for ch in phone.choices)
    for extra, words in [
        ({"guided_regex": "a+", "guided_choice": ["a"]}, "asked for more than once"),
        ({"guided_grammar": "root ::= 'a'"}, "grammar (EBNF) is not supported"),
        ({"response_format": {"type": "json_schema"}}, "json_schema.schema"),
    ]:
        r = stack.post("/v1/completions", {"model": stack.model, "prompt": "Hi", "max_tokens": 2, **extra})
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


def test_stop_tokens_and_special_tokens_show_as_vllm_shows_them(stack, tok, chat_expected):
    """EOS ends the answer without text of its own; include_stop_str_in_output with skip_special_tokens false
    shows it; a stop token id's text is left out too."""
    client = stack.client()
    body = dict(model=stack.model, messages=CHAT, max_tokens=24, temperature=0)
    eos_text = tok.decode([chat_expected[-1]], skip_special_tokens=False)
    assert chat_expected[-1] in tok.eos_token_ids and eos_text
    shown = client.chat.completions.create(
        **body, extra_body={"skip_special_tokens": False, "include_stop_str_in_output": True}
    )
    assert shown.choices[0].message.content == tok.decode(chat_expected[:-1]) + eos_text
    hidden = client.chat.completions.create(**body, extra_body={"skip_special_tokens": False})
    assert hidden.choices[0].message.content == tok.decode(chat_expected[:-1])
    stop = chat_expected[2]
    cut = client.chat.completions.create(**body, extra_body={"stop_token_ids": [stop]})
    assert cut.choices[0].message.content == tok.decode(chat_expected[:2])
    assert cut.choices[0].finish_reason == "stop" and cut.usage.completion_tokens == 3


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        # tools without tool_choice are "auto", which needs the gateway's --enable-auto-tool-choice
        ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
        ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
        ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages",
        ),
        ("/v1/chat/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/completions", {"suffix": "end"}, "suffix"),
        ("/v1/completions", {"best_of": 3}, "best_of"),
        ("/v1/completions", {"logit_bias": {"x": 1}}, "logit_bias"),
        ("/v1/completions", {"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
        (
            "/v1/completions",
            {"use_beam_search": True, "stop": ["x"]},
            "stop",
        ),  # what beam search would ignore
        ("/v1/chat/completions", {"spaces_between_special_tokens": False}, "spaces_between_special_tokens"),
        ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
        ("/v1/chat/completions", {"echo": True}, "echo"),
    ],
)
def test_what_the_server_does_not_do_is_refused_by_name(stack, path, extra, param):
    """Never a success that ignored a field the client counts on."""
    body = {
        "model": stack.model,
        "max_tokens": 2,
        **({"messages": CHAT} if "chat" in path else {"prompt": "Hi"}),
    }
    body.update(extra)
    r = stack.post(path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and param in error["message"]
    # a field that needs another (OpenAI's own refusals) or a bad value is invalid, the rest unsupported
    invalid = param in ("top_logprobs", "stream_options", "logit_bias", "tool_choice")
    assert error["code"] == ("invalid_request" if invalid else "unsupported"), error


def test_tools_a_template_leaves_out_do_not_count_against_the_context(stack):
    """The bundled model's template renders no tools: tools that would overflow the context, were they
    rendered, do not get a request refused (tool_choice "none": this gateway has no tool-call parser)."""
    tools = [{"type": "function", "function": {"name": "f", "description": "x" * 40_000}}]
    body = {"model": stack.model, "messages": CHAT, "max_tokens": 2, "tools": tools, "tool_choice": "none"}
    r = stack.post("/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] < 100


def test_continuous_usage_stats_count_each_choices_tokens_so_far(stack, chat_ids, chat_expected):
    """vLLM's continuous usage stats: every chunk carries the prompt's count and its own choice's tokens so
    far (n = 2, choices interleaved), the last of each choice its whole count; without include_usage: a 400."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = stack.client().chat.completions.create(
        model=stack.model,
        messages=CHAT,
        max_tokens=24,
        temperature=0,
        n=2,
        stream=True,
        stream_options=options,
    )
    counts: dict[int, list[int]] = {0: [], 1: []}
    final = None
    for chunk in chunks:
        assert chunk.usage is not None and chunk.usage.prompt_tokens == len(chat_ids)
        if not chunk.choices:
            final = chunk.usage
            continue
        assert chunk.usage.total_tokens == chunk.usage.prompt_tokens + chunk.usage.completion_tokens
        counts[chunk.choices[0].index].append(chunk.usage.completion_tokens)
    for seen in counts.values():
        assert seen == sorted(seen) and seen[-1] == len(chat_expected)
    assert final is not None and final.completion_tokens == 2 * len(chat_expected)
    body = {"model": stack.model, "prompt": "Hi", "max_tokens": 2, "stream": True}
    r = stack.post("/v1/completions", {**body, "stream_options": {"continuous_usage_stats": True}})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "stream_options" and "include_usage" in error["message"]


def test_bad_logit_bias_and_min_tokens_get_400(stack):
    client = stack.client()
    for extra, words in [
        ({"logit_bias": {"99999999": 1}}, "out of the vocabulary"),
        ({"logit_bias": {"5": 101}}, "logit_bias values"),
        ({"logit_bias": {str(t): 1 for t in range(301)}}, "at most 300"),
        ({"extra_body": {"min_tokens": 9}}, "min_tokens must be at most max_tokens"),
        (
            {"extra_body": {"allowed_token_ids": [5, 60000]}},
            "allowed_token_ids token ids out of the vocabulary",
        ),
        ({"extra_body": {"allowed_token_ids": []}}, "allowed_token_ids"),
    ]:
        with pytest.raises(openai.BadRequestError, match=words):
            client.completions.create(model=stack.model, prompt="Hi", max_tokens=3, **extra)
    r = client.chat.completions.create(
        model=stack.model, messages=CHAT, max_tokens=2, tools=[], tool_choice="none",
        response_format={"type": "text"}, modalities=["text"], store=False,
        extra_body={"spaces_between_special_tokens": True, "use_beam_search": False, "guided_json": None},
    )  # defaults and what does not change the answer are taken  # fmt: skip
    assert r.choices[0].finish_reason in ("stop", "length")


def test_64_concurrent_streams_complete(stack):
    async def one(client, i):
        stream = await client.completions.create(
            model=stack.model, prompt=f"Count to {i}:", max_tokens=4, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        finish = None
        async for chunk in stream:
            finish = chunk.choices[0].finish_reason or finish if chunk.choices else finish
        return finish

    async def run():
        client = stack.aclient()
        return await asyncio.gather(*(one(client, i) for i in range(64)))

    assert asyncio.run(run()) == ["length"] * 64
    stack.cluster.wait_all_blocks_free()


def test_disconnect_mid_stream_frees_blocks(stack):
    body = {"model": stack.model, "prompt": "Tell a long story.", "max_tokens": 900, "stream": True}
    body.update(ignore_eos=True, temperature=0)
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", stack.url + "/v1/completions", json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200
        events = 0
        for line in r.iter_lines():
            events += line.startswith("data:")
            if events == 3:
                break
        deadline = time.monotonic() + 5.0  # still generating (as soon as a 0.1 s load report says so)
        while not any(load.num_running for load in stack.cluster.loads()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert any(load.num_running for load in stack.cluster.loads())
    # the connection is closed here
    stack.cluster.wait_all_blocks_free(timeout=15)  # 900 tokens would take far longer on 2 cores


def test_error_statuses(stack):
    client = stack.client()
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=stack.model, prompt=[1] * 1100, max_tokens=1)
    assert "1100" in err.value.message and "1024" in err.value.message
    assert err.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=stack.model, messages=CHAT, max_completion_tokens=1024)
    assert "maximum context length is 1024" in err.value.message
    assert err.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=CHAT)
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        client.completions.create(model=stack.model, prompt="hi", presence_penalty=5)
    with pytest.raises(openai.AuthenticationError):
        stack.client(key="wrong").models.list()
    r = stack.post("/v1/chat/completions", {"model": stack.model, "messages": "nope"})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert stack.post("/v1/completions", {"model": stack.model, "prompt": "hi"}, key=None).status_code == 401


def test_big_bodies_are_refused_at_once_while_others_are_served(small_gateway):
    gw = small_gateway
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}

    async def run():
        async with httpx.AsyncClient(headers=headers, timeout=120) as client:

            async def big(size: int) -> tuple[int, str, float]:
                body = b'{"model": "%s", "prompt": "' % gw.model.encode() + b"go " * (size // 3) + b'"}'
                start = time.monotonic()
                r = await client.post(gw.url + "/v1/completions", content=body)
                return r.status_code, r.json()["error"]["code"], time.monotonic() - start

            async def normal() -> int:
                body = {"model": gw.model, "prompt": "Hello", "max_tokens": 2}
                return (await client.post(gw.url + "/v1/completions", json=body)).status_code

            ok = asyncio.create_task(normal())
            refused = await asyncio.gather(*(big(2 * 1024 * 1024) for _ in range(10)), big(20 * 1024 * 1024))
            return refused, await ok

    refused, ok = asyncio.run(run())
    assert ok == 200
    assert [(status, code) for status, code, _ in refused] == [(413, "request_too_large")] * 11
    assert max(took for _, _, took in refused) < 1.0, refused


def test_health_models_metrics(stack):
    assert httpx.get(stack.url + "/health").status_code == 200
    assert [m.id for m in stack.client().models.list()] == [stack.model]
    stack.client().completions.create(model=stack.model, prompt="Hi", max_tokens=1)
    assert stack.post("/v1/chat/completions", {"model": "nope", "messages": CHAT}).status_code == 404
    assert (
        stack.post("/v1/chat/completions", {"model": stack.model, "messages": CHAT}, key="x").status_code
        == 401
    )
    text = httpx.get(stack.url + "/metrics").text
    assert 'pdserve:gateway_requests_total{endpoint="completions",status="200"}' in text
    assert 'status="404"' in text and 'status="401"' in text
    for name in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "prompt_tokens",
        "generation_tokens",
    ):
        assert f"pdserve:{name}" in text


# ---- fuzzing: malformed and odd bodies never get a 5xx, and nothing dies ---------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_json_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(-3, 3), st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12), st.sampled_from(["", "SmolLM2-135M-Instruct", "user", "text", "\x00", "\ud7ff"]),
)  # fmt: skip
_json = st.recursive(
    _json_leaf, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
    max_leaves=6,
)  # fmt: skip


def _mostly(valid):
    """Well-formed six times out of seven, any JSON value otherwise."""
    return st.integers(0, 6).flatmap(lambda i: valid if i else _json)


_message = st.fixed_dictionaries(
    {"role": _mostly(st.sampled_from(["user", "system", "assistant", "tool", "robot"]))},
    optional={"content": _mostly(st.text(max_size=20)), "name": _mostly(st.text(max_size=5))},
)
_FIELDS = {
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "n": st.integers(1, 3),
    "stop": st.lists(st.text(max_size=3), max_size=3), "seed": st.integers(0, 2**40),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2), "top_k": st.integers(-1, 50), "min_p": st.floats(0, 1),
    "ignore_eos": st.booleans(), "user": st.text(max_size=5), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "logprobs": st.integers(0, 5) | st.booleans(), "top_logprobs": st.integers(0, 5),
    "stop_token_ids": st.lists(st.integers(0, 49151), max_size=3),
    "logit_bias": st.dictionaries(st.integers(-3, 60000).map(str) | st.text(max_size=3), st.floats(-120, 120),
                                  max_size=3),
    "min_tokens": st.integers(0, 5), "allowed_token_ids": st.lists(st.integers(-2, 60000), max_size=3),
}  # fmt: skip
_common = st.fixed_dictionaries(
    {"model": _mostly(st.just("SmolLM2-135M-Instruct"))},
    optional={**{k: _mostly(v) for k, v in _FIELDS.items()}, "max_tokens": _mostly(st.integers(1, 3))},
)
_chat = st.tuples(_common, _mostly(st.lists(_message, max_size=3))).map(lambda t: {**t[0], "messages": t[1]})
_prompt = _mostly(
    st.one_of(
        st.text(max_size=30), st.lists(st.text(max_size=10), max_size=3),
        st.lists(st.integers(-5, 60000), max_size=8),
        st.lists(st.lists(st.integers(-5, 60000), max_size=4), max_size=3),
    )
)  # fmt: skip
_completion = st.tuples(_common, _prompt).map(lambda t: {**t[0], "prompt": t[1]})


def _number(value) -> float | None:
    if isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError, OverflowError):
        return None


def _cheap(body):
    """Keep well-formed requests short: at most 3 tokens and 3 completions each."""
    for name in ("n", "max_tokens", "max_completion_tokens"):
        value = _number(body.get(name))
        if (value is not None and value > 3) or (name == "max_tokens" and body.get(name) is None):
            body[name] = 3
    return body


@settings(
    max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None
)
@given(
    st.one_of(
        st.tuples(st.just("/v1/chat/completions"), _chat.map(_cheap)),
        st.tuples(st.just("/v1/completions"), _completion.map(_cheap)),
        st.tuples(
            st.sampled_from(["/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"]), _json
        ),
    )
)
def _fuzz_json(stack, statuses, case):
    path, body = case
    r = stack.post(path, body)
    statuses.append(r.status_code)
    assert r.status_code < 500, (body, r.status_code, r.text)
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


@settings(
    max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None
)
@given(
    st.binary(max_size=64)
    | st.text(max_size=64).map(str.encode)
    | st.sampled_from([b'{"model": NaN}', b"[]", b"null"])
)
def _fuzz_bytes(stack, raw):
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    r = httpx.post(stack.url + "/v1/chat/completions", content=raw, headers=headers, timeout=60)
    assert r.status_code < 500, (raw, r.text)


def from_openapi(schema: dict, components: dict, depth: int = 0) -> st.SearchStrategy:
    """Bodies drawn from the app's own OpenAPI request schema: every field it declares, in its declared types
    and bounds (optional fields present or not), so the fuzzing follows the API as it is written."""
    if "$ref" in schema:
        return from_openapi(components[schema["$ref"].rsplit("/", 1)[1]], components, depth)
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return st.one_of([from_openapi(s, components, depth) for s in schema[key]])
    if "enum" in schema or "const" in schema:
        return st.sampled_from(schema.get("enum") or [schema["const"]])
    kind = schema.get("type")
    if kind == "object" and depth < 4:
        props = schema.get("properties", {})
        required = set(schema.get("required", []))
        sub = {k: from_openapi(v, components, depth + 1) for k, v in props.items()}
        return st.fixed_dictionaries(
            {k: sub[k] for k in required}, optional={k: v for k, v in sub.items() if k not in required}
        )
    if kind == "array":
        return st.lists(from_openapi(schema.get("items", {}), components, depth + 1), max_size=3)
    if kind == "integer":
        return st.integers(schema.get("minimum", -(2**40)), schema.get("maximum", 2**40))
    if kind == "number":
        return st.floats(schema.get("minimum"), schema.get("maximum"), allow_nan=False, allow_infinity=False)
    simple = {"string": st.text(max_size=20), "boolean": st.booleans(), "null": st.none()}
    return simple.get(str(kind), _json_leaf)


def _fuzz_schema(stack, statuses):
    spec = httpx.get(stack.url + "/openapi.json").json()
    components = spec["components"]["schemas"]

    def bodies(path: str) -> st.SearchStrategy:
        schema = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        served = st.tuples(from_openapi(schema, components), st.integers(0, 5)).map(
            lambda t: {**t[0], "model": "SmolLM2-135M-Instruct"} if t[1] else t[0]
        )  # mostly the served model, so that schema-shaped bodies also run, not only get 404
        return st.tuples(st.just(path), served.map(_cheap))

    @settings(
        max_examples=100,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
        database=None,
    )
    @given(
        bodies("/v1/chat/completions")
        | bodies("/v1/completions")
        | bodies("/tokenize")
        | bodies("/detokenize")
        | bodies("/v1/embeddings")
        | bodies("/score")
        | bodies("/v1/rerank")
    )
    def run(case):
        path, body = case
        r = stack.post(path, body)
        statuses.append(r.status_code)
        assert r.status_code < 500, (body, r.status_code, r.text)
        if r.status_code >= 400:
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}

    run()


_BRACKETS = st.sampled_from(["[", '{"a": '])


@st.composite
def _abusive(draw) -> tuple[bytes, int]:
    """A body over the small gateway's limit (413), or one nesting deeper than 64 (400), with its status."""
    if draw(st.booleans()):
        filler = draw(st.sampled_from([b"a", b"[", b"\\u00e9", b'{"x": 1}, ']))
        size = draw(st.integers(SMALL_LIMIT + 1, 3 * SMALL_LIMIT))
        return b'{"model": "SmolLM2-135M-Instruct", "prompt": "' + filler * (size // len(filler)) + b'"}', 413
    opens = draw(st.lists(_BRACKETS, min_size=65, max_size=400)) * draw(st.integers(1, 50))
    closes = "".join("]" if o == "[" else "}" for o in reversed(opens)) if draw(st.booleans()) else ""
    inner = "".join(opens) + "1" + closes
    where = draw(
        st.sampled_from(["{}", '{{"model": "SmolLM2-135M-Instruct", "prompt": {}}}', '{{"messages": {}}}'])
    )
    return where.format(inner).encode(), 400


def _fuzz_limits(gw: Stack) -> None:
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}

    @settings(
        max_examples=40,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
        database=None,
    )
    @given(_abusive(), st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
    def run(case, path):
        raw, status = case
        r = httpx.post(gw.url + path, content=raw, headers=headers, timeout=60)
        assert r.status_code == status, (len(raw), raw[:80], r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}

    run()


def test_fuzzing_oversized_and_deep_bodies_never_give_5xx(small_gateway):
    _fuzz_limits(small_gateway)
    assert small_gateway.proc.poll() is None
    r = small_gateway.client().completions.create(model=small_gateway.model, prompt="Hi", max_tokens=2)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_fuzzing_never_gives_5xx_and_nothing_dies(stack):
    assert httpx.get(stack.url + "/openapi.json").status_code == 200
    statuses: list[int] = []
    _fuzz_json(stack, statuses)
    assert 200 in statuses  # some fuzzed requests were well-formed and ran
    _fuzz_bytes(stack)
    schema_statuses: list[int] = []
    _fuzz_schema(stack, schema_statuses)
    assert 200 in schema_statuses  # bodies drawn from the schema do run
    assert stack.proc.poll() is None and stack.cluster.proc.poll() is None
    assert httpx.get(stack.url + "/health").status_code == 200
    stack.cluster.wait_all_blocks_free(timeout=30)


def test_tokenize_and_detokenize_use_the_routers_encoding(stack, tok):
    """vLLM's /tokenize and /detokenize: a prompt's ids are those a completion is charged for, a chat's those of
    its template; /detokenize gives the text back with special tokens; bad input gets a named 4xx."""
    text = "The capital of France is"
    r = stack.post("/tokenize", {"model": stack.model, "prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    got = r.json()
    ids = tok.encode(text)
    assert got["tokens"] == ids and got["count"] == len(ids)
    assert got["token_strs"] == [tok.backend.id_to_token(i) for i in ids]
    models = httpx.get(stack.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert got["max_model_len"] == models["data"][0]["max_model_len"]
    client = stack.client()
    done = client.completions.create(model=stack.model, prompt=text, max_tokens=1, temperature=0)
    assert done.usage.prompt_tokens == got["count"]

    chat = stack.post("/tokenize", {"messages": CHAT}).json()
    want = tok.encode(tok.apply_chat_template(CHAT, add_generation_prompt=True), add_special_tokens=False)
    assert chat["tokens"] == want and chat["token_strs"] is None
    answered = client.chat.completions.create(model=stack.model, messages=CHAT, max_tokens=1, temperature=0)
    assert answered.usage.prompt_tokens == chat["count"]
    bare = stack.post("/tokenize", {"messages": CHAT, "add_generation_prompt": False}).json()
    template = tok.apply_chat_template(CHAT, add_generation_prompt=False)
    assert bare["tokens"] == tok.encode(template, add_special_tokens=False) and bare["count"] < chat["count"]

    back = stack.post("/detokenize", {"model": stack.model, "tokens": want})
    assert back.status_code == 200, back.text
    assert back.json() == {"prompt": tok.decode(want, skip_special_tokens=False)}
    assert tok.eos_token and tok.eos_token in back.json()["prompt"]  # the template's end-of-turn tokens stay

    for path, body, status, code, words in [
        ("/tokenize", {"model": "gpt-4", "prompt": "x"}, 404, "model_not_found", "gpt-4"),
        ("/tokenize", {"prompt": "x", "add_special_tokens": False}, 400, "unsupported", "add_special_tokens"),
        ("/tokenize", {"messages": []}, 400, "invalid_request", "messages"),
        (
            "/tokenize",
            {"messages": CHAT, "tools": [{"type": "function"}]},
            400,
            "invalid_request",
            "tools.0.function",
        ),
        ("/tokenize", {"messages": CHAT, "chat_template": "{{ 1 }}"}, 400, "unsupported", "chat_template"),
        (
            "/tokenize",
            {"messages": CHAT, "continue_final_message": True},
            400,
            "unsupported",
            "continue_final",
        ),
        ("/detokenize", {"tokens": [10**6]}, 400, "invalid_argument", "vocabulary"),
        ("/detokenize", {"tokens": [-1]}, 400, "invalid_request", "tokens"),
        ("/detokenize", {"model": "gpt-4", "tokens": [1]}, 404, "model_not_found", "gpt-4"),
    ]:
        r = stack.post(path, body)
        assert r.status_code == status, (path, body, r.text)
        error = r.json()["error"]
        assert error["code"] == code and words in error["message"], (path, body, error)
    assert stack.post("/tokenize", {"prompt": "x"}, key=None).status_code == 401
    assert stack.post("/detokenize", {"tokens": [1]}, key="wrong").status_code == 401


def test_a_model_is_retrieved_by_name(stack):
    """GET /v1/models/{model} (the client's models.retrieve) gives the served model's card, as the list does;
    another name is a 404 naming it."""
    client = stack.client()
    listed = client.models.list().data
    assert [m.id for m in listed] == [stack.model]
    card = client.models.retrieve(stack.model)
    assert card.id == stack.model and card.object == "model" and card.model_dump() == listed[0].model_dump()
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("org/other-model")
    assert (
        missing.value.body["code"] == "model_not_found" and "org/other-model" in missing.value.body["message"]
    )
    assert stack.post("/v1/models/" + stack.model, None).status_code == 405  # a GET, not a POST


def test_the_version_is_the_installed_distributions(stack):
    """GET /version (vLLM's), open as /health is: the pdserve distribution's version."""
    import importlib.metadata

    r = httpx.get(stack.url + "/version", timeout=10)
    assert r.status_code == 200 and r.json() == {"version": importlib.metadata.version("pdserve")}
