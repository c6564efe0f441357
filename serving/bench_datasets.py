"""`pdserve bench`'s datasets, as vLLM's `bench serve` builds them: `random` (token ids drawn from the
vocabulary, an optional shared prefix), `prefix-repetition` (a few shared prefixes, each with many random
suffixes, for prefix-aware routing) and a ShareGPT-format JSON file."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from engine.tokenizer import Tokenizer


@dataclass(frozen=True)
class SampleRequest:
    prompt: str
    prompt_len: int  # tokens, by the client's tokenizer
    expected_output_len: int


def _lengths(rng: np.random.Generator, mean: int, ratio: float, n: int, low_min: int) -> np.ndarray:
    low = max(low_min, math.floor(mean * (1 - ratio)))
    high = max(low, math.ceil(mean * (1 + ratio)))
    return rng.integers(low, high + 1, size=n)


class _TokenSource:
    """Random token ids drawn from the ordinary vocabulary (special tokens left out), and prompts whose
    text re-encodes to a given number of tokens."""

    def __init__(self, tokenizer: Tokenizer, rng: np.random.Generator) -> None:
        self.tokenizer = tokenizer
        self.rng = rng
        special = set(tokenizer.backend.get_added_tokens_decoder())
        self.ids = np.array([i for i in range(tokenizer.vocab_size) if i not in special])

    def draw(self, n: int) -> list[int]:
        return [int(x) for x in self.rng.choice(self.ids, size=n)]

    def text_of_len(self, ids: list[int], target: int) -> tuple[str, int]:
        """Decode `ids`; while the text re-encodes to another length, cut or extend it (a few rounds, as
        vLLM does). Returns the text and its length in tokens."""
        for _ in range(10):
            text = self.tokenizer.decode(ids)
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            if len(ids) == target:
                break
            ids = ids[:target] if len(ids) > target else ids + self.draw(target - len(ids))
        text = self.tokenizer.decode(ids)
        return text, len(self.tokenizer.encode(text, add_special_tokens=False))


def random_dataset(
    tokenizer: Tokenizer,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    prefix_len: int,
    seed: int,
) -> list[SampleRequest]:
    if not 0 <= range_ratio < 1:
        raise ValueError("--random-range-ratio must be in [0, 1)")
    rng = np.random.default_rng(seed)
    source = _TokenSource(tokenizer, rng)
    prefix = source.draw(prefix_len)
    in_lens = _lengths(rng, input_len, range_ratio, num_prompts, 1)
    out_lens = _lengths(rng, output_len, range_ratio, num_prompts, 1)
    out = []
    for n_in, n_out in zip(in_lens, out_lens):
        text, n = source.text_of_len(prefix + source.draw(int(n_in)), prefix_len + int(n_in))
        out.append(SampleRequest(text, n, int(n_out)))
    return out


def prefix_repetition_dataset(
    tokenizer: Tokenizer,
    num_prompts: int,
    prefix_len: int,
    suffix_len: int,
    num_prefixes: int,
    output_len: int,
    seed: int,
) -> list[SampleRequest]:
    """`num_prefixes` prefixes, each shared by num_prompts // num_prefixes prompts; shuffled."""
    if num_prefixes < 1 or num_prompts % num_prefixes:
        raise ValueError("--num-prompts must be a multiple of --prefix-repetition-num-prefixes")
    rng = np.random.default_rng(seed)
    source = _TokenSource(tokenizer, rng)
    out = []
    for _ in range(num_prefixes):
        prefix_text, _n = source.text_of_len(source.draw(prefix_len), prefix_len)
        for _ in range(num_prompts // num_prefixes):
            suffix_text, _n = source.text_of_len(source.draw(suffix_len), suffix_len)
            text = prefix_text + " " + suffix_text
            out.append(SampleRequest(text, len(tokenizer.encode(text, add_special_tokens=False)), output_len))
    random.Random(seed).shuffle(out)
    return out


def sharegpt_dataset(
    tokenizer: Tokenizer, path: str, num_prompts: int, output_len: int | None, seed: int
) -> list[SampleRequest]:
    """The first human turn of each conversation as the prompt; the reply's length as the output length
    (unless `output_len`). Too short (< 4 tokens) or too long (prompt > 1024, both > 2048) are skipped."""
    with open(path) as f:
        data: list[dict[str, Any]] = json.load(f)
    convs = [d["conversations"] for d in data if len(d.get("conversations", [])) >= 2]
    random.Random(seed).shuffle(convs)
    out: list[SampleRequest] = []
    for conv in convs:
        if len(out) == num_prompts:
            break
        prompt, reply = conv[0]["value"], conv[1]["value"]
        n_in = len(tokenizer.encode(prompt, add_special_tokens=False))
        n_out = output_len or len(tokenizer.encode(reply, add_special_tokens=False))
        if n_in < 4 or n_out < 4 or n_in > 1024 or n_in + n_out > 2048:
            continue
        out.append(SampleRequest(prompt, n_in, n_out))
    if len(out) < num_prompts:
        raise ValueError(f"{path}: only {len(out)} usable conversations for --num-prompts {num_prompts}")
    return out
