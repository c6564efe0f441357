"""Decode graphs' host side on the CPU: buckets, padded static inputs, and whole generations through the
static-buffer path (EagerCapturer stands in for the graphs) giving the eager engine's tokens.

The real capture and replay run on the GPU: tests/gpu/test_cuda_graph_gpu.py."""

from __future__ import annotations

import pytest
import torch

import engine.attention as attention
from engine import LLM, SamplingParams
from engine.attention import SHORT_CONTEXT, DecodeGraphPlan, decode_graph_plans
from engine.cuda_graph import DecodeGraphs, EagerCapturer, StaticInputs, bucket_for, capture_sizes
from engine.sampling_params import SamplingParams as Params
from engine.scheduler import ScheduledSeq
from kernels.decode_reduce import decode_workspace_size
from kernels.paged_decode_attention import fp8_one_warp, plan_num_splits
from tests.hf_reference import hf_greedy, tiny_random_model_dir


def test_capture_sizes_are_vllms_up_to_the_cap():
    assert capture_sizes(256) == [1, 2, 4, *range(8, 257, 8)]
    assert capture_sizes(1000)[-3:] == [496, 504, 512]
    assert capture_sizes(100)[-3:] == [88, 96, 100]  # the cap itself gets a graph
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(1) == [1]


@pytest.mark.parametrize(
    ("n", "want"), [(1, 1), (3, 4), (4, 4), (5, 8), (9, 16), (17, 24), (24, 24), (25, None)]
)
def test_bucket_is_the_smallest_that_holds_the_batch(n, want):
    assert bucket_for(n, [1, 2, 4, 8, 16, 24]) == want


def item(pos: int, table: list[int], token: int) -> ScheduledSeq:
    return ScheduledSeq(f"r{token}", [token], pos, table, True, Params(), None)


def test_static_inputs_pad_to_the_bucket_and_leave_no_stale_rows():
    inputs = StaticInputs(max_batch=8, width=4, block_size=4, device=torch.device("cpu"))
    first = [item(13, [7, 2, 9, 5], 11), item(0, [3], 12), item(6, [4, 1], 13)]
    assert inputs.fill(first, 4)
    inputs.upload(4)
    ids, pos, slots, lens, starts, tables = inputs.device_views(4)
    assert ids.tolist() == [11, 12, 13, 0] and pos.tolist() == [13, 0, 6, 0]
    assert slots.tolist() == [5 * 4 + 1, 3 * 4 + 0, 1 * 4 + 2, -1]  # padded row: -1, written nowhere
    assert lens.tolist() == [14, 1, 7, 0]  # padded row: length 0, reads nothing
    assert starts.tolist() == [0, 1, 2, 3, 4]
    assert tables[0].tolist() == [7, 2, 9, 5] and tables[2, :2].tolist() == [4, 1]
    # the next step, smaller: the rows it does not use are padding again, not the last step's
    assert inputs.fill([item(1, [8], 21)], 2)
    inputs.upload(2)
    ids, pos, slots, lens, starts, tables = inputs.device_views(2)
    assert ids.tolist() == [21, 0] and slots.tolist() == [8 * 4 + 1, -1] and lens.tolist() == [2, 0]
    assert starts.tolist() == [0, 1, 2] and tables[0, 0] == 8
    assert ids.dtype == pos.dtype == slots.dtype == torch.int64
    assert lens.dtype == starts.dtype == tables.dtype == torch.int32


def test_a_table_wider_than_the_graphs_runs_eagerly():
    inputs = StaticInputs(max_batch=2, width=2, block_size=4, device=torch.device("cpu"))
    assert not inputs.fill([item(9, [1, 2, 3], 1)], 1)


def real_plans(llm: LLM):
    runner = llm.engine.runner
    cfg = runner.model_config
    return lambda b: decode_graph_plans(
        b, runner.max_model_len, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, runner.device
    )


def with_static_graphs(llm: LLM, sizes: list[int], plans=None) -> DecodeGraphs:
    """Give the CPU engine decode "graphs" that replay by re-running the model over the static buffers."""
    runner = llm.engine.runner
    graphs = DecodeGraphs(
        runner.graph_forward(runner.kv_cache),
        sizes,
        block_size=runner.block_size,
        max_model_len=runner.max_model_len,
        plans=plans or real_plans(llm),
        device=runner.device,
        capturer=EagerCapturer(),
    )
    graphs.capture()
    runner.graphs = graphs
    return graphs


LENGTHS = [1, 5, 16, 17, 40, 100, 3]
MAX_TOKENS = [9, 30, 7, 16, 22, 14, 40]


def generate(llm: LLM, batch: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in batch],
        [SamplingParams(temperature=0, max_tokens=m) for m in max_tokens],
    )
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_random_model_dir(tmp_path_factory.mktemp("graphs"), "llama3_scaled")


@pytest.fixture(scope="module")
def batch(tiny):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 290, (n,), generator=g).tolist() for n in LENGTHS]


