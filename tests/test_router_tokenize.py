"""router/admission.py's tokenize and detokenize (the Router's Tokenize and Detokenize calls) alone: each prompt
kind, a model without a tokenizer, a full tokenizing pool, and the refusals; the gateway's /tokenize is tested
end to end in tests/test_gateway.py."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from engine.tokenizer import Tokenizer
from protos import pdserve_pb2 as pb
from router.admission import detokenize, tokenize
from router.errors import Stop
from router.prompts import PromptEncoder

NAME = "m"


@pytest.fixture(scope="module")
def tok(bundled_model_dir) -> Tokenizer:
    return Tokenizer.from_dir(bundled_model_dir)


@pytest.fixture
def encoder(tok):
    enc = PromptEncoder(tok, threads=1, max_pending=1)
    yield enc
    enc.close()


def info(tok: Tokenizer) -> pb.ModelInfo:
    return pb.ModelInfo(model=NAME, max_model_len=64, vocab_size=tok.vocab_size, block_size=16)


async def ask(
    tok: Tokenizer, encoder: PromptEncoder | None, strs: bool = True, **prompt
) -> pb.TokenizeResponse:
    request = pb.TokenizeRequest(prompt=pb.GenerateRequest(**prompt), return_token_strs=strs)
    return await tokenize(request, info(tok), NAME, encoder)


def refused(call, code: grpc.StatusCode, words: str) -> None:
    with pytest.raises(Stop) as stop:
        asyncio.run(call)
    assert stop.value.code == code and words in stop.value.details, stop.value.details


def test_each_prompt_kind_is_encoded_as_generate_encodes_it(tok, encoder) -> None:
    long = "word " * 200  # past max_model_len: counted, not refused
    text = asyncio.run(ask(tok, encoder, text=long, model=NAME))
    assert list(text.token_ids) == tok.encode(long) and len(text.token_ids) > 64
    assert list(text.token_strs) == [tok.backend.id_to_token(i) for i in text.token_ids]
    assert text.max_model_len == 64
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")], add_generation_prompt=True)
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    got = asyncio.run(ask(tok, encoder, strs=False, chat=chat))
    assert list(got.token_ids) == tok.encode(rendered, add_special_tokens=False) and not got.token_strs
    given = asyncio.run(ask(tok, None, strs=False, token_ids=pb.TokenIds(ids=[5, 6, 7])))
    assert list(given.token_ids) == [5, 6, 7]  # given ids need no tokenizer


def test_refusals_name_their_cause(tok, encoder) -> None:
    bad = grpc.StatusCode.INVALID_ARGUMENT
    refused(ask(tok, encoder, text="x", model="other"), bad, "unknown model 'other'")
    refused(ask(tok, encoder), bad, "no prompt")
    refused(ask(tok, None, text="x"), bad, "no tokenizer")
    refused(ask(tok, None, token_ids=pb.TokenIds(ids=[5])), bad, "token strings need a tokenizer")
    refused(ask(tok, encoder, token_ids=pb.TokenIds(ids=[tok.vocab_size])), bad, "out of the vocabulary")
    refused(detokenize(pb.DetokenizeRequest(token_ids=[-1]), info(tok), NAME, encoder), bad, "[-1]")
    refused(detokenize(pb.DetokenizeRequest(token_ids=[1]), info(tok), NAME, None), bad, "no tokenizer")
    other = pb.DetokenizeRequest(model="other", token_ids=[1])
    refused(detokenize(other, info(tok), NAME, encoder), bad, "unknown model")
    ids = [*tok.encode("Hello world"), *tok.eos_token_ids]
    back = asyncio.run(detokenize(pb.DetokenizeRequest(model=NAME, token_ids=ids), info(tok), NAME, encoder))
    assert back.text == tok.decode(ids, skip_special_tokens=False) and tok.eos_token in back.text


def test_a_full_tokenizing_pool_is_resource_exhausted(tok, encoder) -> None:
    gate = threading.Event()
    real = encoder._encode
    encoder._encode = lambda request: (gate.wait(30), real(request))[1]  # type: ignore[method-assign]

    async def main() -> None:
        first = asyncio.ensure_future(ask(tok, encoder, text="one"))
        await asyncio.sleep(0)
        # max_pending 1: nothing else waits, detokenizing and token strings included (the same pool: a huge list
        # of ids cannot hold the router's event loop either)
        for call in (
            ask(tok, encoder, text="two"),
            ask(tok, encoder, token_ids=pb.TokenIds(ids=[5, 6])),
            detokenize(pb.DetokenizeRequest(token_ids=[5, 6]), info(tok), NAME, encoder),
        ):
            with pytest.raises(Stop) as stop:
                await call
            assert (
                stop.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "overloaded" in stop.value.details
            )
        gate.set()
        assert list((await first).token_ids) == tok.encode("one")

    asyncio.run(main())
