"""The gateway's Prometheus metrics, under vLLM's names with a `pdserve:` prefix, in the app's own registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from engine.stats import REQUEST_LATENCY_BUCKETS as _E2E_BUCKETS
from engine.stats import TTFT_BUCKETS as _TTFT_BUCKETS


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "pdserve:gateway_requests",
            "HTTP requests to the OpenAI endpoints by endpoint and status code",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "pdserve:time_to_first_token_seconds",
            "Time from the request's arrival to its first token",
            ["endpoint"],
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "pdserve:e2e_request_latency_seconds",
            "Time from the request's arrival to its last token",
            ["endpoint"],
            buckets=_E2E_BUCKETS,
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "pdserve:prompt_tokens", "Prompt tokens of finished requests", registry=self.registry
        )
        self.generation_tokens = Counter(
            "pdserve:generation_tokens", "Generated tokens of finished requests", registry=self.registry
        )

    def done(self, endpoint: str, status: int, prompt_tokens: int = 0, completion_tokens: int = 0) -> None:
        self.requests.labels(endpoint, str(status)).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
