"""`pdserve up` with tensor-parallel workers on CPU (ranks over gloo, KV over tcp): a prefill worker at TP 2
feeding a decode worker at TP 1 gives the single engine's tokens and leaks nothing; a decode worker whose
rank is killed ends its streams with UNAVAILABLE within 5 s."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from engine import LLM, SamplingParams
from tests.cluster import Stream, collect, greedy_request, start_cluster
from tests.hf_reference import tiny_random_model_dir

pytestmark = pytest.mark.slow

PROMPTS = [list(range(10, 50)), [3, 4, 5, 6, 7], list(range(60, 80)), [200, 201, 202]]
MAX_TOKENS = [8, 6, 7, 5]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """The tiny random Llama: 4 query heads, 2 KV heads (one per rank at TP 2)."""
    return tiny_random_model_dir(tmp_path_factory.mktemp("tp-cluster"))


def rank_pids(worker_pid: int) -> list[int]:
    """The tensor-parallel rank processes under a worker (its engine process's children)."""
    parents: dict[int, int] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            parents[int(entry)] = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
    tree, frontier = set(), {worker_pid}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - tree
        tree |= frontier
    out = []
    for pid in sorted(tree):
        try:
            if b"engine.tp.worker" in Path(f"/proc/{pid}/cmdline").read_bytes():
                out.append(pid)
        except OSError:
            continue
    return out


def test_prefill_at_tp2_to_decode_at_tp1_equals_the_single_engine(model: Path) -> None:
    single = LLM(str(model), device="cpu", dtype="float32", cpu_kv_cache_space=0.01)
    params = [SamplingParams(temperature=0.0, max_tokens=m) for m in MAX_TOKENS]
    expected = [
        o.outputs[0].token_ids for o in single.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    ]
    cluster = start_cluster(1, 1, "tcp", "--model", str(model), "--prefill-tp", "2", "--max-model-len", "256")
    try:
        (prefill,) = [w for w in cluster.workers if w["role"] == "prefill"]
        assert len(rank_pids(prefill["pid"])) == 1  # rank 1 beside the engine process's rank 0
        stub = cluster.stub()
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            results = list(
                pool.map(lambda a: collect(stub.Generate(greedy_request(*a))), zip(PROMPTS, MAX_TOKENS))
            )
        assert [tokens[0] for tokens, _, _ in results] == expected
        cluster.wait_all_blocks_free()
    finally:
        cluster.stop()


def test_a_killed_decode_rank_ends_its_streams_within_5_s(model: Path) -> None:
    cluster = start_cluster(0, 1, "tcp", "--model", str(model), "--decode-tp", "2", "--max-model-len", "256")
    try:
        (decode,) = cluster.workers
        (rank1,) = rank_pids(decode["pid"])
        stub = cluster.stub()
        streams = [Stream(stub, greedy_request(p[:8], 240, ignore_eos=True)) for p in PROMPTS]
        deadline = time.monotonic() + 60
        while not all(s.tokens for s in streams):  # every stream is decoding
            assert time.monotonic() < deadline and not any(s.error for s in streams)
            time.sleep(0.01)
        os.kill(rank1, signal.SIGKILL)
        killed = time.monotonic()
        for s in streams:
            s.join(timeout=10)
            assert s.error is not None and s.error.code() == grpc.StatusCode.UNAVAILABLE, s.tokens
            assert len(s.tokens) < 240
        assert time.monotonic() - killed < 5
    finally:
        cluster.stop()
