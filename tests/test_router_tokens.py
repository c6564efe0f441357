"""The router's handling of a decode chunk that carries several tokens (a step may emit several): its text is
the text of those tokens, and a stop string inside the chunk keeps only the tokens up to the one that
completed it, with their logprobs."""

import pytest

from engine.output_processor import TextStream
from engine.sampling_params import SamplingParams
from protos import pdserve_pb2 as pb
from router.server import _detokenize


@pytest.fixture(scope="module")
def tok(bundled_model_dir):
    from engine.tokenizer import Tokenizer

    return Tokenizer.from_dir(bundled_model_dir)


def chunks(ids: list[int], size: int, finish: str = "length") -> list[pb.DecodeChunk]:
    out = []
    for at in range(0, len(ids), size):
        part = ids[at : at + size]
        last = at + size >= len(ids)
        out.append(
            pb.DecodeChunk(
                token_ids=part,
                logprobs=[pb.TokenLogprobs(token_id=t, logprob=-0.5) for t in part],
                finish_reason=finish if last else "",
            )
        )
    return out


@pytest.mark.parametrize("size", [1, 3, 7])
def test_chunks_of_several_tokens_read_as_the_same_text(tok, size) -> None:
    ids = tok.encode("The capital of France is Paris, and of Italy, Rome.", add_special_tokens=False)
    text = TextStream(tok, [], SamplingParams())
    kept = [_detokenize(text, c) for c in chunks(ids, size)]
    assert kept == [(False, len(c.token_ids)) for c in chunks(ids, size)]
    assert text.text == tok.decode(ids)


@pytest.mark.parametrize("size", [1, 4, 100])
def test_a_stop_string_inside_a_chunk_keeps_the_tokens_up_to_it(tok, size) -> None:
    ids = tok.encode("one two three four five six", add_special_tokens=False)
    text = TextStream(tok, [], SamplingParams(stop=["three"]))
    seen: list[int] = []
    for c in chunks(ids, size):
        stopped, kept = _detokenize(text, c)
        seen += c.token_ids[:kept]
        if stopped:
            break
    assert stopped and text.text == "one two " and text.stop == "three"
    assert "three" in tok.decode(seen) and "four" not in tok.decode(seen)  # cut right after the stop's token


def test_a_chunk_without_tokens_flushes_the_text(tok) -> None:
    ids = tok.encode("héllo", add_special_tokens=False)
    text = TextStream(tok, [], SamplingParams())
    assert _detokenize(text, pb.DecodeChunk(token_ids=ids)) == (False, len(ids))
    assert _detokenize(text, pb.DecodeChunk(finish_reason="stop")) == (False, 0)
    assert text.text == "héllo"
    assert _detokenize(None, pb.DecodeChunk(token_ids=[1, 2])) == (False, 2)
