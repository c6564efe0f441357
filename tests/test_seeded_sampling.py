"""Seeded sampling on the bundled SmolLM2 (fp32, CPU): a request's tokens depend on its seed, prompt and
parameters only, not on what shares its batch, nor on whether one process or a prefill and a decode
worker compute them (the first token is drawn on the prefill worker, the rest on the decode worker)."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPT = "Tell me a story about a dragon."
OTHERS = [
    "The capital of France is",
    "def fibonacci(n):",
    "List three colors:",
    "Once upon a time,",
    "Water boils at",
    "1, 2, 3, 4,",
    "Translate to French: I like apples.",
    "The quick brown fox",
]
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)


def traffic(i: int) -> SamplingParams:
    """Other requests' parameters: greedy, unseeded, seeded, filtered, penalized, with logprobs."""
    kinds = [
        SamplingParams(temperature=0, max_tokens=5 + i),
        SamplingParams(temperature=1.2, max_tokens=3 + i),
        SamplingParams(temperature=0.7, top_p=0.8, seed=i, max_tokens=20),
        SamplingParams(temperature=1.0, min_p=0.1, frequency_penalty=0.5, logprobs=2, max_tokens=9),
    ]
    return kinds[i % len(kinds)]


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", device="cpu", cpu_kv_cache_space=0.25, max_model_len=1024)


def test_seeded_request_is_the_same_alone_and_in_a_batch_of_16(llm):
    alone = llm.generate(PROMPT, SEEDED)[0].outputs[0].token_ids
    assert len(alone) == 16
    prompts = [OTHERS[i % len(OTHERS)] + " " * (i // len(OTHERS)) for i in range(15)]
    params = [traffic(i) for i in range(15)]
    prompts.insert(7, PROMPT)
    params.insert(7, SEEDED)
    outs = llm.generate(prompts, params)
    assert len(outs) == 16
    assert outs[7].outputs[0].token_ids == alone
    other_seed = SamplingParams(**{**_knobs(SEEDED), "seed": 4321})
    assert llm.generate(PROMPT, other_seed)[0].outputs[0].token_ids != alone
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_disaggregated_seeded_tokens_equal_one_process(llm):
    from protos import pdserve_pb2 as pb
    from tests.cluster import collect, start_cluster

    tok = llm.engine.tokenizer
    prompts = [tok.encode(PROMPT), tok.encode("Paging keeps memory tidy: blocks of sixteen tokens. " * 12)]
    knobs = {"temperature": 0.9, "top_p": 0.95, "top_k": 50, "max_tokens": 12, "ignore_eos": True}
    want = [
        [c.token_ids for c in out.outputs]
        for out in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], SamplingParams(n=2, seed=77, **knobs)
        )
    ]
    cluster = start_cluster(1, 1, "tcp")
    try:
        for ids, expected in zip(prompts, want):
            req = pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(n=2, seed=77, **knobs)
            )
            tokens, _, _ = collect(cluster.stub().Generate(req))
            assert [tokens[0], tokens[1]] == expected
        cluster.wait_all_blocks_free()
    finally:
        cluster.stop()


def _knobs(p: SamplingParams) -> dict:
    return {k: getattr(p, k) for k in ("temperature", "top_p", "top_k", "seed", "max_tokens", "ignore_eos")}
