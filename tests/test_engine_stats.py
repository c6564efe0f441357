"""The engine's histograms (engine/stats.py), the `vllm:` mirror of a registry (serving/metrics_compat.py),
and `LLM.get_metrics()` on the bundled model: exact bucket counts, and series that match the traffic."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from engine.stats import HISTOGRAMS, ITL_BUCKETS, EngineStats, RequestTimes
from engine.stats import Histogram as Buckets
from serving.metrics_compat import add_compat
from serving.worker_metrics import EngineMetrics, generation_rate


def test_histogram_buckets_are_prometheus_le() -> None:
    h = Buckets((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 1.0, 3.0):
        h.observe(v)
    assert h.counts == [2, 2, 1]  # a value on a bound falls in that bucket (le)
    assert h.cumulative() == [(0.1, 2), (1.0, 4), (float("inf"), 5)]
    assert h.count == 5 and h.sum == pytest.approx(4.65)


def test_request_lifecycle_observes_each_latency_once(monkeypatch) -> None:
    clock = iter([1.0, 1.5, 1.7, 2.0, 4.0])
    monkeypatch.setattr("engine.stats.time.monotonic", lambda: next(clock))
    stats, times = EngineStats(), RequestTimes()
    stats.scheduled(times, arrival=0.5)  # t=1.0
    stats.scheduled(times, arrival=0.5)  # preempted and readmitted: not a second queue time
    stats.tokens(times, arrival=0.5)  # t=1.5: the first token
    stats.tokens(times, arrival=0.5)  # t=1.7
    stats.tokens(times, arrival=0.5)  # t=2.0
    stats.finished(times, arrival=0.5, num_output_tokens=3)  # t=4.0
    snap = {name: (total, count) for name, (_, _, total, count) in stats.snapshot().items()}
    assert snap["request_queue_time_seconds"] == (pytest.approx(0.5), 1)
    assert snap["time_to_first_token_seconds"] == (pytest.approx(1.0), 1)
    assert snap["inter_token_latency_seconds"] == (pytest.approx(0.5), 2)
    assert snap["request_prefill_time_seconds"] == (pytest.approx(0.5), 1)
    assert snap["request_decode_time_seconds"] == (pytest.approx(2.5), 1)
    assert snap["request_time_per_output_token_seconds"] == (pytest.approx(1.25), 1)
    assert snap["e2e_request_latency_seconds"] == (pytest.approx(3.5), 1)
    assert HISTOGRAMS["inter_token_latency_seconds"][0] == ITL_BUCKETS


def test_aborted_before_its_first_token_observes_no_latency() -> None:
    stats, times = EngineStats(), RequestTimes()
    stats.scheduled(times, arrival=0.0)
    stats.finished(times, arrival=0.0, num_output_tokens=0)
    assert stats.histograms["e2e_request_latency_seconds"].count == 0


def test_compat_mirror_serves_every_series_under_vllm_too() -> None:
    registry = CollectorRegistry()
    Counter("pdserve:things", "Things", ["kind"], registry=registry).labels("a").inc(3)
    Histogram("pdserve:waits_seconds", "Waits", buckets=(1.0,), registry=registry).observe(0.5)
    text = generate_latest(add_compat(registry, "vllm")).decode()
    for prefix in ("pdserve:", "vllm:"):
        assert f'{prefix}things_total{{kind="a"}} 3.0' in text
        assert f'{prefix}waits_seconds_bucket{{le="1.0"}} 1.0' in text
        assert f"{prefix}waits_seconds_count 1.0" in text
    assert add_compat(registry, None) is registry


def test_worker_compat_names_older_guides_use() -> None:
    load = {"num_running": 1, "num_waiting": 0, "num_free_blocks": 30, "num_total_blocks": 40}
    counters = {
        "generation_tokens": 50,
        "spec_decode_num_draft_tokens": 8,
        "spec_decode_num_accepted_tokens": 6,
    }
    history = [(10.0, {"generation_tokens": 10}), (12.0, {"generation_tokens": 50})]
    registry = CollectorRegistry()
    registry.register(
        EngineMetrics(lambda: load, lambda: counters, "m", dict, "decode", "vllm", lambda: history)
    )
    text = generate_latest(registry).decode()
    assert 'vllm:gpu_cache_usage_perc{model_name="m"} 0.25' in text
    assert 'vllm:kv_cache_usage_perc{model_name="m"} 0.25' in text
    assert 'pdserve:kv_cache_usage_perc{model_name="m"} 0.25' in text
    assert 'vllm:avg_generation_throughput{model_name="m"} 20.0' in text
    assert 'vllm:speculative_accept_rate{model_name="m"} 0.75' in text
    assert "pdserve:gpu_cache_usage_perc" not in text
    assert generation_rate(history[:1]) == 0.0


@pytest.mark.slow
def test_llm_get_metrics_counts_the_traffic() -> None:
    from engine import LLM, SamplingParams
    from engine.metrics_reader import Counter as C
    from engine.metrics_reader import Gauge as G
    from engine.metrics_reader import Histogram as H

    llm = LLM(dtype="float32", device="cpu", max_model_len=512)
    system = "You are a careful assistant who answers briefly and checks every fact. " * 4
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    llm.generate([system + "What is 1 plus 1?"], params)
    outs = llm.generate([system + f"What is {i} plus {i}?" for i in (2, 3)], params)
    assert all(o.metrics is not None and o.metrics.first_token_time is not None for o in outs)
    metrics = {m.name: m for m in llm.get_metrics()}
    assert all(m.labels["model_name"] == "SmolLM2-135M-Instruct" for m in metrics.values())
    ttft = metrics["pdserve:time_to_first_token_seconds"]
    assert isinstance(ttft, H) and ttft.count == 3 and ttft.buckets["+Inf"] == 3 and ttft.sum > 0
    assert metrics["pdserve:inter_token_latency_seconds"].count == 3 * 4
    assert metrics["pdserve:e2e_request_latency_seconds"].count == 3
    gen = metrics["pdserve:generation_tokens"]
    assert isinstance(gen, C) and gen.value == 15
    assert metrics["pdserve:prefix_cache_hits"].value > 0  # the system prompt's blocks, twice
    usage = metrics["pdserve:kv_cache_usage_perc"]
    assert isinstance(usage, G) and usage.value == 0.0
