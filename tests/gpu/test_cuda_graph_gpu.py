"""Decode steps replayed from CUDA graphs give the eager engine's and transformers' greedy tokens.

Random tiny checkpoints, fp32. The steps mix batch sizes (requests finish and arrive, so the bucket
changes from step to step and rows are padded), context lengths (short ones, and long ones whose decode
splits the key range inside the graph) and preemptions (a small pool): a replay that read another
step's inputs would change the tokens."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.attention import SHORT_CONTEXT
from tests.hf_reference import _tiny_config, hf_greedy, tiny_random_model_dir, write_tiny_tokenizer


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n)


def random_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 290, (n,), generator=g).tolist() for n in lengths]


def tokens(llm: LLM, batch: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], [greedy(m) for m in max_tokens])
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize(
    "arch", ["llama", "qwen2", "qwen3", "llama3_scaled", "mixtral", "qwen2_moe", "qwen3_moe"]
)
def test_graphs_match_eager_and_transformers_across_batches_and_preemptions(arch, tmp_path):
    tiny = tiny_random_model_dir(tmp_path, arch)
    lengths = [1, 5, 16, 17, 40, 100, 3, 9, 64, 33, 2, 120, 7, 50, 11, 30, 80, 4, 21, 60]
    max_tokens = [9, 30, 7, 16, 22, 14, 40, 3, 25, 12, 35, 8, 19, 27, 5, 33, 10, 21, 15, 28]
    batch = random_prompts(lengths, seed=3)
    kw = dict(device="cuda", dtype="float32", max_model_len=256, max_num_seqs=16, enable_prefix_caching=False)
    llm = LLM(str(tiny), num_gpu_blocks_override=40, **kw)
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.captured == [1, 2, 4, 8, 16]
    got = tokens(llm, batch, max_tokens)
    eager = LLM(str(tiny), enforce_eager=True, num_gpu_blocks_override=40, **kw)
    assert eager.engine.runner.graphs is None
    assert got == tokens(eager, batch, max_tokens)
    assert got == hf_greedy(tiny, batch, max_tokens)
    assert graphs.num_replays > 10 and llm.engine.scheduler.num_preemptions > 0
    assert len({b for (b, _), n in graphs.replay_counts.items() if n}) >= 3  # several buckets, padded rows


@pytest.fixture
def long_tiny(tmp_path):
    """The tiny llama with 4096 positions, so a graph's decode splits the key range."""
    from transformers import AutoModelForCausalLM

    config = _tiny_config("llama")
    config.max_position_embeddings = 4096
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.1)
    out = tmp_path / "tiny-long"
    model.save_pretrained(out)
    write_tiny_tokenizer(out)
    return out


def test_split_kv_graphs_with_arrivals_mid_run_match_transformers(long_tiny):
    llm = LLM(
        str(long_tiny), device="cuda", dtype="float32", max_model_len=4096, max_num_seqs=8,
        gpu_memory_utilization=0.1,
    )  # fmt: skip
    engine, graphs = llm.engine, llm.engine.runner.graphs
    assert graphs is not None and graphs.plans[1][-1].num_splits > 1  # batch 1 splits 4096 keys
    batch = random_prompts([1500, 700, 2500, 40, 900, 3], seed=4)
    max_tokens = [20, 35, 12, 40, 18, 30]
    rids = [engine.add_request(p, greedy(m)) for p, m in zip(batch[:2], max_tokens[:2])]
    done: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        if steps in (4, 9, 15) and len(rids) < len(batch):  # arrivals: prefill steps between decode ones
            for _ in range(2 if steps == 4 else 1):
                i = len(rids)
                rids.append(engine.add_request(batch[i], greedy(max_tokens[i])))
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        steps += 1
    assert [done[r] for r in rids] == hf_greedy(long_tiny, batch, max_tokens)
    assert len(rids) == len(batch) and graphs.num_replays > 20
    long = [n for (b, i), n in graphs.replay_counts.items() if graphs.plans[b][i].max_seq_len > SHORT_CONTEXT]
    assert sum(long) > 10  # the long-context graphs (split-KV over max_model_len) ran
    short = random_prompts([20, 7, 33], seed=5)  # then only short contexts: the short-context graphs
    assert tokens(llm, short, [25, 30, 12]) == hf_greedy(long_tiny, short, [25, 30, 12])
    assert sum(
        n for (b, i), n in graphs.replay_counts.items() if graphs.plans[b][i].max_seq_len <= SHORT_CONTEXT
    )
