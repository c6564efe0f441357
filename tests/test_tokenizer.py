"""Tokenizer, chat template and incremental detokenization, against transformers where it has an answer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.tokenizer import IncrementalDetokenizer, Tokenizer
from tests.hf_reference import write_tiny_tokenizer

TEXTS = [
    "Hello, world! 123",
    "  two leading spaces\n\nthen 3.14159 and tabs\tand trailing  ",
    "Unicode: café, naïve, 日本語のテキスト, emoji 😀👍🏽, math ∑∫√",
    "def f(x):\n    return x ** 2  # comment\n",
    "<|im_start|>user\nhi<|im_end|>",
    "",
]


@pytest.fixture(scope="module")
def tok(bundled_model_dir) -> Tokenizer:
    return Tokenizer.from_dir(bundled_model_dir)


@pytest.fixture(scope="module")
def hf_tok(bundled_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(bundled_model_dir)


def test_special_ids(tok):
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == 1 and tok.eos_token_ids == {2}
    assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|im_end|>")


def test_hello_world_tokens(tok):
    ids = tok.encode("Hello, world! 123")
    assert [tok.decode([i]) for i in ids] == [
        "Hello",
        ",",
        " world",
        "!",
        " ",
        "1",
        "2",
        "3",
    ]  # digits split alone
    assert ids == [19556, 28, 905, 17, 216, 33, 34, 35]


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_and_transformers_agree(tok, hf_tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert ids == hf_tok(text).input_ids
    assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)


def test_special_tokens_stay_whole_and_are_skipped(tok):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids) == "user\nhi"


def test_chat_template(tok, hf_tok):
    messages = [{"role": "user", "content": "What is 2+2?"}]
    prompt = tok.apply_chat_template(messages)
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert prompt == hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    with_system = [{"role": "system", "content": "Be brief."}, *messages]
    no_prompt = tok.apply_chat_template(with_system, add_generation_prompt=False)
    assert no_prompt == hf_tok.apply_chat_template(with_system, tokenize=False, add_generation_prompt=False)
    ids = tok.encode(prompt, add_special_tokens=False)
    assert ids[:2] == [1, 9690] and ids.count(1) == 3 and ids.count(2) == 2


# ---- incremental detokenization ------------------------------------------------------------------


def stream(tok: Tokenizer, prompt: list[int], output: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.add(t) for t in output]
    return [*deltas, detok.flush()]


@pytest.mark.parametrize("text", TEXTS[:4] + ["日本語 😀 ok", "🙂🙂🙂"])
def test_incremental_deltas_concatenate_to_decode(tok, text):
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Say something."}]), False)
    output = tok.encode(text, add_special_tokens=False) + [2]
    deltas = stream(tok, prompt, output)
    assert "".join(deltas) == tok.decode(output) == text
    assert not any("\ufffd" in d for d in deltas)


def test_incremental_holds_back_split_characters(tok):
    output = tok.encode("😀", add_special_tokens=False)
    assert len(output) > 1 and "\ufffd" in tok.decode(output[:1])  # the emoji's bytes span tokens
    deltas = stream(tok, [], output)
    assert deltas[:-2] == [""] * (len(output) - 1) and deltas[-2:] == ["😀", ""]


def test_incremental_flush_returns_an_unfinished_tail(tok):
    output = tok.encode("ok 😀", add_special_tokens=False)[:-1]  # cut inside the emoji
    deltas = stream(tok, [], output)
    assert "".join(deltas) == tok.decode(output) and deltas[-1].endswith("\ufffd")


# ---- tokenizer directories -----------------------------------------------------------------------


def tiny_tokenizer_dir(tmp_path: Path, **config_changes) -> Path:
    write_tiny_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, **config_changes}))
    return tmp_path


def test_eos_ids_merge_generation_config(tmp_path):
    model_dir = tiny_tokenizer_dir(tmp_path)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [297, 299]}))
    tok = Tokenizer.from_dir(model_dir)
    assert tok.eos_token_ids == {297, 299} and tok.bos_token_id == 298 and tok.vocab_size == 300


def test_add_bos_token(tmp_path):
    tok = Tokenizer.from_dir(tiny_tokenizer_dir(tmp_path, add_bos_token=True))
    assert tok.encode("the")[0] == 298
    assert tok.encode("the", add_special_tokens=False)[0] != 298


def test_template_features(tmp_path):
    template = (
        "{{ bos_token }}{% for m in messages %}\n"
        "  {% if m['role'] == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}\n"
        "  [{{ m['role'] }}] {{ m['content'] | tojson }}\n"
        "{% endfor %}{{ eos_token if not add_generation_prompt else '' }}"
    )
    tok = Tokenizer.from_dir(tiny_tokenizer_dir(tmp_path, chat_template=template))
    # trim_blocks drops the newline after a block tag; lstrip_blocks the indentation before one
    out = tok.apply_chat_template([{"role": "user", "content": "héllo"}], add_generation_prompt=False)
    assert out == '<|im_start|>  [user] "héllo"\n<|im_end|>'
    with pytest.raises(ValueError, match="chat template error: no tools here"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_template_from_jinja_file_and_missing_template(tmp_path):
    model_dir = tiny_tokenizer_dir(tmp_path, chat_template=None)
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer.from_dir(model_dir).apply_chat_template([{"role": "user", "content": "hi"}])
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    (model_dir / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    assert Tokenizer.from_dir(model_dir).apply_chat_template([{"role": "user", "content": "hi"}]) == "hi!"


def test_missing_or_broken_tokenizer(tmp_path):
    with pytest.raises(ValueError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json: cannot load tokenizer"):
        Tokenizer.from_dir(tmp_path)


def test_tiny_tokenizer_loads_in_transformers(tmp_path):
    from transformers import AutoTokenizer

    model_dir = tiny_tokenizer_dir(tmp_path)
    ours, hf = Tokenizer.from_dir(model_dir), AutoTokenizer.from_pretrained(model_dir)
    text = "hello the world, and that is it"
    assert ours.encode(text) == hf(text).input_ids and ours.decode(ours.encode(text)) == text