def test_static_path_gives_the_eager_tokens_across_batch_sizes_and_preemptions(tiny, batch):
    """Batches of 7 down to 1 rows (buckets 1, 2, 4 and the eager path above 4), growing contexts (two
    context classes per bucket), and preemptions from a small pool: every step's inputs are the step's
    own, so the tokens match the eager engine and transformers."""
    kw = dict(device="cpu", dtype="float32", max_model_len=160, enable_prefix_caching=False)
    eager = generate(LLM(str(tiny), **kw), batch, MAX_TOKENS)
    assert eager == hf_greedy(tiny, batch, MAX_TOKENS)
    llm = LLM(str(tiny), num_gpu_blocks_override=14, **kw)
    classes = [DecodeGraphPlan(48, 1, 0), DecodeGraphPlan(160, 1, 0)]
    graphs = with_static_graphs(llm, [1, 2, 4], plans=lambda b: classes)
    assert generate(llm, batch, MAX_TOKENS) == eager
    assert llm.engine.scheduler.num_preemptions > 0
    used = {key for key, n in graphs.replay_counts.items() if n}
    assert {b for b, _ in used} == {1, 2, 4} and {i for _, i in used} == {0, 1}


def test_decode_plans_split_only_small_batches_and_long_contexts():
    cpu = torch.device("cpu")  # 8 "SMs" here: kernels/_backend.py
    short, long = decode_graph_plans(1, 8192, 32, 8, 128, cpu)
    assert (
        short.max_seq_len == SHORT_CONTEXT and short.num_splits == 4 and short.workspace_numel > 0
    )  # 32 programs
    assert long.max_seq_len == 8192 and long.num_splits > 1 and long.workspace_numel > 0
    assert decode_graph_plans(64, 8192, 32, 8, 128, cpu) == [DecodeGraphPlan(8192, 1, 0)]
    assert decode_graph_plans(1, 256, 32, 8, 128, cpu) == [DecodeGraphPlan(256, 1, 0)]


def test_fp8_plans_aim_at_twice_the_programs_within_one_wave():
    cpu = torch.device("cpu")  # 8 "SMs": a 16-bit cache aims at 32 programs, an fp8 cache at 64
    assert plan_num_splits(1, 3, 8192, cpu) == 11  # 33 programs: rounded up
    assert plan_num_splits(1, 3, 8192, cpu, fp8=True) == 21  # 63: rounded down, none in a second wave
    assert plan_num_splits(4, 8, 8192, cpu) == 1 and plan_num_splits(4, 8, 8192, cpu, fp8=True) == 2
    short, long = decode_graph_plans(1, 8192, 32, 8, 128, cpu, fp8=True)
    assert (short.num_splits, long.num_splits) == (4, 8)  # the short class plans as a 16-bit cache's
    assert long.workspace_numel == decode_workspace_size(1, 32, 8, 128)
    assert decode_graph_plans(8, 8192, 32, 8, 128, cpu, fp8=True) == [DecodeGraphPlan(8192, 1, 0)]
    # one-warp programs only from 4 an SM: fewer plan, and run, as a 16-bit cache's
    assert not fp8_one_warp(31, cpu) and fp8_one_warp(32, cpu)
    assert plan_num_splits(1, 2, 1024, cpu, fp8=True) == plan_num_splits(1, 2, 1024, cpu) == 4  # 8 programs


def test_cpu_engine_captures_nothing(tiny):
    llm = LLM(str(tiny), device="cpu", dtype="float32", max_model_len=64)
    assert llm.engine.runner.graphs is None


def test_enforce_eager_reaches_the_engine_config_from_the_command_line():
    from engine.args import engine_kwargs
    from serving.cli import build_parser

    parser = build_parser()
    assert engine_kwargs(parser.parse_args(["generate", "hi", "--enforce-eager"]))["enforce_eager"] is True
    assert engine_kwargs(parser.parse_args(["generate", "hi"]))["enforce_eager"] is False
    assert engine_kwargs(parser.parse_args(["decode", "--enforce-eager"]))["enforce_eager"] is True
    from serving.roles import worker_config

    args = parser.parse_args(["decode", "--enforce-eager"])
    assert worker_config(args, "decode").engine.enforce_eager is True


def test_narrow_kv_heads_split_short_contexts_too(monkeypatch):
    """SmolLM2's 3 x 64 kv heads: both classes split at batch 1; forcing the short class unsplit (the
    benchmark's A-B) leaves the long one split."""
    cpu = torch.device("cpu")
    short, long = decode_graph_plans(1, 8192, 9, 3, 64, cpu)
    assert short.max_seq_len == SHORT_CONTEXT and short.num_splits > 1 and short.workspace_numel > 0
    assert long.num_splits > 1
    monkeypatch.setattr(attention, "SHORT_SPLIT", False)
    short, long = decode_graph_plans(1, 8192, 9, 3, 64, cpu)
    assert short == DecodeGraphPlan(SHORT_CONTEXT, 1, 0) and long.num_splits > 1
