"""logit_bias, min_tokens, allowed_token_ids and bad_words against transformers (fp32, CPU, the bundled SmolLM2):
greedy output with a bias equals generate's with `sequence_bias`, with min_tokens generate's with `min_new_tokens`
(stop token ids counted as EOS there), with allowed_token_ids generate's with a processor that masks the rest,
and with bad_words generate's with a processor that bans vLLM's way, batched beside plain rows. tests/test_gateway.py takes both through the OpenAI
gateway and a prefill and a decode worker."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.prompt_checks import bad_word_ids
from tests.hf_reference import AllowOnly, BanWords, hf_greedy

pytestmark = pytest.mark.slow

QUESTIONS = ["What is the capital of France?", "Reply with one word: yes or no?", "Hi!"]


@pytest.fixture(scope="module")
def tok(bundled_model_dir):
    from engine.tokenizer import Tokenizer

    return Tokenizer.from_dir(bundled_model_dir)


@pytest.fixture(scope="module")
def chats(tok):
    def ids(q: str) -> list[int]:
        text = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        return tok.encode(text, add_special_tokens=False)

    return [ids(q) for q in QUESTIONS]


@pytest.fixture(scope="module")
def plain(bundled_model_dir, chats):
    """Each chat's greedy answer, which ends at EOS within 12 tokens."""
    out = hf_greedy(bundled_model_dir, chats, [24] * len(chats))
    assert all(len(o) <= 12 for o in out), out
    return out


@pytest.fixture(scope="module")
def cases(tok, chats, plain):
    """(prompt, SamplingParams, transformers' GenerationConfig fields) per row: plain, biased, min_tokens over
    EOS, min_tokens over a stop token, and bias with min_tokens."""
    eos = sorted(tok.eos_token_ids)
    first = plain[0][0]
    stop = plain[2][2]  # a token the plain answer reaches early
    allowed = sorted(set(plain[0]) - {plain[0][1]})
    rows = [
        (chats[0], SamplingParams(temperature=0, max_tokens=24), {}),
        (
            chats[0],
            SamplingParams(temperature=0, max_tokens=24, logit_bias={first: -100.0, plain[2][0]: 4.0}),
            {"sequence_bias": {(first,): -100.0, (plain[2][0],): 4.0}},
        ),
        (chats[1], SamplingParams(temperature=0, max_tokens=24, min_tokens=20), {"min_new_tokens": 20}),
        (
            chats[2],
            SamplingParams(temperature=0, max_tokens=12, min_tokens=6, stop_token_ids=[stop]),
            {"min_new_tokens": 6, "eos_token_id": [*eos, stop]},
        ),
        (
            chats[2],
            SamplingParams(temperature=0, max_tokens=20, min_tokens=18, logit_bias={plain[2][1]: -7.5}),
            {"min_new_tokens": 18, "sequence_bias": {(plain[2][1],): -7.5}},
        ),
        (  # the first answer's tokens but its second, and EOS
            chats[0],
            SamplingParams(temperature=0, max_tokens=12, allowed_token_ids=[*allowed, *eos]),
            {"logits_processor": [AllowOnly([*allowed, *eos])]},
        ),
    ]
    # bad_words: a one-token word the answer holds (as it stands and after a space), and a two-token word whose
    # last token is banned only after its first
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    for words in (["Paris"], ["capital of", "of France"]):
        ids = bad_word_ids(words, enc)
        rows.append(
            (
                chats[0],
                SamplingParams(temperature=0, max_tokens=16, bad_words=words),
                {"logits_processor": [BanWords(ids, len(chats[0]))]},
            )
        )
    return rows


@pytest.fixture(scope="module")
def expected(bundled_model_dir, cases, plain):
    want = hf_greedy(
        bundled_model_dir, [c[0] for c in cases], [c[1].max_tokens for c in cases], [c[2] for c in cases]
    )
    assert want[0] == plain[0]
    assert want[1] != plain[0] and want[1][0] != plain[0][0]  # the bias moved the answer
    assert len(want[2]) >= 20 > len(plain[1])  # EOS held back for 20 tokens
    assert len(want[3]) > 3 and plain[2][2] not in want[3][:6]  # the stop token held back for 6 tokens
    assert len(want[4]) >= 18
    assert want[5] != plain[0] and set(want[5]) <= set(cases[5][1].allowed_token_ids)  # the mask bit
    for row in (6, 7):  # each row's words moved the answer, and none of their sequences is in it
        words = cases[row][2]["logits_processor"][0].words
        assert want[row] != plain[0] and len(words) >= 2
        assert not any(list(w) == want[row][i : i + len(w)] for w in words for i in range(len(want[row])))
    return want


def test_offline_engine_matches_transformers(cases, expected):
    llm = LLM(dtype="float32", device="cpu", cpu_kv_cache_space=0.1, max_model_len=512)
    outs = llm.generate([{"prompt_token_ids": c[0]} for c in cases], [c[1] for c in cases])
    assert [o.outputs[0].token_ids for o in outs] == expected
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
