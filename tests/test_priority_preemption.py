"""Priority scheduling in the engine: an urgent request arriving into a full batch of less urgent ones gets
its first token before any of them finishes (they are preempted, by max_num_seqs or by the pool), and every
request's greedy tokens are still the plain engine's; overlapped steps and steps in order alike."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.hf_reference import tiny_random_model_dir


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_random_model_dir(tmp_path_factory.mktemp("prio"), "llama")


def prompts(urgent_len: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 250, (n,), generator=g).tolist() for n in (30, 25, 40, urgent_len)]


MAX_TOKENS = [40, 40, 40, 6]


def plain(tiny, batch: list[list[int]]) -> list[list[int]]:
    llm = LLM(str(tiny), device="cpu", dtype="float32", max_model_len=128)
    params = [SamplingParams(temperature=0, max_tokens=m) for m in MAX_TOKENS]
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["overlapped", "in_order"])
@pytest.mark.parametrize("limit", ["max_num_seqs", "blocks"])
def test_an_urgent_arrival_runs_before_a_full_batch_finishes_and_nothing_changes(
    tiny, async_scheduling, limit
):
    # max_num_seqs: three run, a fourth cannot join. blocks: 15 hold the three to their last token (5 each),
    # so none is preempted for growing; at the arrival 7 are free and the urgent 120-token prompt needs 8
    kw = {"max_num_seqs": 3} if limit == "max_num_seqs" else {"num_gpu_blocks_override": 15}
    urgent_len = 12 if limit == "max_num_seqs" else 120
    llm = LLM(
        str(tiny), device="cpu", dtype="float32", max_model_len=128, scheduling_policy="priority",
        async_scheduling=async_scheduling, enable_prefix_caching=False, **kw,
    )  # fmt: skip
    engine, batch = llm.engine, prompts(urgent_len)
    params = [SamplingParams(temperature=0, max_tokens=m) for m in MAX_TOKENS]
    rids = [engine.add_request(batch[i], params[i], priority=10) for i in range(3)]
    for _ in range(4):
        engine.step()
    urgent = engine.add_request(batch[3], params[3], priority=0)
    done: dict[str, list[int]] = {}
    first_urgent_step, finished_before = None, []
    for n in range(400):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.request_id == urgent and first_urgent_step is None and out.outputs[0].token_ids:
                first_urgent_step = n
                finished_before = list(done)
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert first_urgent_step is not None and finished_before == []
    assert engine.scheduler.num_preemptions > 0
    assert [done[r] for r in [*rids, urgent]] == plain(tiny, batch)
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
