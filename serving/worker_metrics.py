"""A worker's Prometheus /metrics (`--metrics-port`): the counters its engine process reports with each
load report (serving/messages/from_engine.py: Load), under vLLM's names with the `pdserve:` prefix.

Speculative decoding's, on a decode worker that speculates: `pdserve:spec_decode_num_drafts`,
`pdserve:spec_decode_num_draft_tokens`, `pdserve:spec_decode_num_accepted_tokens` and
`pdserve:spec_decode_num_accepted_tokens_per_pos{position}`, each a counter with a `model_name` label; the
acceptance rate is accepted / draft tokens, the mean accepted length 1 + accepted / drafts."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

PREFIX = "pdserve:"
_HELP = {
    "spec_decode_num_drafts": "Drafts verified (speculative decoding)",
    "spec_decode_num_draft_tokens": "Draft tokens proposed",
    "spec_decode_num_accepted_tokens": "Draft tokens accepted",
    "spec_decode_num_accepted_tokens_per_pos": "Draft tokens accepted at each draft position",
}


class EngineCounters(Collector):
    """Reads the engine's latest counters at each scrape."""

    def __init__(self, counters: Callable[[], dict[str, int]], model_name: str) -> None:
        self.counters, self.model_name = counters, model_name

    def collect(self) -> Iterator[CounterMetricFamily]:
        values = self.counters()
        for name, help_text in _HELP.items():
            if name.endswith("_per_pos"):
                family = CounterMetricFamily(PREFIX + name, help_text, labels=["model_name", "position"])
                for key, value in values.items():
                    if key.startswith(name + "/"):
                        family.add_metric([self.model_name, key.split("/", 1)[1]], value)
                if family.samples:
                    yield family
            elif name in values:
                family = CounterMetricFamily(PREFIX + name, help_text, labels=["model_name"])
                family.add_metric([self.model_name], values[name])
                yield family


def serve_metrics(port: int, counters: Callable[[], dict[str, int]], model_name: str) -> None:
    """Serve /metrics on `port` from a background thread of prometheus_client's own."""
    registry = CollectorRegistry()
    registry.register(EngineCounters(counters, model_name))
    start_http_server(port, addr="0.0.0.0", registry=registry)
