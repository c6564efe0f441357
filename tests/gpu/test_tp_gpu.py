"""Tensor parallelism over NCCL on 2 GPUs: TP 2 greedy equals TP 1 (a tiny checkpoint against transformers,
and the Llama-3-8B shape's random weights in fp32 against the engine at TP 1), with the decode steps
replayed from CUDA graphs that hold the all-reduces; a prefill worker at TP 2 feeding a decode worker at
TP 1 over cuda_ipc gives the single engine's tokens; a rank killed mid-run fails the run within 5 s (the
NCCL group is aborted, nothing waits on the dead rank)."""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from engine import LLM, SamplingParams
from engine.tp.ranks import TensorParallelError
from tests.cluster import collect, greedy_request, start_cluster
from tests.hf_reference import hf_greedy, tiny_random_model_dir

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")

LENGTHS = [1, 9, 16, 33, 120, 200]
MAX_TOKENS = [8, 12, 6, 15, 10, 9]


def prompts(vocab: int, lengths: list[int] = LENGTHS, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab - 3, (n,), generator=g).tolist() for n in lengths]


def greedy(llm: LLM, batch: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in batch],
        [SamplingParams(temperature=0, max_tokens=m) for m in max_tokens],
    )
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    return [o.outputs[0].token_ids for o in outs]


def run(model: str, batch: list[list[int]], max_tokens: list[int], **kwargs) -> tuple[list[list[int]], int]:
    """(greedy tokens, decode graph replays) of an engine made for this call; its memory is freed after."""
    llm = LLM(model, **kwargs)
    try:
        tokens = greedy(llm, batch, max_tokens)
        graphs = llm.engine.runner.graphs
        return tokens, graphs.num_replays if graphs is not None else 0
    finally:
        llm.engine.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()


def test_tiny_model_at_tp2_equals_transformers_with_graphs_replayed(tmp_path) -> None:
    model = tiny_random_model_dir(tmp_path, num_attention_heads=8, num_key_value_heads=8)
    batch = prompts(250)
    kwargs = dict(tensor_parallel_size=2, dtype="float32", max_model_len=256, gpu_memory_utilization=0.1)
    tokens, replays = run(str(model), batch, MAX_TOKENS, **kwargs)
    assert tokens == hf_greedy(model, batch, MAX_TOKENS)
    assert replays > 0  # decode steps replayed from graphs, their all-reduces inside


def test_llama3_8b_shape_at_tp2_equals_tp1() -> None:
    kwargs = dict(
        load_format="dummy", dtype="float32", max_model_len=512, max_num_seqs=8, gpu_memory_utilization=0.6
    )
    batch = prompts(128256, [7, 64, 200, 33])
    max_tokens = [16, 12, 16, 10]
    want, _ = run("Llama-3-8B", batch, max_tokens, **kwargs)
    tokens, replays = run("Llama-3-8B", batch, max_tokens, tensor_parallel_size=2, **kwargs)
    assert tokens == want and replays > 0


def test_prefill_at_tp2_feeds_decode_at_tp1_over_cuda_ipc(tmp_path) -> None:
    model = tiny_random_model_dir(tmp_path, num_attention_heads=8, num_key_value_heads=8)
    batch = prompts(250)
    want, _ = run(
        str(model), batch, MAX_TOKENS, dtype="float32", max_model_len=256, gpu_memory_utilization=0.05
    )
    # the prefill worker's ranks on GPUs 0 and 1, the decode worker on GPU 0 (shared): rank 0's lane is a
    # copy on one GPU, rank 1's a peer copy, each into its half of the decode pool's heads
    cluster = start_cluster(
        1, 1, "cuda_ipc", "--model", str(model), "--device", "cuda", "--gpu-memory-utilization", "0.05",
        "--max-model-len", "256", "--prefill-tp", "2",
    )  # fmt: skip
    try:
        stub = cluster.stub()
        with ThreadPoolExecutor(len(batch)) as pool:
            got = list(
                pool.map(lambda a: collect(stub.Generate(greedy_request(*a)))[0][0], zip(batch, MAX_TOKENS))
            )
        assert got == want
        cluster.wait_all_blocks_free()
    finally:
        cluster.stop()


def test_a_killed_rank_fails_the_run_within_5_s(tmp_path) -> None:
    model = tiny_random_model_dir(tmp_path, num_attention_heads=8, num_key_value_heads=8)
    llm = LLM(
        str(model), tensor_parallel_size=2, dtype="float32", max_model_len=256, gpu_memory_utilization=0.1
    )
    (victim,) = llm.engine.ranks.pids
    killed: dict[str, float] = {}

    def kill_once_decoding() -> None:
        deadline = time.monotonic() + 60
        while llm.engine.scheduler.num_generation_tokens < 20 and time.monotonic() < deadline:
            time.sleep(0.001)
        killed["at"] = time.monotonic()
        os.kill(victim, signal.SIGKILL)

    thread = threading.Thread(target=kill_once_decoding)
    thread.start()
    try:
        with pytest.raises(TensorParallelError, match=r"rank 1 .* was killed by signal 9"):
            llm.generate(
                [{"prompt_token_ids": p} for p in prompts(250)],
                SamplingParams(temperature=0, max_tokens=200, ignore_eos=True),
            )
        assert time.monotonic() - killed["at"] < 5
    finally:
        thread.join()
        llm.engine.shutdown()
