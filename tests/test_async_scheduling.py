"""Overlapped scheduling (EngineCore.step_overlapped) against the engine's in-order step and transformers.

Each step is planned and queued while the one before it still runs, with that step's tokens read on the
device; these tests check that nothing a request sees changes: the same tokens greedy and seeded, the
same stops (EOS, stop tokens, stop strings, max_tokens, max_model_len), preemptions, prefix-cache hits,
n > 1, penalties, aborts, and no block left held.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine import LLM, SamplingParams
from tests.hf_reference import hf_greedy, tiny_random_model_dir
from tests.test_cuda_graph import with_static_graphs


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_random_model_dir(tmp_path_factory.mktemp("overlap"), "llama3_scaled")


@pytest.fixture(scope="module")
def batch():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 290, (n,), generator=g).tolist() for n in (1, 5, 16, 17, 40, 100, 3, 33)]


def make(tiny, overlapped: bool, **kw) -> LLM:
    kw = {"device": "cpu", "dtype": "float32", "max_model_len": 160, **kw}
    llm = LLM(str(tiny), **kw)
    llm.engine.config = dataclasses.replace(llm.engine.config, async_scheduling=overlapped)
    return llm


def generate(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[list[int]]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks  # nothing held once every request is done
    assert not llm.engine.scheduler.has_unfinished()
    return [[c.token_ids for c in o.outputs] for o in outs]


def count_overlaps(llm: LLM) -> list[int]:
    """Counts, into the returned list, the steps launched while another step's tokens were unread."""
    runner, seen, open_steps = llm.engine.runner, [0], []
    launch, collect = runner.launch, runner.collect

    def launching(*args, **kwargs):
        seen[0] += bool(open_steps)
        step = launch(*args, **kwargs)
        open_steps.append(step)
        return step

    def collecting(step):
        open_steps.remove(step)
        return collect(step)

    runner.launch, runner.collect = launching, collecting
    return seen


def test_greedy_matches_transformers_and_the_in_order_step(tiny, batch):
    max_tokens = [9, 30, 7, 16, 22, 14, 40, 1]
    params = [SamplingParams(temperature=0, max_tokens=m) for m in max_tokens]
    in_order = generate(make(tiny, False), batch, params)
    assert [o[0] for o in in_order] == hf_greedy(tiny, batch, max_tokens)
    llm = make(tiny, True)
    overlaps = count_overlaps(llm)
    assert generate(llm, batch, params) == in_order
    assert overlaps[0] > 20  # the steps did overlap


def test_stops_on_tokens_and_strings_finish_on_time(tiny, batch):
    """A stop token or string ends a request on the token it appears in, although the next step was
    already queued for it; max_model_len ends the longest one."""
    free = generate(make(tiny, False), batch, [SamplingParams(temperature=0, max_tokens=40)] * len(batch))
    tok = make(tiny, False).tokenizer
    stops = [
        SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[out[0][k]])
        for out, k in zip(free, [3, 0, 10, 5, 2, 7, 1, 4])
    ]
    texts = [tok.decode(out[0][6:9]) for out in free]
    strings = [SamplingParams(temperature=0, max_tokens=40, stop=[t]) for t in texts if t.strip()]
    long = [SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)]
    params = stops + strings + long
    prompts = batch + batch[: len(strings)] + [batch[5]]
    in_order = generate(make(tiny, False), prompts, params)
    assert all(len(o[0]) < 40 for o in in_order[: len(stops)])  # the stop tokens did stop them
    assert len(in_order[-1][0]) == 160 - len(batch[5])  # max_model_len
    assert generate(make(tiny, True), prompts, params) == in_order


def test_preemptions_prefix_hits_and_n_children(tiny, batch):
    """A small pool preempts requests whose newest token is still in flight; shared prefixes hit the
    cache; n = 3 children with seeds, and penalties (which run in order), all as the in-order step."""
    shared = batch[5][:64]
    prompts = [shared + p for p in batch[:4]] + batch[4:]
    params = [SamplingParams(temperature=0, max_tokens=24)] * 5
    params += [SamplingParams(temperature=0.9, top_p=0.9, max_tokens=20, n=3, seed=7)]
    params += [SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.3, frequency_penalty=0.5)]
    params += [SamplingParams(temperature=0.7, max_tokens=30, seed=11)]
    kw = {"num_gpu_blocks_override": 24, "enable_prefix_caching": True}
    ref = make(tiny, False, **kw)
    in_order = generate(ref, prompts, params)
    llm = make(tiny, True, **kw)
    assert generate(llm, prompts, params) == in_order
    assert llm.engine.scheduler.num_preemptions > 0 and ref.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.prefix_hits > 0


def test_the_static_graph_path_reads_the_pending_tokens(tiny, batch):
    params = [SamplingParams(temperature=0, max_tokens=m) for m in (9, 30, 7, 16, 22, 14, 40, 12)]
    in_order = generate(make(tiny, False), batch, params)
    llm = make(tiny, True, num_gpu_blocks_override=30, enable_prefix_caching=False)
    graphs = with_static_graphs(llm, [1, 2, 4, 8])
    assert generate(llm, batch, params) == in_order
    assert graphs.num_replays > 20


def test_an_abort_while_its_step_is_in_flight_frees_everything(tiny, batch):
    llm = make(tiny, True)
    engine = llm.engine
    rids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=50)) for p in batch[:4]]
    for _ in range(6):
        engine.step()
    assert engine._in_flight is not None
    engine.abort_request(rids[1])
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id != rids[1]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    # the last step, queued for requests that had finished, is read and dropped by the next request's steps
    out = llm.generate({"prompt_token_ids": batch[0]}, SamplingParams(temperature=0, max_tokens=5))
    assert out[0].outputs[0].token_ids == hf_greedy(tiny, [batch[0]], [5])[0]
