"""SamplingParams.prompt_logprobs (vLLM's): every prompt token's logprob after the first, and the top k beside
it, equal to the log-softmax of transformers' fp32 logits at the position before it (CPU, bundled SmolLM2):
chunked, after a prefix-cache hit, under preemption, overlapped or in order, with n > 1, and no leaked block."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.hf_reference import hf_greedy, hf_logits

pytestmark = pytest.mark.slow

TOL = 1e-4  # fp32 on both sides; the engine's attention and GEMMs sum in another order
TEXTS = [
    "Hello",
    "The capital of France is",
    "Summarize: " + "Caches, pages and careful layouts matter to how fast a program runs. " * 14,
]


@pytest.fixture(scope="module")
def prompts(bundled_model_dir):
    from engine.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(bundled_model_dir)
    ids = [tok.encode(t) for t in TEXTS]
    ids[0] = ids[0][:1]  # a one-token prompt: nothing to report but its leading None
    assert len(ids[0]) == 1 and len(ids[-1]) > 160
    return ids


@pytest.fixture(scope="module")
def reference(bundled_model_dir, prompts):
    """Per prompt, (len - 1, vocab) log-softmax of transformers' logits at positions 0 .. len - 2."""
    return [torch.log_softmax(hf_logits(bundled_model_dir, p), dim=-1)[:-1] for p in prompts]


def check(prompt: list[int], got, ref: torch.Tensor, k: int) -> None:
    assert got is not None and len(got) == len(prompt) and got[0] is None
    for i in range(1, len(prompt)):
        row, want = got[i], ref[i - 1]
        assert prompt[i] in row and abs(row[prompt[i]] - want[prompt[i]].item()) < TOL, i
        top = want.topk(k).indices.tolist() if k else []
        assert set(top) <= set(row) and len(row) <= k + 1, i
        for t in top:
            assert abs(row[t] - want[t].item()) < TOL, (i, t)


def assert_no_leak(llm: LLM) -> None:
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert not llm.engine.scheduler.has_unfinished()


def make(**kwargs) -> LLM:
    return LLM(dtype="float32", device="cpu", cpu_kv_cache_space=0.25, max_model_len=1024, **kwargs)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "in_order"])
def test_prompt_logprobs_match_transformers_chunked_and_whole(prompts, reference, overlap):
    for budget in (2048, 48):  # the long prompt in one chunk, then in four
        llm = make(max_num_batched_tokens=budget, async_scheduling=overlap)
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            [SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=k) for k in (0, 2, 5)],
        )
        for p, o, ref, k in zip(prompts, outs, reference, (0, 2, 5)):
            check(p, o.prompt_logprobs, ref, k)
        assert_no_leak(llm)


def test_a_request_without_them_reports_none_and_keeps_its_prefix_hits(prompts, reference):
    llm = make()
    params = SamplingParams(temperature=0.0, max_tokens=2)
    long = {"prompt_token_ids": prompts[-1]}
    first = llm.generate([long], params)[0]
    assert first.prompt_logprobs is None
    # cached blocks do not serve positions whose logprobs were never computed: the whole prompt runs again
    asked = llm.generate([long], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1))[0]
    assert asked.num_cached_tokens == 0
    check(prompts[-1], asked.prompt_logprobs, reference[-1], 1)
    assert asked.outputs[0].token_ids == first.outputs[0].token_ids
    again = llm.generate([long], params)[0]
    assert again.num_cached_tokens == (len(prompts[-1]) - 1) // 16 * 16
    assert_no_leak(llm)


def test_n_completions_share_one_set(prompts, reference):
    llm = make()
    out = llm.generate(
        [{"prompt_token_ids": prompts[1]}],
        SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=4, prompt_logprobs=1),
    )[0]
    assert len(out.outputs) == 3
    check(prompts[1], out.prompt_logprobs, reference[1], 1)
    assert_no_leak(llm)


def test_preempted_prompts_keep_exact_logprobs_and_tokens(bundled_model_dir, prompts, reference):
    """Four requests growing past a 14-block pool: decode preempts (recompute) and re-admits them, and the
    prompt positions computed again add nothing twice."""
    short = [prompts[1]] * 2 + [prompts[-1][:40], prompts[-1][:23]]
    want = hf_greedy(bundled_model_dir, short, [40] * len(short))
    llm = LLM(
        dtype="float32",
        device="cpu",
        num_gpu_blocks_override=14,
        max_model_len=120,
        enable_prefix_caching=False,
    )
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in short],
        SamplingParams(temperature=0.0, max_tokens=40, prompt_logprobs=2),
    )
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == want
    for p, o in zip(short, outs):
        ref = torch.log_softmax(hf_logits(bundled_model_dir, p), dim=-1)[:-1]
        check(p, o.prompt_logprobs, ref, 2)
    assert_no_leak(llm)


def test_negative_prompt_logprobs_is_refused():
    with pytest.raises(ValueError, match="prompt_logprobs must be non-negative"):
        SamplingParams(prompt_logprobs=-1)
