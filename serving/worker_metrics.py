"""A worker's Prometheus /metrics (`--metrics-port`), under vLLM V1's names with the `pdserve:` prefix and a
`model_name` label, read at each scrape from its engine process's latest report (every 0.1 s:
serving/messages/from_engine.py, Load):

- gauges: `num_requests_running`, `num_requests_waiting`, `kv_cache_usage_perc` (0-1: blocks in use over
  all blocks; cached prefix blocks nobody holds count as free);
- counters: `prompt_tokens`, `generation_tokens`, `num_preemptions`, `prefix_cache_queries` and
  `prefix_cache_hits` (in tokens), `request_success{finished_reason}`, and on a decode worker that
  speculates `spec_decode_num_drafts`, `spec_decode_num_draft_tokens`, `spec_decode_num_accepted_tokens`,
  `spec_decode_num_accepted_tokens_per_pos{position}` (acceptance rate: accepted / draft tokens).
A decode worker counts the tokens it generates; the first token of a prompt prefilled elsewhere, and the
prompt itself, are the prefill worker's."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "pdserve:"
_COUNTERS = {
    "prompt_tokens": "Prompt tokens computed (prefix-cache hits excluded)",
    "generation_tokens": "Tokens generated",
    "num_preemptions": "Requests preempted (their blocks freed, recomputed later)",
    "prefix_cache_queries": "Prompt tokens looked up in the prefix cache",
    "prefix_cache_hits": "Prompt tokens found in the prefix cache",
    "spec_decode_num_drafts": "Drafts verified (speculative decoding)",
    "spec_decode_num_draft_tokens": "Draft tokens proposed",
    "spec_decode_num_accepted_tokens": "Draft tokens accepted",
}
# counters with one label, their keys "<name>/<label value>"
_LABELLED = {
    "request_success": ("finished_reason", "Requests finished, by reason (stop, length, abort)"),
    "spec_decode_num_accepted_tokens_per_pos": ("position", "Draft tokens accepted at each draft position"),
}


class EngineMetrics(Collector):
    def __init__(
        self, load: Callable[[], dict[str, int]], counters: Callable[[], dict[str, int]], model_name: str
    ) -> None:
        self.load, self.counters, self.model_name = load, counters, model_name

    def collect(self) -> Iterator[Metric]:
        load, values, model = self.load(), self.counters(), [self.model_name]
        if load:
            total = load.get("num_total_blocks", 0)
            usage = (total - load.get("num_free_blocks", 0)) / total if total else 0.0
            for name, help_text, value in (
                ("num_requests_running", "Requests in the running batch", load.get("num_running", 0)),
                ("num_requests_waiting", "Requests waiting to run", load.get("num_waiting", 0)),
                ("kv_cache_usage_perc", "KV-cache blocks in use, 0-1", usage),
            ):
                gauge = GaugeMetricFamily(PREFIX + name, help_text, labels=["model_name"])
                gauge.add_metric(model, value)
                yield gauge
        for name, help_text in _COUNTERS.items():
            if name in values:
                counter = CounterMetricFamily(PREFIX + name, help_text, labels=["model_name"])
                counter.add_metric(model, values[name])
                yield counter
        for name, (label, help_text) in _LABELLED.items():
            family = CounterMetricFamily(PREFIX + name, help_text, labels=["model_name", label])
            for key, value in values.items():
                if key.startswith(name + "/"):
                    family.add_metric([self.model_name, key.split("/", 1)[1]], value)
            if family.samples:
                yield family


def serve_metrics(
    port: int, load: Callable[[], dict[str, int]], counters: Callable[[], dict[str, int]], model_name: str
) -> None:
    """Serve /metrics on `port` from a background thread of prometheus_client's own."""
    registry = CollectorRegistry()
    registry.register(EngineMetrics(load, counters, model_name))
    start_http_server(port, addr="0.0.0.0", registry=registry)
