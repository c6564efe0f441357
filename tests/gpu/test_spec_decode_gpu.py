"""Speculative decoding on CUDA, with graphs and overlapped steps on, keeps transformers' greedy tokens.

Random tiny checkpoints, fp32. The prompts repeat themselves, so n-gram drafts are often right, and
random weights repeat their own output, so drafts are sometimes right and sometimes not: verification
accepts and rejects at every position. Seeded sampling draws the plain engine's tokens."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.hf_reference import hf_greedy, tiny_random_model_dir

MAX_TOKENS = [30, 24, 40, 12, 33, 20]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_random_model_dir(tmp_path_factory.mktemp("spec-gpu"), "llama3_scaled")


@pytest.fixture(scope="module")
def batch():
    g = torch.Generator().manual_seed(11)
    pieces = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (5, 9, 3, 17, 2, 40)]
    return [p * (60 // len(p) + 1) for p in pieces]  # each a repeated phrase, 60-80 tokens


def run(llm: LLM, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    return [o.outputs[0].token_ids for o in outs]


def engine(tiny, **kw) -> LLM:
    return LLM(str(tiny), device="cuda", dtype="float32", max_model_len=256, max_num_seqs=8,
               num_gpu_blocks_override=160, **kw)  # fmt: skip  # a small pool: tests share the GPU under -n 8


@pytest.mark.parametrize(
    "spec",
    [
        {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False},
        {"method": "self_draft", "num_speculative_tokens": 3, "num_draft_layers": 1, "adaptive": False},
        {"method": "draft_model", "num_speculative_tokens": 3, "adaptive": False},  # the target drafts itself
    ],
    ids=lambda s: s["method"],
)
def test_speculation_on_cuda_equals_transformers_greedy(tiny, batch, spec):
    if spec["method"] == "draft_model":
        spec = {**spec, "model": str(tiny)}
    params = [SamplingParams(temperature=0, max_tokens=m) for m in MAX_TOKENS]
    llm = engine(tiny, speculative_config=spec)
    assert llm.engine.runner.graphs is not None
    assert run(llm, batch, params) == hf_greedy(tiny, batch, MAX_TOKENS)
    stats = llm.engine.scheduler.spec_stats
    assert stats.num_drafts > 10 and stats.num_accepted_tokens > 0
    if spec["method"] == "draft_model":
        assert stats.acceptance_rate > 0.95  # the same weights draft: every draft token is the target's


def test_seeded_sampling_with_speculation_on_cuda_is_the_plain_draw(tiny, batch):
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_tokens=m, seed=7 + i)
        for i, m in enumerate(MAX_TOKENS)
    ]
    plain = run(engine(tiny), batch, params)
    llm = engine(tiny, speculative_config={"method": "ngram", "num_speculative_tokens": 4, "adaptive": False})
    assert run(llm, batch, params) == plain
    assert llm.engine.scheduler.spec_stats.num_drafts > 10


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory):
    """A draft of other shapes than the target's (head_dim 32 against 16, one kv head), the same tokenizer."""
    return tiny_random_model_dir(
        tmp_path_factory.mktemp("spec-gpu-draft"), "llama3_scaled", seed=3, num_attention_heads=2,
        num_key_value_heads=1,
    )  # fmt: skip


@pytest.mark.parametrize(
    "spec",
    [
        {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False},
        {"method": "self_draft", "num_speculative_tokens": 3, "num_draft_layers": 1, "adaptive": False},
        {"method": "draft_model", "num_speculative_tokens": 3, "adaptive": False},
    ],
    ids=lambda s: s["method"],
)
def test_speculation_compiles_no_kernel_after_start_up(tiny, small_draft, batch, spec):
    """Start-up compiles every kernel variant that speculative serving needs (engine/engine_core.py:
    _warm_up_kernels), also with a given pool size, which skips the memory profile: greedy and sampled rows,
    drafting (a draft model's at its own shapes), verification and 60-80-token prompts beside them compile
    nothing more."""
    from kernels import _backend as backend

    if spec["method"] == "draft_model":
        spec = {**spec, "model": str(small_draft)}
    llm = engine(tiny, speculative_config=spec)
    before = backend.compiled_variants()
    assert before is not None
    params = [
        SamplingParams(temperature=0, max_tokens=m)
        if i % 2
        else SamplingParams(temperature=0.8, max_tokens=m, seed=i)
        for i, m in enumerate(MAX_TOKENS)
    ]
    run(llm, batch, params)
    run(llm, batch, [SamplingParams(temperature=0, max_tokens=m) for m in MAX_TOKENS])  # every row greedy
    assert llm.engine.scheduler.spec_stats.num_drafts > 10
    assert backend.compiled_since(before) == {}
