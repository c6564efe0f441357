"""Every service's /metrics on `pdserve up --metrics` (one prefill, one decode worker over tcp, the bundled
model, n-gram speculation on the decode worker), once per naming: `pdserve:` alone, and with
`--metrics-compat vllm` the same series under `vllm:` too. The traffic is one system prompt and four
questions through the router; the series must say what that traffic implies, and every PromQL expression
of the Grafana dashboard (docs/grafana/pdserve.json) must name series the stack exports."""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path

import httpx
import pytest

from tests.cluster import Cluster, start_cluster

pytestmark = pytest.mark.slow  # a cluster with the real model

MODEL = "SmolLM2-135M-Instruct"
NUM_REQUESTS = 4
MAX_TOKENS = 6
SPEC = '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}'
DASHBOARD = Path(__file__).resolve().parent.parent / "docs" / "grafana" / "pdserve.json"
_SAMPLE = re.compile(r"([a-zA-Z_:][\w:]*)(?:\{([^}]*)\})? (\S+)$")


class Scrape:
    """One /metrics page: samples by name and labels (model_name checked and left out), families' types."""

    def __init__(self, port: int | str) -> None:
        url = port if isinstance(port, str) else f"http://127.0.0.1:{port}"
        text = httpx.get(url + "/metrics", timeout=5).text
        self.samples: dict[tuple[str, frozenset], float] = {}
        self.types: dict[str, str] = {}
        for line in text.splitlines():
            if line.startswith("# TYPE "):
                _, _, name, kind = line.split()
                self.types[name] = kind
            elif (m := _SAMPLE.match(line)) and not line.startswith("#"):
                labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
                if "model_name" in labels:
                    assert labels.pop("model_name") == MODEL
                self.samples[(m.group(1), frozenset(labels.items()))] = float(m.group(3))

    def get(self, name: str, **labels: str) -> float:
        return self.samples[(name, frozenset(labels.items()))]

    def total(self, name: str) -> float:
        """The sum over every label set of the series."""
        return sum(v for (n, _), v in self.samples.items() if n == name)

    def histogram(self, name: str, **labels: str) -> tuple[list[tuple[float, float]], float, float]:
        """(le, cumulative count) buckets in order, the sum and the count; checks their shape."""
        buckets = sorted(
            (float(dict(ls)["le"]), v)
            for (n, ls), v in self.samples.items()
            if n == name + "_bucket" and {k: x for k, x in ls if k != "le"} == labels
        )
        count = self.get(name + "_count", **labels)
        assert buckets and math.isinf(buckets[-1][0]) and buckets[-1][1] == count, name
        assert all(a[1] <= b[1] for a, b in zip(buckets, buckets[1:])), f"{name}: buckets not cumulative"
        return buckets, self.get(name + "_sum", **labels), count

    def exported(self) -> set[str]:
        """Every sample name the page can have: its samples', and its families' (empty ones included)."""
        names = {n for n, _ in self.samples}
        for family, kind in self.types.items():  # a counter's family is named with its _total here
            suffixes = ("_bucket", "_sum", "_count") if kind == "histogram" else ("",)
            names.update(family + s for s in suffixes)
        return names


def wait_for(port: int, check, timeout: float = 20.0) -> Scrape:
    deadline = time.monotonic() + timeout
    while True:
        page = Scrape(port)
        try:
            if check(page):
                return page
        except KeyError:
            pass
        if time.monotonic() > deadline:
            return page  # the caller's asserts say what is missing
        time.sleep(0.1)


class Stack:
    def __init__(self, cluster: Cluster, prefix: str) -> None:
        self.cluster, self.prefix = cluster, prefix
        self.prefill = next(w for w in cluster.workers if w["role"] == "prefill")["metrics_port"]
        self.decode = next(w for w in cluster.workers if w["role"] == "decode")["metrics_port"]
        assert cluster.router_metrics_port
        self.router: int = cluster.router_metrics_port
        self.gateway_url = ""
        self.hits_after_first = 0.0
        self.generated = 0
        self.prompt_tokens = 0


