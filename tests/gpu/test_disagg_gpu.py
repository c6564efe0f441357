"""Two processes on one GPU: a prefill and a decode worker over cuda_ipc give the single-process
engine's greedy tokens."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from engine import LLM, SamplingParams
from tests.cluster import collect, greedy_request, start_cluster
from tests.hf_reference import tiny_random_model_dir

LENGTHS = [1, 9, 16, 33, 120, 200]
MAX_TOKENS = [8, 12, 6, 15, 10, 9]


def test_cuda_ipc_cluster_matches_single_process(tmp_path):
    model = tiny_random_model_dir(tmp_path, "llama")
    g = torch.Generator().manual_seed(3)
    batch = [torch.randint(3, 250, (n,), generator=g).tolist() for n in LENGTHS]
    llm = LLM(str(model), device="cuda", dtype="float32", max_model_len=256, gpu_memory_utilization=0.05)
    want = [
        o.outputs[0].token_ids
        for o in llm.generate(
            [{"prompt_token_ids": p} for p in batch],
            [SamplingParams(temperature=0, max_tokens=m) for m in MAX_TOKENS],
        )
    ]
    del llm
    torch.cuda.empty_cache()
    cluster = start_cluster(
        1,
        1,
        "cuda_ipc",
        "--model",
        str(model),
        "--device",
        "cuda",
        "--gpu-memory-utilization",
        "0.05",
        "--max-model-len",
        "256",
    )
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
