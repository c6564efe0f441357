"""Swap space and fp8 KV cache settings on a tiny random model: bad values give clear errors, the fp8 cache
holds more tokens in the same memory (and the sizing log line says so), calibrated scales follow
transformers' own K and V, the flags reach the engine's config, and the worker exports the swap series."""

from __future__ import annotations

import logging

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from engine import LLM
from engine.args import engine_kwargs
from engine.kv_scales import CALIBRATION_TEXT, HEADROOM
from kernels.kv_quant import FP8_MAX
from serving.cli import build_parser
from serving.worker_metrics import EngineMetrics
from tests.hf_reference import hf_model, tiny_random_model_dir


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_random_model_dir(tmp_path_factory.mktemp("kvmem"), "llama")


def make(tiny, **kw) -> LLM:
    return LLM(str(tiny), device="cpu", dtype="float32", max_model_len=128, **kw)


@pytest.mark.parametrize(
    "kw,message",
    [
        ({"kv_cache_dtype": "int3"}, "kv_cache_dtype must be one of"),
        ({"kv_cache_dtype": "fp8_e5m2"}, "kv_cache_dtype must be one of"),
        ({"calculate_kv_scales": True}, "calculate_kv_scales needs an fp8 KV cache"),
        ({"preemption_mode": "sometimes"}, "preemption_mode must be one of"),
        ({"swap_space": -1.0}, "swap_space must be a number of GiB >= 0"),
        ({"swap_space": float("nan")}, "swap_space must be a number of GiB >= 0"),
        ({"preemption_mode": "swap"}, "preemption_mode='swap' needs swap space"),
        ({"swap_space": 1e-9}, "holds no KV block"),
    ],
)
def test_bad_values_are_refused_clearly(tiny, kw, message):
    with pytest.raises(ValueError, match=message):
        make(tiny, **kw)


def test_the_flags_reach_the_engine_config():
    args = build_parser().parse_args(
        ["generate", "hi", "--swap-space", "4", "--preemption-mode", "swap", "--kv-cache-dtype", "fp8"]
        + ["--calculate-kv-scales"]
    )
    kw = engine_kwargs(args)
    assert (kw["swap_space"], kw["preemption_mode"], kw["kv_cache_dtype"], kw["calculate_kv_scales"]) == (
        4.0, "swap", "fp8", True,
    )  # fmt: skip
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "hi", "--kv-cache-dtype", "int3"])


def test_fp8_cache_holds_four_times_the_fp32_tokens_and_says_so(tiny, caplog):
    with caplog.at_level(logging.INFO, logger="engine"):
        fp8 = make(tiny, kv_cache_dtype="fp8", cpu_kv_cache_space=0.01)
    plain = make(tiny, cpu_kv_cache_space=0.01)
    assert fp8.engine.block_manager.num_blocks // 4 == plain.engine.block_manager.num_blocks  # same bytes
    sizing = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache:"))
    tokens = fp8.engine.block_manager.num_blocks * 16
    assert f"{tokens} tokens" in sizing and "float8_e4m3fn: 4x the tokens float32 would hold" in sizing
    assert any("K and V scales 1.0" in r.getMessage() for r in caplog.records)
    assert fp8.engine.runner.bytes_per_block() * 4 == plain.engine.runner.bytes_per_block()


def test_calibrated_scales_follow_transformers_k_and_v(tiny):
    llm = make(tiny, kv_cache_dtype="fp8", calculate_kv_scales=True)
    ids = llm.tokenizer.encode(CALIBRATION_TEXT)[:128]
    with torch.no_grad():
        cache = hf_model(tiny)(torch.tensor([ids]), use_cache=True).past_key_values
    amax = torch.tensor([[layer.keys.abs().max(), layer.values.abs().max()] for layer in cache.layers])
    torch.testing.assert_close(llm.engine.kv_scales, amax * HEADROOM / FP8_MAX, rtol=1e-4, atol=0)
    attn = llm.engine.runner.model.model.layers[1].self_attn.attn
    assert torch.equal(attn.kv_scale, llm.engine.kv_scales[1])


def test_worker_exports_the_swap_series():
    load = {"num_total_blocks": 40, "num_free_blocks": 40, "num_cpu_blocks": 10, "num_free_cpu_blocks": 4,
            "num_swapped": 2}  # fmt: skip
    counters = {"num_preemptions": 5, "num_preemptions_by_mode/swap": 3, "num_preemptions_by_mode/recompute": 2,
                "kv_swap_out_bytes": 4096, "kv_swap_in_seconds": 0.25}  # fmt: skip
    registry = CollectorRegistry()
    registry.register(EngineMetrics(lambda: load, lambda: counters, "m"))
    text = generate_latest(registry).decode()
    for line in (
        'pdserve:cpu_cache_usage_perc{model_name="m"} 0.6',
        'pdserve:num_requests_swapped{model_name="m"} 2.0',
        'pdserve:num_preemptions_by_mode_total{mode="swap",model_name="m"} 3.0',
        'pdserve:num_preemptions_by_mode_total{mode="recompute",model_name="m"} 2.0',
        'pdserve:kv_swap_out_bytes_total{model_name="m"} 4096.0',
        'pdserve:kv_swap_in_seconds_total{model_name="m"} 0.25',
    ):
        assert line in text, line
