"""The cornerstone: the engine's greedy output equals transformers' greedy `generate` (fp32, CPU)
on the bundled SmolLM2, batched, chunked, on a prefix-cache hit and under preemption — with no leaks."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.hf_reference import hf_greedy

pytestmark = pytest.mark.slow

TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "List three colors:",
    "Translate to French: I like apples.",
    "The quick brown fox",
    "1, 2, 3, 4,",
    "Water boils at",
]
MAX_TOKENS = [12, 7, 16, 5, 9, 14, 6, 11, 8, 13, 10]


def _long_text(words: int) -> str:
    base = (
        "In the history of computing, engineers learned that memory, not arithmetic, often limits "
        "how fast a program runs. Caches, pages and careful layouts matter. "
    )
    return " ".join([base] * (words // 20 + 1))


@pytest.fixture(scope="module")
def prompts(bundled_model_dir):
    from engine.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(bundled_model_dir)
    ids = [tok.encode("Hello")[:1]]  # a 1-token prompt
    ids += [tok.encode(t) for t in TEXTS]
    ids.append(tok.encode(_long_text(160))[:170])  # crosses ten block boundaries
    ids.append(tok.encode("Summarize: " + _long_text(420))[:430])  # over 400 tokens
    assert len(ids) >= 10 and len(ids[0]) == 1 and len(ids[-1]) > 400
    return ids


@pytest.fixture(scope="module")
def expected(bundled_model_dir, prompts):
    return hf_greedy(bundled_model_dir, prompts, MAX_TOKENS[: len(prompts)])


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], [greedy(m) for m in MAX_TOKENS[: len(prompts)]]
    )
    return [o.outputs[0].token_ids for o in outs]


def assert_no_leak(llm: LLM) -> None:
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert not llm.engine.scheduler.has_unfinished()


@pytest.fixture(scope="module")
def llm(bundled_model_dir):
    return LLM(dtype="float32", device="cpu", cpu_kv_cache_space=0.25, max_model_len=2048)


def test_batch_matches_transformers(llm, prompts, expected):
    assert run(llm, prompts) == expected
    assert_no_leak(llm)


def test_start_up_warm_up_steps_leave_the_engine_exact(llm, prompts, expected):
    """The mixed steps that compile kernel variants at start-up on CUDA (EngineCore._warm_up_kernels) run on
    any device; after them the engine's output still equals transformers' and it holds nothing."""
    sched = llm.engine.scheduler
    llm.engine._warm_up_kernels(
        llm.engine.config.cache.block_size, sched.max_num_seqs, sched.max_num_batched_tokens
    )
    assert run(llm, prompts) == expected
    assert_no_leak(llm)


def test_chunked_prefill_matches_transformers(bundled_model_dir, prompts, expected):
    small = LLM(
        dtype="float32", device="cpu", max_num_batched_tokens=64, cpu_kv_cache_space=0.25, max_model_len=2048
    )
    assert run(small, prompts) == expected
    assert_no_leak(small)


def test_prefix_cache_hit_gives_same_tokens(llm, prompts, expected):
    llm.generate([{"prompt_token_ids": p} for p in prompts[-2:]], [greedy(2)] * 2)  # warm the cache
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[-2:]], [greedy(m) for m in MAX_TOKENS[-2:]])
    assert all(o.num_cached_tokens > 0 for o in outs)
    assert outs[1].num_cached_tokens == (len(prompts[-1]) - 1) // 16 * 16
    assert [o.outputs[0].token_ids for o in outs] == expected[-2:]
    assert_no_leak(llm)


def test_preemption_recomputes_exactly(bundled_model_dir, prompts):
    # four sequences growing to ~60 tokens (4 blocks each) in a pool of 10 blocks: decode must preempt
    short = [p for p in prompts if 4 <= len(p) <= 12][:4]
    want = hf_greedy(bundled_model_dir, short, [48] * len(short))
    tiny = LLM(
        dtype="float32",
        device="cpu",
        num_gpu_blocks_override=10,
        max_model_len=160,
        enable_prefix_caching=False,
    )
    outs = tiny.generate([{"prompt_token_ids": p} for p in short], greedy(48))
    assert [o.outputs[0].token_ids for o in outs] == want
    assert tiny.engine.scheduler.num_preemptions > 0
    assert_no_leak(tiny)


def test_seeded_sampling_is_reproducible(llm):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=12)
    a = llm.generate("Tell me a story about a dragon.", params)[0].outputs[0].token_ids
    b = llm.generate(["Tell me a story about a dragon.", "Other traffic in the batch"], params)[0]
    assert a == b.outputs[0].token_ids
    assert_no_leak(llm)


def test_n_outputs_share_the_prompt_blocks(llm, prompts):
    engine = llm.engine
    prompt = prompts[-2]  # 170 tokens: 10 full blocks
    rid = engine.add_request(prompt, SamplingParams(n=3, temperature=1.5, seed=5, max_tokens=8))
    seqs = engine.requests[rid].seqs
    tables, final = None, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
        if tables is None and all(s.block_table and s.num_output_tokens for s in seqs):
            tables = [list(s.block_table) for s in seqs]
    assert tables is not None
    assert tables[0][:10] == tables[1][:10] == tables[2][:10]  # the same physical prompt blocks
    assert len({t[10] for t in tables}) == 3  # each its own partial tail block
    assert seqs[1].num_cached_tokens == 160 and seqs[2].num_cached_tokens == 160
    assert final is not None and final.finished and len(final.outputs) == 3
    assert len({tuple(o.token_ids) for o in final.outputs}) > 1  # different seeds, different samples
    assert_no_leak(llm)


def test_final_only_steps_give_each_request_once_as_its_streamed_final_output(llm, prompts):
    engine = llm.engine

    def drain(final_only: bool) -> dict[str, list]:
        rids = [engine.add_request(p, greedy(m)) for p, m in zip(prompts[:3], (3, 9, 5))]
        seen: dict[str, list] = {r: [] for r in rids}
        while engine.has_unfinished_requests():
            for out in engine.step(final_only=final_only):
                seen[out.request_id].append(out)
        return seen

    streamed = list(drain(final_only=False).values())
    final = list(drain(final_only=True).values())
    assert [len(outs) for outs in streamed] == [3, 9, 5]  # one output per step that advanced it
    assert all(len(outs) == 1 and outs[0].finished for outs in final)
    assert [outs[-1].outputs[0].token_ids for outs in streamed] == [
        outs[0].outputs[0].token_ids for outs in final
    ]
    assert_no_leak(llm)


def test_chat_answers_the_capital_of_france(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}], greedy(40))[0]
    assert "Paris" in out.outputs[0].text
    assert_no_leak(llm)


def test_a_gguf_file_loads_with_its_tokenizer(llm, tmp_path, monkeypatch):
    from engine.bundled import bundled_gguf_path

    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    from_gguf = LLM(
        str(bundled_gguf_path()), dtype="float32", device="cpu", cpu_kv_cache_space=0.05, max_model_len=256
    )
    assert from_gguf.tokenizer is not None
    prompt = "The three primary colors are"
    want = llm.generate(prompt, greedy(10))[0].outputs[0]
    got = from_gguf.generate(prompt, greedy(10))[0].outputs[0]
    assert got.token_ids == want.token_ids and got.text == want.text
