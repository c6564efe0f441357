"""Tensor parallelism on the CPU: N rank processes over gloo (engine/tp/). Greedy output at TP 2 and TP 3
equals TP 1 and transformers, with the KV heads split or replicated; settings that cannot split fail
before any rank starts; a rank killed mid-run fails the run within 5 s and leaves no process behind."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.tp.heads import kv_head_ranges, shard_heads
from engine.tp.launch import check_devices
from engine.tp.ranks import TensorParallelError
from serving.gpus import assign_gpus, cpu_threads
from tests.hf_reference import hf_greedy, tiny_random_model_dir

PROMPTS = [list(range(5, 45)), [7, 8, 9], [100, 101, 102, 103, 104, 105, 106]]  # the first: 3 blocks
MAX_TOKENS = [12, 9, 7]


def rank_processes() -> list[int]:
    """The pids of this process's tensor-parallel rank children still alive (zombies included)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == os.getpid() and b"engine.tp.worker" in cmdline:
            pids.append(int(entry))
    return pids


def make(model: Path | None, tp: int, **kwargs) -> LLM:
    kwargs.setdefault("cpu_kv_cache_space", 0.01)
    model_path = None if model is None else str(model)
    return LLM(model_path, device="cpu", dtype="float32", tensor_parallel_size=tp, **kwargs)


@contextlib.contextmanager
def engine(model: Path | None, tp: int, **kwargs) -> Iterator[LLM]:
    llm = make(model, tp, **kwargs)
    try:
        yield llm
    finally:
        llm.engine.shutdown()


def generate(llm: LLM, params: list[SamplingParams], prompts=PROMPTS) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs]


def greedy(max_tokens: list[int] = MAX_TOKENS) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=m) for m in max_tokens]


def assert_no_leak(llm: LLM) -> None:
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not llm.engine.scheduler.has_unfinished()


@pytest.fixture(scope="module")
def kv8(tmp_path_factory) -> Path:
    """A tiny random Llama with 8 query and 8 KV heads."""
    return tiny_random_model_dir(tmp_path_factory.mktemp("tp"), num_attention_heads=8, num_key_value_heads=8)


def test_tp2_over_8_kv_heads_equals_tp1_and_transformers(kv8: Path) -> None:
    expected = hf_greedy(kv8, PROMPTS, MAX_TOKENS)
    single = make(kv8, 1)
    assert generate(single, greedy()) == expected
    # sampled rows: seeded, unseeded (the engine's seed draws theirs), and a penalty (its history)
    sampled = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=10),
        SamplingParams(temperature=1.0, max_tokens=10),
        SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=10),
    ]
    with engine(kv8, 2, max_num_batched_tokens=32) as llm:  # the 40-token prompt runs in two chunks
        assert llm.engine.runner.kv_cache.shape[4] == 4  # each rank holds 4 of the 8 KV heads
        assert generate(llm, greedy()) == expected
        assert generate(llm, sampled) == generate(single, sampled)
        assert_no_leak(llm)
    assert rank_processes() == []


def test_qwen3_at_tp2_equals_transformers(tmp_path: Path) -> None:
    """q and k normed per head (one weight for every head, on every rank), head_dim 32 against hidden / heads 16."""
    model = tiny_random_model_dir(tmp_path, "qwen3")
    with engine(model, 2) as llm:
        assert llm.engine.runner.kv_cache.shape[4:] == (1, 32)  # each rank: 1 of the 2 KV heads, 32 wide
        assert generate(llm, greedy()) == hf_greedy(model, PROMPTS, MAX_TOKENS)
        assert_no_leak(llm)
    assert rank_processes() == []


def test_phi3_fused_checkpoint_at_tp2_equals_transformers(tmp_path: Path) -> None:
    """Phi-3's fused qkv_proj and gate_up_proj tensors are split before each rank takes its slice."""
    model = tiny_random_model_dir(tmp_path, "phi3")
    with engine(model, 2) as llm:
        assert generate(llm, greedy()) == hf_greedy(model, PROMPTS, MAX_TOKENS)
        assert_no_leak(llm)
    assert rank_processes() == []


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_int4_checkpoint_at_tp2_equals_transformers_on_its_dequantized_weights(
    tmp_path: Path, method: str
) -> None:
    """quantization= with tensor_parallel_size 2: each rank loads its slice of the packed tensors (a column-parallel
    layer's output words, a row-parallel one's whole groups) and serves what transformers does on the checkpoint
    dequantized."""
    from engine.quantize import QuantizeConfig, quantize
    from tests.quant_checkpoints import dequantized_copy

    model = tiny_random_model_dir(tmp_path, "llama", intermediate_size=256)
    config = QuantizeConfig(str(model), str(tmp_path / method), method=method, group_size=32, max_tokens=256)
    ckpt = quantize(config)
    expected = hf_greedy(dequantized_copy(ckpt, tmp_path / "dense"), PROMPTS, MAX_TOKENS)
    with engine(ckpt, 2, quantization=method) as llm:
        assert generate(llm, greedy()) == expected
        assert_no_leak(llm)
    assert rank_processes() == []


