"""The engine with an fp8 KV cache on the bundled SmolLM2 (fp32 model, CPU: the references' fp8 path) against
the same engine with an fp32 cache, greedy, 16 tokens of 10 chat prompts, with scales of 1.0 and calibrated
ones. Printed: prompts whose 16 tokens are equal, tokens before each prompt's first difference, and the mean
absolute difference of the chosen tokens' logprobs over those.

This model's greedy path is fragile: many of its steps have a runner-up within 0.3 nats, and e4m3's 3
mantissa bits (up to 6% per K and V element) move logprobs by a few hundredths, so 3-6 of the 10 prompts
part within 16 tokens (a bf16 KV cache keeps all 10). What must hold is that fp8 only ever parts at such a
near-tie: its token is one the full-precision engine ranked within 0.5 nats of its own choice."""

from __future__ import annotations

import pytest

from bench.kv_accuracy import QUESTIONS as CHAT_QUESTIONS
from engine import LLM, SamplingParams

pytestmark = pytest.mark.slow

QUESTIONS = CHAT_QUESTIONS[:10]  # the first 10 of the 50 that bench/kv_accuracy.py measures agreement over
TOKENS = 16


def greedy(llm: LLM) -> list[tuple[list[int], list[dict[int, float]]]]:
    """Each prompt's tokens and, per token, the logprobs of the top 5 and of the chosen one."""
    params = SamplingParams(temperature=0, max_tokens=TOKENS, logprobs=5)
    outs = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS], params)
    result = []
    for o in outs:
        c = o.outputs[0]
        assert c.logprobs is not None
        result.append((c.token_ids, c.logprobs))
    return result


@pytest.fixture(scope="module")
def baseline():
    return greedy(LLM(dtype="float32", device="cpu", max_model_len=512, cpu_kv_cache_space=0.05))


@pytest.mark.parametrize("calculate_kv_scales", [False, True], ids=["scales_1", "calibrated_scales"])
def test_fp8_kv_cache_agrees_with_the_full_precision_cache(baseline, calculate_kv_scales):
    llm = LLM(
        dtype="float32", device="cpu", max_model_len=512, cpu_kv_cache_space=0.05, kv_cache_dtype="fp8",
        calculate_kv_scales=calculate_kv_scales,
    )  # fmt: skip
    assert str(llm.engine.runner.kv_cache.dtype) == "torch.float8_e4m3fn"
    scales = llm.engine.kv_scales
    assert scales is not None and scales.shape == (30, 2)
    assert (scales == 1.0).all() != calculate_kv_scales
    got = greedy(llm)
    same_prompts, agreed, deltas, partings = 0, 0, [], []
    for (want_ids, want_lps), (ids, lps) in zip(baseline, got, strict=True):
        same_prompts += ids == want_ids
        n = next((i for i, (a, b) in enumerate(zip(ids, want_ids)) if a != b), min(len(ids), len(want_ids)))
        agreed += n
        deltas += [abs(lps[i][t] - want_lps[i][t]) for i, t in enumerate(ids[:n])]
        if n < min(len(ids), len(want_ids)):  # how far below its own choice the fp32 engine ranked fp8's
            partings.append(want_lps[n][want_ids[n]] - want_lps[n].get(ids[n], float("-inf")))
    total = sum(len(ids) for ids, _ in baseline)
    mean_delta = sum(deltas) / len(deltas)
    print(
        f"fp8 KV ({'calibrated' if calculate_kv_scales else '1.0'} scales): {same_prompts}/10 prompts' first "
        f"{TOKENS} tokens equal, {agreed}/{total} tokens before the first difference, mean |logprob diff| "
        f"{mean_delta:.4f} over them; where they part, fp8's token was {[round(p, 3) for p in partings]} nats "
        "below the fp32 engine's"
    )
    assert all(p < 0.5 for p in partings)  # only ever at a near-tie
    assert mean_delta < 0.1  # the chosen tokens' probabilities barely move
    assert agreed >= total / 2
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_fp8_kv_cache_keeps_heldout_perplexity():
    """Perplexity on the shipped held-out text, every query reading K and V from the cache: fp8 (scales 1.0)
    against the same model's fp32 cache. Which values round which way moves it by up to ~1% (uniform scales of
    0.5 to 1.37 give 19.85-20.00 against 19.83, bench/kv_accuracy.py): the greedy partings are near-ties, not a
    worse model."""
    from engine.quantize.calibration import HELDOUT_TEXT, perplexity

    llm = LLM(dtype="float32", device="cpu", max_model_len=512, cpu_kv_cache_space=0.05, kv_cache_dtype="fp8")
    model = llm.engine.runner.model
    ids = llm.tokenizer.encode(HELDOUT_TEXT.read_text(), add_special_tokens=False)
    full = perplexity(model, ids)
    fp8 = perplexity(model, ids, kv_dtype=llm.engine.runner.kv_cache.dtype)
    print(f"held-out perplexity over {len(ids)} tokens: fp32 cache {full:.4f}, fp8 cache {fp8:.4f}")
    assert fp8 != full  # the fp8 cache was read
    assert abs(fp8 / full - 1) < 0.01
