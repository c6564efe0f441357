"""Stop strings and streamed text: cut at the first stop, never show text that is later taken back."""

import pytest

from engine.output_processor import TextStream
from engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tok(bundled_model_dir):
    from engine.tokenizer import Tokenizer

    return Tokenizer.from_dir(bundled_model_dir)


def stream(tok, text, **kw):
    ts = TextStream(tok, [], SamplingParams(**kw))
    ids = tok.encode(text, add_special_tokens=False)
    shown = []
    for i, t in enumerate(ids):
        hit = ts.add(t, last=i == len(ids) - 1)
        shown.append(ts.visible(finished=hit or i == len(ids) - 1))
        if hit:
            break
    return ts, shown


def test_stop_string_cuts_text_before_it(tok):
    ts, _ = stream(tok, "Paris is the capital. Berlin is another.", stop=[". Berlin", "zzz"])
    assert ts.text == "Paris is the capital" and ts.stop == ". Berlin"


def test_stop_string_kept_when_asked(tok):
    ts, _ = stream(tok, "one two three four", stop=["three"], include_stop_str_in_output=True)
    assert ts.text == "one two three"


def test_earliest_stop_wins(tok):
    ts, _ = stream(tok, "alpha beta gamma", stop=["gamma", "beta"])
    assert ts.text == "alpha " and ts.stop == "beta"


def test_streamed_text_only_grows_and_ends_as_the_final_text(tok):
    ts, shown = stream(tok, "The answer is 42. Done here.", stop=["Done"])
    for a, b in zip(shown, shown[1:]):
        assert b.startswith(a)
    assert shown[-1] == ts.text == "The answer is 42. "


def test_without_stop_strings_text_is_the_decode(tok):
    text = "Héllo wörld — naïve café ☕ 123"
    ts, _ = stream(tok, text)
    assert ts.text == text and ts.stop is None


def test_stop_strings_wait_for_min_tokens(tok):
    """As vLLM: a stop string counts only in the text of tokens past the first min_tokens."""
    text = "one stop two stop three stop four"
    ids = tok.encode(text, add_special_tokens=False)
    first = next(i for i in range(len(ids)) if "stop" in tok.decode(ids[: i + 1])) + 1  # tokens to the first
    ts, _ = stream(tok, text, stop=["stop"], min_tokens=first, max_tokens=len(ids))
    assert ts.text == "one stop two " and ts.stop == "stop"
    ts, _ = stream(tok, text, stop=["stop"], min_tokens=len(ids), max_tokens=len(ids))
    assert ts.text == text and ts.stop is None
    ts, _ = stream(tok, text, stop=["stop"], max_tokens=len(ids))
    assert ts.text == "one " and ts.stop == "stop"


def test_a_stop_token_leaves_its_text_out_unless_asked(tok):
    """As vLLM: the token that stops the completion (a stop token id, or EOS unless ignored) adds no text,
    except with include_stop_str_in_output (and EOS's only with skip_special_tokens false)."""
    ids = tok.encode("Paris is lovely", add_special_tokens=False)
    (dot,) = tok.encode(".", add_special_tokens=False)
    assert dot not in ids
    eos = min(tok.eos_token_ids)

    def text(last: int, **kw) -> str:
        ts = TextStream(tok, [], SamplingParams(**kw))
        for i, t in enumerate([*ids, last]):
            ts.add(t, last=i == len(ids))
        return ts.text

    assert text(dot, stop_token_ids=[dot]) == "Paris is lovely"
    assert text(dot, stop_token_ids=[dot], include_stop_str_in_output=True) == "Paris is lovely."
    assert text(dot) == "Paris is lovely."  # not a stop token
    special = tok.decode([eos], skip_special_tokens=False)
    assert special and text(eos) == "Paris is lovely"
    assert text(eos, skip_special_tokens=False) == "Paris is lovely"
    assert (
        text(eos, skip_special_tokens=False, include_stop_str_in_output=True) == "Paris is lovely" + special
    )
    assert text(eos, skip_special_tokens=False, ignore_eos=True) == "Paris is lovely" + special
