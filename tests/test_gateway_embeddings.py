"""OpenAI's /v1/embeddings through the official openai client: `pdserve up` (a prefill and a decode worker, the
bundled model on CPU) behind a gateway. Vectors equal transformers' last-token states, in float and base64, for
strings, token arrays and batches of them; usage counts the prompts; bad requests get OpenAI-shaped 400s and
nothing is left held."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest
import torch

from engine.tokenizer import Tokenizer
from tests.cluster import OpenAIStack, openai_stack
from tests.hf_reference import hf_embedding

pytestmark = pytest.mark.slow

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of France.", "hello"]
ATOL = 2e-5


@pytest.fixture(scope="module")
def stack() -> Iterator[OpenAIStack]:
    with openai_stack() as s:
        yield s


def test_the_official_client_gets_transformers_embeddings(
    stack: OpenAIStack, bundled_model_dir: Path
) -> None:
    tok = Tokenizer.from_dir(bundled_model_dir)
    ids = [tok.encode(t) for t in TEXTS]
    want = [hf_embedding(bundled_model_dir, i) for i in ids]
    got = stack.client.embeddings.create(
        model=stack.model, input=TEXTS
    )  # base64 on the wire: the client's default
    assert [d.index for d in got.data] == [0, 1, 2] and got.model == stack.model
    assert got.usage.prompt_tokens == got.usage.total_tokens == sum(map(len, ids))
    for d, w in zip(got.data, want):
        torch.testing.assert_close(torch.tensor(d.embedding), w, rtol=0, atol=ATOL)
    floats = stack.client.embeddings.create(model=stack.model, input=ids[0], encoding_format="float")
    torch.testing.assert_close(torch.tensor(floats.data[0].embedding), want[0], rtol=0, atol=ATOL)
    raw = stack.post(
        "/v1/embeddings", {"model": stack.model, "input": [ids[1], ids[2]], "encoding_format": "base64"}
    ).json()
    assert raw["object"] == "list" and raw["id"].startswith("embd-")
    second = np.frombuffer(base64.b64decode(raw["data"][1]["embedding"]), dtype="<f4")
    torch.testing.assert_close(torch.from_numpy(second.copy()), want[2], rtol=0, atol=ATOL)
    plain = stack.post("/v1/embeddings", {"model": stack.model, "input": TEXTS[2], "normalize": False}).json()
    torch.testing.assert_close(
        torch.tensor(plain["data"][0]["embedding"]), hf_embedding(bundled_model_dir, ids[2], normalize=False),
        rtol=0, atol=1e-4,
    )  # fmt: skip


def test_chat_messages_embed_the_rendered_conversation(stack: OpenAIStack, bundled_model_dir: Path) -> None:
    """vLLM's chat embeddings: `messages` rendered with the model's chat template (no generation prompt unless
    asked), one embedding of it."""
    tok = Tokenizer.from_dir(bundled_model_dir)
    messages = [
        {"role": "user", "content": "Where is Paris?"},
        {"role": "assistant", "content": "In France."},
    ]
    for prompt in (False, True):
        ids = tok.encode(
            tok.apply_chat_template(messages, add_generation_prompt=prompt), add_special_tokens=False
        )
        body = {"model": stack.model, "messages": messages, "encoding_format": "float"}
        got = stack.post("/v1/embeddings", {**body, "add_generation_prompt": prompt}).json()
        assert got["usage"]["prompt_tokens"] == len(ids) and len(got["data"]) == 1, got
        want = hf_embedding(bundled_model_dir, ids)
        torch.testing.assert_close(torch.tensor(got["data"][0]["embedding"]), want, rtol=0, atol=ATOL)


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ({"input": []}, 400, "input must not be empty"),
        ({"input": ["a", ""]}, 400, "input[1] is empty"),
        ({"input": "hi", "dimensions": 8}, 400, "does not support Matryoshka"),
        ({"input": [[1, 2, 10**6]]}, 400, "out of the vocabulary"),
        ({"input": "hi", "model": "other"}, 404, "does not exist"),
        ({"input": "word " * 2000}, 400, "max_model_len"),
        ({"input": "hi", "encoding_format": "int8"}, 400, "encoding_format"),
        ({}, 400, "give either input or messages"),
        (
            {"input": "hi", "messages": [{"role": "user", "content": "hi"}]},
            400,
            "give either input or messages",
        ),
    ],
)
def test_bad_requests_get_openai_errors(stack: OpenAIStack, body: dict, status: int, words: str) -> None:
    resp = stack.post("/v1/embeddings", {"model": stack.model, **body})
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert words in error["message"] and error["type"] in ("invalid_request_error", "not_found_error"), error


def test_the_client_raises_on_a_refused_request(stack: OpenAIStack) -> None:
    with pytest.raises(openai.BadRequestError, match="does not support Matryoshka"):
        stack.client.embeddings.create(model=stack.model, input="hi", dimensions=8)


def test_score_and_rerank_are_cosine_similarities_of_the_embeddings(
    stack: OpenAIStack, bundled_model_dir: Path
) -> None:
    tok = Tokenizer.from_dir(bundled_model_dir)
    vec = {t: hf_embedding(bundled_model_dir, tok.encode(t)) for t in TEXTS}

    def cos(a: str, b: str) -> float:
        return float(torch.nn.functional.cosine_similarity(vec[a], vec[b], dim=0))

    one_to_many = stack.post("/score", {"model": stack.model, "text_1": TEXTS[0], "text_2": TEXTS[1:]}).json()
    assert [d["index"] for d in one_to_many["data"]] == [0, 1]
    for d, other in zip(one_to_many["data"], TEXTS[1:]):
        assert abs(d["score"] - cos(TEXTS[0], other)) < 1e-4
    pairwise = stack.post(
        "/v1/score", {"model": stack.model, "text_1": TEXTS[:2], "text_2": TEXTS[1:]}
    ).json()
    assert [round(d["score"], 4) for d in pairwise["data"]] == [
        round(cos(TEXTS[0], TEXTS[1]), 4),
        round(cos(TEXTS[1], TEXTS[2]), 4),
    ]
    assert pairwise["usage"]["prompt_tokens"] == sum(len(tok.encode(t)) for t in TEXTS[:2] + TEXTS[1:])
    ranked = stack.post(
        "/v1/rerank", {"model": stack.model, "query": TEXTS[0], "documents": TEXTS, "top_n": 2}
    ).json()
    want = sorted(range(3), key=lambda i: -cos(TEXTS[0], TEXTS[i]))[:2]
    assert [r["index"] for r in ranked["results"]] == want == [0, want[1]]  # the query itself first
    assert ranked["results"][0]["document"] == {"text": TEXTS[0]}
    assert abs(ranked["results"][1]["relevance_score"] - cos(TEXTS[0], TEXTS[want[1]])) < 1e-4
    bad = stack.post("/score", {"model": stack.model, "text_1": TEXTS[:2], "text_2": TEXTS})
    assert bad.status_code == 400 and "give one text_1, or one per text_2" in bad.json()["error"]["message"]
    empty = stack.post("/rerank", {"model": stack.model, "query": "q", "documents": []})
    assert empty.status_code == 400 and "documents must not be empty" in empty.json()["error"]["message"]
