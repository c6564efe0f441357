"""Swap under heavy preemption on the bundled SmolLM2 (fp32, CPU). Five chat requests of low priority share a
system prompt and a GPU pool of 224 tokens; three urgent requests with 200-token prompts arrive eight steps
apart and each takes nearly the whole pool, so every low-priority request is swapped out and back in at least
twice. Greedy output equals transformers', with prefix caching and without, in swap and in auto mode
(overlapped steps and steps in order), and afterwards every block of both pools is free."""

from __future__ import annotations

from collections import Counter

import pytest

from engine import LLM, SamplingParams
from engine.sequence import Sequence
from tests.hf_reference import hf_greedy

pytestmark = pytest.mark.slow

TOPICS = ["animals", "fruits", "countries", "colors", "rivers"]
LOW_TOKENS, URGENT_TOKENS, URGENT_LEN, URGENT_GAP = 32, 4, 200, 8
BLOCK_SIZE, NUM_BLOCKS = 8, 28
BLOCK_BYTES = 30 * 2 * BLOCK_SIZE * 3 * 64 * 4  # SmolLM2 fp32: every layer's K and V
PASSAGE = (
    "In the history of computing, engineers learned that memory, not arithmetic, often limits how fast a "
    "program runs. Caches, pages and careful layouts matter, and so do the queues in front of them. "
)


@pytest.fixture(scope="module")
def prompts(bundled_model_dir):
    from engine.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(bundled_model_dir)
    system = {
        "role": "system",
        "content": "You are a helpful assistant. Answer with a numbered list of ten items.",
    }
    low = [
        tok.encode(
            tok.apply_chat_template([system, {"role": "user", "content": f"Name {t}."}]),
            add_special_tokens=False,
        )
        for t in TOPICS
    ]
    urgent = [tok.encode(f"Summary {k}. " + PASSAGE * 10)[:URGENT_LEN] for k in range(3)]
    assert all(len(u) == URGENT_LEN for u in urgent)
    return low, urgent


@pytest.fixture(scope="module")
def expected(bundled_model_dir, prompts):
    low, urgent = prompts
    return hf_greedy(bundled_model_dir, low + urgent, [LOW_TOKENS] * len(low) + [URGENT_TOKENS] * len(urgent))


def run(llm: LLM, low: list[list[int]], urgent: list[list[int]]) -> dict[str, list[int]]:
    """The low-priority requests at once, the urgent ones URGENT_GAP steps apart; every request's tokens."""
    engine, done = llm.engine, {}
    rids = [
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=LOW_TOKENS), priority=10) for p in low
    ]
    for step in range(400):
        k = (step - 3) // URGENT_GAP
        if step >= 3 and (step - 3) % URGENT_GAP == 0 and k < len(urgent):
            params = SamplingParams(temperature=0, max_tokens=URGENT_TOKENS)
            rids.append(engine.add_request(urgent[k], params, priority=0))
        if not engine.has_unfinished_requests() and len(rids) == len(low) + len(urgent):
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[r] for r in rids]


@pytest.mark.parametrize(
    "mode,prefix_caching,async_scheduling",
    [("swap", True, True), ("swap", False, False), ("auto", True, False), ("auto", False, True)],
    ids=[
        "swap-prefix_caching-overlapped",
        "swap-in_order",
        "auto-prefix_caching-in_order",
        "auto-overlapped",
    ],
)
def test_greedy_output_under_heavy_swapping_equals_transformers(
    prompts, expected, mode, prefix_caching, async_scheduling
):
    # auto: a swap space of 12 blocks, so some victims it cannot hold are recomputed; swap: room for all
    swap_blocks = 12 if mode == "auto" else 64
    llm = LLM(
        dtype="float32", device="cpu", max_model_len=BLOCK_SIZE * NUM_BLOCKS, block_size=BLOCK_SIZE,
        num_gpu_blocks_override=NUM_BLOCKS, swap_space=swap_blocks * BLOCK_BYTES / 2**30, preemption_mode=mode,
        enable_prefix_caching=prefix_caching, async_scheduling=async_scheduling, scheduling_policy="priority",
    )  # fmt: skip
    preemption = llm.engine.scheduler.preemption
    swap = preemption.swap
    assert swap is not None and swap.num_blocks == swap_blocks
    taken: dict[str, Counter[str]] = {"swap": Counter(), "recompute": Counter()}
    preempt = preemption.preempt

    def spy(seq: Sequence) -> str:
        mode_taken = preempt(seq)
        taken[mode_taken][seq.request_id] += 1
        return mode_taken

    preemption.preempt = spy  # type: ignore[method-assign]
    assert run(llm, *prompts) == expected
    # most requests (all five of low priority, of eight) went out and came back at least twice
    twice = taken["swap"] if mode == "swap" else taken["swap"] + taken["recompute"]
    assert sum(n >= 2 for n in twice.values()) > 8 / 2, taken
    if mode == "auto":
        assert taken["recompute"] and taken["swap"], taken  # the small swap space could not hold them all
    else:
        assert not taken["recompute"], taken
    assert swap.stats.in_blocks > 0 and swap.stats.out_bytes == swap.stats.out_blocks * BLOCK_BYTES
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert swap.cpu.num_free == swap_blocks and swap.num_swapped == 0
    metrics = {(m.name, m.labels.get("mode")): m for m in llm.get_metrics()}
    assert metrics[("pdserve:num_preemptions_by_mode", "swap")].value == preemption.counts["swap"]
    assert metrics[("pdserve:cpu_cache_usage_perc", None)].value == 0.0


def test_a_draft_models_kv_is_recomputed_after_a_swap(bundled_model_dir, prompts, expected):
    """A draft model's cache is not swapped: a request swapped back in has new blocks, whose draft KV the
    draft computes again when it next drafts. With the model as its own draft every draft is then accepted
    (a stale draft KV would be rejected), the output is transformers', and both pools end free."""
    spec = {"method": "draft_model", "model": str(bundled_model_dir), "num_speculative_tokens": 3,
            "adaptive": False}  # fmt: skip
    llm = LLM(
        dtype="float32", device="cpu", max_model_len=BLOCK_SIZE * NUM_BLOCKS, block_size=BLOCK_SIZE,
        num_gpu_blocks_override=NUM_BLOCKS, swap_space=64 * BLOCK_BYTES / 2**30, preemption_mode="swap",
        scheduling_policy="priority", speculative_config=spec,
    )  # fmt: skip
    swap = llm.engine.scheduler.preemption.swap
    assert swap is not None and swap.num_blocks == 64  # the target's blocks only
    assert run(llm, *prompts) == expected
    assert swap.stats.in_blocks > 0
    stats = llm.engine.scheduler.spec_stats
    assert stats.num_drafts > 20 and stats.acceptance_rate > 0.95, stats
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and swap.cpu.num_free == 64 and swap.num_swapped == 0