def test_gguf_at_tp2_equals_transformers_on_its_dequantized_weights(tmp_path: Path, monkeypatch) -> None:
    """A GGUF file's Q4_0 / Q4_1 / Q8_0 layers kept quantized on each rank (its slice of the blocks)."""
    from engine.bundled import gguf_model_dir
    from tests.quant_checkpoints import write_gguf

    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "tiny.gguf"
    write_gguf(tiny_random_model_dir(tmp_path, "llama"), gguf)
    expected = hf_greedy(gguf_model_dir(gguf), PROMPTS, MAX_TOKENS)
    with engine(gguf, 2, quantization="gguf") as llm:
        assert generate(llm, greedy()) == expected
        assert_no_leak(llm)
    assert rank_processes() == []


@pytest.mark.slow
def test_bundled_model_at_tp3_equals_transformers(bundled_model_dir: Path) -> None:
    from engine.tokenizer import Tokenizer

    prompts = [Tokenizer.from_dir(bundled_model_dir).encode("The capital of France is")]
    expected = hf_greedy(bundled_model_dir, prompts, [5])
    # 9 heads and 3 KV heads: 3 and 1 on each rank
    with engine(None, 3, max_model_len=64, cpu_kv_cache_space=0.02) as llm:
        assert generate(llm, greedy([5]), prompts) == expected
        assert_no_leak(llm)
    assert rank_processes() == []


def test_bundled_model_at_tp2_is_refused_before_any_rank_starts(bundled_model_dir: Path) -> None:
    with pytest.raises(
        ValueError, match=r"num_attention_heads \(9\) is not divisible by tensor_parallel_size 2"
    ):
        make(None, 2)
    assert rank_processes() == []


def test_more_ranks_than_gpus_is_refused_naming_both_counts() -> None:
    with pytest.raises(ValueError, match=r"tensor_parallel_size 4 is larger than the 2 visible GPU"):
        check_devices(4, torch.device("cuda"), 2)
    check_devices(2, torch.device("cuda"), 2)
    check_devices(4, torch.device("cpu"), 0)  # ranks over gloo need no GPU


def test_workers_get_a_gpu_per_rank_in_order() -> None:
    workers = [("prefill", 2), ("decode", 1), ("decode", 1)]
    assert assign_gpus(list("0123"), workers, "tcp") == ["0,1", "2", "3"]
    # cuda_ipc: a prefill worker's ranks map the decode workers' pools, so it lists their GPUs after its own
    assert assign_gpus(list("0123"), workers, "cuda_ipc") == ["0,1,2,3", "2", "3"]
    assert assign_gpus([], workers, "tcp") == [None] * 3  # no GPU: ranks over gloo on the CPU
    # fewer GPUs than ranks: workers share them round-robin, a worker's own ranks never
    assert assign_gpus(list("01"), workers, "cuda_ipc") == ["0,1", "0", "1"]
    assert assign_gpus(["0"], [("prefill", 1), ("decode", 1)], "tcp") == ["0", "0"]
    with pytest.raises(ValueError, match=r"tensor parallel size 4 needs 4 GPUs, 3 are visible"):
        assign_gpus(list("012"), [("decode", 4)], "tcp")


def test_cpu_engines_share_the_cores_unless_the_user_set_threads(monkeypatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    assert [cpu_threads(n) for n in (1, 2, 3, 4, 16, 40)] == ["16", "8", "5", "4", "1", "1"]
    monkeypatch.setenv("OMP_NUM_THREADS", "6")
    assert cpu_threads(4) is None  # theirs stands


def test_head_shares() -> None:
    assert kv_head_ranges(8, 2) == [range(0, 4), range(4, 8)]
    assert kv_head_ranges(2, 4) == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    rank = shard_heads(32, 8, 16, 5)  # 2 query heads a rank; KV head 2 serves query heads 8-11
    assert (rank.num_heads, rank.head_start, rank.num_kv_heads, rank.kv_head_start) == (2, 10, 1, 2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3 exceeds num_key_value_heads \(2\)"):
        shard_heads(6, 2, 3, 0)


def test_replicated_kv_heads_then_a_killed_rank_fails_the_run_within_5_s(tmp_path: Path) -> None:
    model = tiny_random_model_dir(
        tmp_path, num_attention_heads=6, num_key_value_heads=1, hidden_size=48, intermediate_size=96
    )
    llm = make(model, 3)
    # 3 ranks, 1 KV head: each rank holds 2 query heads and a copy of the KV head
    assert llm.engine.runner.kv_cache.shape[4] == 1
    assert generate(llm, greedy()) == hf_greedy(model, PROMPTS, MAX_TOKENS)
    victim, other = llm.engine.ranks.pids  # ranks 1 and 2
    killed: dict[str, float] = {}

    def kill_once_decoding() -> None:
        deadline = time.monotonic() + 120
        start = llm.engine.scheduler.num_generation_tokens
        while llm.engine.scheduler.num_generation_tokens < start + 3 and time.monotonic() < deadline:
            time.sleep(0.005)
        killed["at"] = time.monotonic()
        os.kill(victim, signal.SIGKILL)

    thread = threading.Thread(target=kill_once_decoding)
    thread.start()
    try:
        with pytest.raises(TensorParallelError, match=rf"rank 1 \(pid {victim}\) was killed by signal 9"):
            generate(llm, [SamplingParams(max_tokens=200, ignore_eos=True)] * 3)
        assert time.monotonic() - killed["at"] < 5
        with pytest.raises(TensorParallelError):  # the engine refuses further steps at once
            generate(llm, greedy())
        deadline = time.monotonic() + 5
        while other in rank_processes() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert other not in rank_processes()
    finally:
        thread.join()
        llm.engine.shutdown()
    assert rank_processes() == []
