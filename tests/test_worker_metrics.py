"""A worker's Prometheus /metrics under vLLM's names (serving/worker_metrics.py), on `pdserve up` with the
bundled model: plausible values during and after traffic, and the counts the traffic implies."""

from __future__ import annotations

import re
import time

import httpx
import pytest

from tests.cluster import collect, greedy_request, start_cluster

pytestmark = pytest.mark.slow  # a cluster with the real model


def scrape(port: int) -> dict[str, float]:
    """Every pdserve: sample, keyed by name plus its labels other than model_name."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    out = {}
    for line in text.splitlines():
        m = re.match(r"(pdserve:\w+)\{([^}]*)\} (\S+)$", line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            assert labels.pop("model_name") == "SmolLM2-135M-Instruct"
            extra = "".join(f"{{{k}={v}}}" for k, v in labels.items())
            out[m.group(1) + extra] = float(m.group(3))
    return out


def wait_for(port: int, check, timeout: float = 10.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(port)
        if check(samples) or time.monotonic() > deadline:
            return samples
        time.sleep(0.1)


def test_workers_export_vllm_named_metrics(bundled_model_dir):
    from engine.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(bundled_model_dir)
    system = tok.encode("You are a careful assistant who answers briefly and checks every fact. " * 4)[:64]
    cluster = start_cluster(1, 1, "tcp", "--metrics")
    try:
        prefill = next(w for w in cluster.workers if w["role"] == "prefill")["metrics_port"]
        decode = next(w for w in cluster.workers if w["role"] == "decode")["metrics_port"]
        before = scrape(prefill)
        assert before["pdserve:kv_cache_usage_perc"] == 0.0 and before["pdserve:num_requests_running"] == 0
        stub = cluster.stub()
        completions = []
        for i in range(4):  # one system prompt, four questions: the later ones hit its cached blocks
            ids = system + tok.encode(f" Question {i}: what is {i} plus {i}?")
            completions.append(collect(stub.Generate(greedy_request(ids, 6, ignore_eos=True), timeout=60))[2])
        generated = sum(u.completion_tokens for u in completions)
        cluster.wait_all_blocks_free()
        p = wait_for(prefill, lambda s: s.get("pdserve:prefix_cache_hits_total", 0) > 0)
        d = wait_for(decode, lambda s: s.get("pdserve:request_success_total{finished_reason=length}", 0) == 4)
        assert (
            p["pdserve:prefix_cache_hits_total"] >= 3 * 48
        )  # three repeats, three full blocks each at least
        assert p["pdserve:prefix_cache_queries_total"] >= p["pdserve:prefix_cache_hits_total"]
        prompt = sum(u.prompt_tokens for u in completions)
        assert p["pdserve:prompt_tokens_total"] == prompt  # every prompt admitted once
        assert p["pdserve:generation_tokens_total"] == 4  # each prompt's first token
        assert d["pdserve:generation_tokens_total"] == generated - 4  # the rest, on the decode worker
        assert d["pdserve:request_success_total{finished_reason=length}"] == 4
        assert d["pdserve:num_preemptions_total"] == 0
        for port in (prefill, decode):  # idle again: nothing running, no block held
            idle = wait_for(
                port,
                lambda s: s["pdserve:kv_cache_usage_perc"] == 0 and s["pdserve:num_requests_running"] == 0,
            )
            assert idle["pdserve:kv_cache_usage_perc"] == 0.0 and idle["pdserve:num_requests_waiting"] == 0
    finally:
        cluster.stop()
