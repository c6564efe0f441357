"""The gateway's Prometheus metrics, under vLLM's names with a `pdserve:` prefix, in the app's own registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


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