@pytest.fixture(scope="module", params=["pdserve", "vllm"])
def stack(request, bundled_model_dir):
    import openai

    from tests.cluster import start_gateway

    compat = ("--metrics-compat", "vllm") if request.param == "vllm" else ()
    cluster = start_cluster(1, 1, "tcp", "--metrics", *compat, "--speculative-config", SPEC)
    gateway = None
    try:
        s = Stack(cluster, request.param + ":")
        gateway, s.gateway_url = start_gateway(cluster.router, *compat)
        client = openai.OpenAI(base_url=s.gateway_url + "/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        system = ("You are a careful assistant who answers briefly and checks every fact. " * 4).strip()
        for i in range(NUM_REQUESTS):  # one system prompt, four questions: the later ones hit its blocks
            done = client.completions.create(
                model=model,
                prompt=system + f" Question {i}: what is {i} plus {i}?",
                max_tokens=MAX_TOKENS,
                temperature=0,
                extra_body={"ignore_eos": True},
                timeout=120,
            )
            assert done.usage is not None and done.usage.completion_tokens == MAX_TOKENS
            s.generated += done.usage.completion_tokens
            s.prompt_tokens += done.usage.prompt_tokens
            if i == 0:
                s.hits_after_first = wait_for(
                    s.prefill, lambda p: p.get(s.prefix + "prompt_tokens_total") > 0
                ).get(s.prefix + "prefix_cache_hits_total")
        cluster.wait_all_blocks_free()
        yield s
    finally:
        if gateway is not None:
            gateway.terminate()
            gateway.wait(timeout=60)
        cluster.stop()


def test_prefill_worker_series(stack: Stack) -> None:
    p = stack.prefix
    page = wait_for(stack.prefill, lambda s: s.get(p + "request_prefill_time_seconds_count") == NUM_REQUESTS)
    assert stack.hits_after_first == 0  # a fresh worker: nothing cached before the first prompt
    assert page.get(p + "prefix_cache_hits_total") >= 3 * 48  # the repeats: three full blocks each at least
    assert page.get(p + "prefix_cache_queries_total") >= page.get(p + "prefix_cache_hits_total")
    assert page.get(p + "prompt_tokens_total") == stack.prompt_tokens
    assert page.get(p + "generation_tokens_total") == NUM_REQUESTS  # each prompt's first token
    for name in ("request_queue_time_seconds", "request_prefill_time_seconds"):
        _, total, count = page.histogram(p + name)
        assert count == NUM_REQUESTS and 0 <= total < 120
    _, tokens, steps = page.histogram(p + "iteration_tokens_total")
    assert steps >= 1 and tokens >= stack.prompt_tokens - page.get(p + "prefix_cache_hits_total")
    assert (p + "time_to_first_token_seconds_count", frozenset()) not in page.samples  # a decode series
    assert page.get(p + "kv_transfer_bytes_total", transport="tcp") > 0
    assert page.get(p + "kv_transfer_failures_total", transport="tcp") == 0
    _, seconds, transfers = page.histogram(p + "kv_transfer_seconds", transport="tcp")
    assert transfers == NUM_REQUESTS and 0 < seconds < 60


def test_decode_worker_series(stack: Stack) -> None:
    p = stack.prefix
    page = wait_for(stack.decode, lambda s: s.get(p + "e2e_request_latency_seconds_count") == NUM_REQUESTS)
    _, ttft, served = page.histogram(p + "time_to_first_token_seconds")
    assert served == NUM_REQUESTS and ttft > 0  # one first token per request served
    _, e2e, finished = page.histogram(p + "e2e_request_latency_seconds")
    assert finished == NUM_REQUESTS and e2e > ttft
    _, itl, gaps = page.histogram(p + "inter_token_latency_seconds")
    assert 1 <= gaps <= NUM_REQUESTS * (MAX_TOKENS - 1) and itl > 0  # a draft brings several tokens at once
    for name in ("request_time_per_output_token_seconds", "request_decode_time_seconds",
                 "request_queue_time_seconds", "request_prefill_time_seconds"):  # fmt: skip
        assert page.histogram(p + name)[2] == NUM_REQUESTS, name
    assert page.histogram(p + "iteration_tokens_total")[2] >= 1
    assert page.get(p + "generation_tokens_total") == stack.generated - NUM_REQUESTS
    assert page.get(p + "request_success_total", finished_reason="length") == NUM_REQUESTS
    drafted = page.get(p + "spec_decode_num_draft_tokens_total")  # the repeated prompt gives n-grams to draft
    assert drafted > 0 and 0 <= page.get(p + "spec_decode_num_accepted_tokens_total") <= drafted
    prefill = Scrape(stack.prefill)  # every byte the prefill worker sent landed here
    received = page.get(p + "kv_transfer_bytes_total", transport="tcp")
    assert received > 0 and received == prefill.get(p + "kv_transfer_bytes_total", transport="tcp")


def test_workers_idle_again(stack: Stack) -> None:
    p = stack.prefix
    for port in (stack.prefill, stack.decode):
        idle = wait_for(
            port, lambda s: s.get(p + "kv_cache_usage_perc") == 0 and s.get(p + "num_requests_running") == 0
        )
        assert idle.get(p + "kv_cache_usage_perc") == 0.0
        assert idle.get(p + "num_requests_running") == 0 and idle.get(p + "num_requests_waiting") == 0


def test_router_series(stack: Stack) -> None:
    p = stack.prefix
    page = Scrape(stack.router)
    assert page.total(p + "router_routing_decisions_total") == NUM_REQUESTS
    assert page.get(p + "router_routing_decisions_total", reason="prefix_hit") >= NUM_REQUESTS - 1
    _, blocks, routed = page.histogram(p + "router_prefix_blocks_matched")
    assert routed == NUM_REQUESTS and blocks >= 3 * (NUM_REQUESTS - 1)
    assert page.get(p + "router_index_entries") > 0
    assert page.get(p + "router_index_events_total", result="applied") > 0
    assert page.get(p + "router_index_state") == 1 and page.get(p + "router_index_errors_total") == 0
    up = [dict(ls)["role"] for (n, ls), v in page.samples.items() if n == p + "router_worker_up" and v == 1]
    assert sorted(up) == ["decode", "prefill"]


def test_gateway_series(stack: Stack) -> None:
    p = stack.prefix
    page = Scrape(stack.gateway_url)
    assert page.get(p + "gateway_requests_total", endpoint="completions", status="200") == NUM_REQUESTS
    _, ttft, served = page.histogram(p + "time_to_first_token_seconds", endpoint="completions")
    assert served == NUM_REQUESTS and ttft > 0
    assert page.get(p + "generation_tokens_total") == stack.generated
    assert page.get(p + "prompt_tokens_total") == stack.prompt_tokens


def test_compat_keeps_both_names_and_adds_old_ones(stack: Stack) -> None:
    decode, prefill = Scrape(stack.decode), Scrape(stack.prefill)
    pages = (decode, prefill, Scrape(stack.router), Scrape(stack.gateway_url))
    if stack.prefix == "pdserve:":
        assert not any(n.startswith("vllm:") for page in pages for n in page.exported())
        return
    for page in pages:  # the pdserve: names stay, vllm: mirrors them
        ours = {n for n in page.exported() if n.startswith("pdserve:")}
        assert ours and {"vllm:" + n.split(":", 1)[1] for n in ours} <= page.exported()
    for page in (decode, prefill):
        assert page.get("vllm:gpu_cache_usage_perc") == page.get("vllm:kv_cache_usage_perc")
        assert page.get("vllm:avg_generation_throughput") >= 0
        assert "pdserve:gpu_cache_usage_perc" not in page.exported()
    accept = decode.get("vllm:speculative_accept_rate")  # the decode worker speculates, the prefill does not
    assert 0 <= accept <= 1 and "vllm:speculative_accept_rate" not in prefill.exported()


def test_dashboard_names_only_exported_series(stack: Stack) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    assert len(exprs) >= 20
    exported = set().union(*(Scrape(port).exported() for port in (stack.prefill, stack.decode, stack.router)))
    used = {name.replace("pdserve:", stack.prefix) for e in exprs for name in re.findall(r"pdserve:\w+", e)}
    for must in ("kv_cache_usage_perc", "num_requests_waiting", "time_to_first_token_seconds_bucket",
                 "kv_transfer_bytes_total", "router_routing_decisions_total",
                 "spec_decode_num_accepted_tokens_total"):  # fmt: skip
        assert stack.prefix + must in used
    assert not used - exported, f"the dashboard asks for series no service exports: {sorted(used - exported)}"
