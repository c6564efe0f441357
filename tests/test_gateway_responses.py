"""The gateway's JSON for prompt logprobs and echo, from router messages made here (what a CPU cluster cannot
order at will: a choice whose prompt logprobs come after its own first token)."""

from __future__ import annotations

from gateway.responses import Echo, Formatter, TokenText, prompt_logprobs_json
from protos import pdserve_pb2 as pb

TEXT = TokenText(None)  # tokens read "token_id:N"


def lp(token: int, entries: dict[int, float]) -> pb.TokenLogprobs:
    return pb.TokenLogprobs(
        token_id=token,
        logprob=entries[token],
        top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in entries.items()],
    )


def test_prompt_logprobs_rank_the_top_k_and_the_prompt_token_where_among_them():
    among = lp(7, {7: -0.5, 3: -1.0})  # the prompt token is the likeliest
    outside = lp(9, {9: -4.0, 3: -0.2, 5: -1.5})  # not among the top 2: rank unknown
    got = prompt_logprobs_json([among, outside], 2, TEXT)
    assert got[0] is None
    assert got[1] == {
        "7": {"logprob": -0.5, "rank": 1, "decoded_token": "token_id:7"},
        "3": {"logprob": -1.0, "rank": 2, "decoded_token": "token_id:3"},
    }
    assert list(got[2]) == ["9", "3", "5"]  # vLLM's order: the prompt's token first
    assert [got[2][t]["rank"] for t in ("9", "3", "5")] == [None, 1, 2]
    assert prompt_logprobs_json([outside], 0, TEXT)[1] == {
        "9": {"logprob": -4.0, "rank": None, "decoded_token": "token_id:9"}
    }


def response(index: int, tokens: list[int], finish: str = "", prompt: list[pb.TokenLogprobs] = ()):
    logprobs = [lp(t, {t: -1.0}) for t in tokens]
    return pb.GenerateResponse(
        index=index, token_ids=tokens, text="x" * len(tokens), logprobs=logprobs, finish_reason=finish,
        prompt_logprobs=prompt,
    )  # fmt: skip


def feed(fmt: Formatter, messages: list[pb.GenerateResponse]) -> list[dict]:
    out = []
    for m in messages:
        fmt.saw(0, m)
        out += fmt.stream(m.index, m)
    return out + fmt.flush()


def test_an_echoed_stream_holds_a_choice_back_until_its_prompt_logprobs_come():
    """n = 2: completion 1's first token comes before completion 0's, which brings the prompt's logprobs."""
    echo = Echo(["ab"], [[4, 5]], only=False)
    fmt = Formatter(False, "m", 1, TEXT, n=2, prompt_logprobs=None, echo=echo)
    chunks = feed(
        fmt, [response(1, [8]), response(0, [8], prompt=[lp(5, {5: -0.25})]), response(1, [9], "length")]
    )
    items = [c["choices"][0] for c in chunks]
    assert [i["index"] for i in items] == [1, 0, 1]
    for first in items[:2]:
        assert first["text"] == "abx"
        assert first["logprobs"]["tokens"] == ["token_id:4", "token_id:5", "token_id:8"]
        assert first["logprobs"]["token_logprobs"] == [None, -0.25, -1.0]
        assert first["logprobs"]["top_logprobs"][0] is None
        assert first["logprobs"]["text_offset"] == [0, 10, 20]
    assert items[2]["text"] == "x" and items[2]["logprobs"]["text_offset"] == [3]


def test_echo_with_max_tokens_0_gives_the_prompt_alone():
    echo = Echo(["ab"], [[4, 5]], only=True)
    fmt = Formatter(False, "m", 0, TEXT, prompt_logprobs=0, echo=echo)
    chunks = feed(fmt, [response(0, [8], prompt=[lp(5, {5: -0.25})]), response(0, [], "stop")])
    items = [c["choices"][0] for c in chunks]
    assert [(i["text"], i["finish_reason"]) for i in items] == [("ab", None), ("", "length")]
    assert items[0]["logprobs"]["token_logprobs"] == [None, -0.25]
    assert items[0]["prompt_logprobs"] == [
        None,
        {"5": {"logprob": -0.25, "rank": None, "decoded_token": "token_id:5"}},
    ]
    assert items[1]["stop_reason"] is None and "prompt_logprobs" not in items[1]
