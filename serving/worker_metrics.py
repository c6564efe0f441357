"""A worker's Prometheus /metrics (`--metrics-port`), under vLLM V1's names with the `pdserve:` prefix and a
`model_name` label, read at each scrape from its engine process's latest report (every 0.1 s:
serving/messages/from_engine.py, Load):

- gauges: `num_requests_running`, `num_requests_waiting`, `kv_cache_usage_perc` (0-1: blocks in use over
  all blocks; cached prefix blocks nobody holds count as free), `cpu_cache_usage_perc` (0-1: swap-space blocks
  in use; 0 without a swap space) and `num_requests_swapped` (requests whose KV is in the swap space);
- counters: `prompt_tokens`, `generation_tokens`, `num_preemptions` (and `num_preemptions_by_mode{mode}`:
  swap, recompute), with a swap space `kv_swap_out_blocks`, `kv_swap_in_blocks`, `kv_swap_out_bytes`,
  `kv_swap_in_bytes`, `kv_swap_out_seconds`, `kv_swap_in_seconds`, `prefix_cache_queries` and
  `prefix_cache_hits` (in tokens), `request_success{finished_reason}`, and on a decode worker that
  speculates `spec_decode_num_drafts`, `spec_decode_num_draft_tokens`, `spec_decode_num_accepted_tokens`,
  `spec_decode_num_accepted_tokens_per_pos{position}` (acceptance rate: accepted / draft tokens).
- histograms with vLLM's buckets (engine/stats.py): on a decode worker `time_to_first_token_seconds`,
  `inter_token_latency_seconds`, `request_time_per_output_token_seconds`, `e2e_request_latency_seconds`,
  `request_queue_time_seconds`, `request_prefill_time_seconds`, `request_decode_time_seconds` and
  `iteration_tokens_total`; on a prefill worker the queue, prefill and iteration ones;
- the KV transfers (kvtransfer/stats.py), by `transport`: `kv_transfer_bytes` (sent by a prefill worker,
  received by a decode worker) and `kv_transfer_failures` counters, and on a prefill worker a
  `kv_transfer_seconds` histogram (each send, vLLM-style buckets from 0.5 ms); on a decode worker
  `kv_transfer_refused{reason}` (auth: a peer that did not authenticate; grant: a write into blocks not
  granted to it), from the first refusal.
A decode worker counts the tokens it generates; the first token of a prompt prefilled elsewhere, and the
prompt itself, are the prefill worker's.

`--metrics-compat vllm` exports all of it under `vllm:` as well, and there the names older vLLM guides use:
`gpu_cache_usage_perc` (kv_cache_usage_perc's value), `avg_generation_throughput` (tokens/s over the last
10 s of load reports) and, on a worker that speculates, `speculative_accept_rate` (accepted over drafted
tokens since start; absent where nothing speculates)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.stats import HISTOGRAMS, Histogram
from serving.metrics_compat import PREFIX, prefixes, renamed

_COUNTERS = {
    "prompt_tokens": "Prompt tokens computed (prefix-cache hits excluded)",
    "generation_tokens": "Tokens generated",
    "num_preemptions": "Requests preempted (their blocks swapped out, or freed and recomputed later)",
    "kv_swap_out_blocks": "KV blocks copied to the CPU swap space",
    "kv_swap_in_blocks": "KV blocks copied back from the CPU swap space",
    "kv_swap_out_bytes": "KV-cache bytes copied to the CPU swap space",
    "kv_swap_in_bytes": "KV-cache bytes copied back from the CPU swap space",
    "kv_swap_out_seconds": "Seconds the copies to the CPU swap space took",
    "kv_swap_in_seconds": "Seconds the copies back from the CPU swap space took",
    "prefix_cache_queries": "Prompt tokens looked up in the prefix cache",
    "prefix_cache_hits": "Prompt tokens found in the prefix cache",
    "spec_decode_num_drafts": "Drafts verified (speculative decoding)",
    "spec_decode_num_draft_tokens": "Draft tokens proposed",
    "spec_decode_num_accepted_tokens": "Draft tokens accepted",
}
# counters with one label, their keys "<name>/<label value>"
_LABELLED = {
    "request_success": ("finished_reason", "Requests finished, by reason (stop, length, abort)"),
    "num_preemptions_by_mode": ("mode", "Requests preempted, by how: swap or recompute"),
    "spec_decode_num_accepted_tokens_per_pos": ("position", "Draft tokens accepted at each draft position"),
    "kv_transfer_bytes": ("transport", "KV-cache bytes sent (prefill worker) or received (decode worker)"),
    "kv_transfer_failures": ("transport", "KV transfers that failed (sent or awaited)"),
    "kv_transfer_refused": (
        "reason",
        "KV peers refused by a decode worker's receiver: auth (did not authenticate), grant (wrote what it "
        "was not granted)",
    ),
}
# histograms a role exports (the engine keeps them all)
_ROLE_HISTOGRAMS = {
    "prefill": ("request_queue_time_seconds", "request_prefill_time_seconds", "iteration_tokens_total"),
    "decode": tuple(HISTOGRAMS),
}
_LABELLED_HISTOGRAMS = {"kv_transfer_seconds": ("transport", "Time one KV transfer took at the sender")}
THROUGHPUT_WINDOW_S = 10.0


class EngineMetrics(Collector):
    """The engine's series from its latest report; `history()` gives (time, counters) reports, oldest first,
    for the compat throughput gauge."""

    def __init__(
        self,
        load: Callable[[], dict[str, int]],
        counters: Callable[[], dict[str, float]],
        model_name: str,
        histograms: Callable[[], dict[str, Any]] = dict,
        role: str = "decode",
        compat: str | None = None,
        history: Callable[[], Sequence[tuple[float, dict[str, float]]]] = tuple,
    ) -> None:
        self.load, self.counters, self.model_name = load, counters, model_name
        self.histograms, self.role, self.history = histograms, role, history
        self.prefixes = prefixes(compat)

    def collect(self) -> Iterator[Metric]:
        families = [*self._gauges(), *self._counters(), *self._histograms()]
        for prefix in self.prefixes:
            yield from (renamed(f, prefix) for f in families)
        if len(self.prefixes) > 1:
            yield from self._legacy(self.prefixes[1], families)

    def _gauges(self) -> Iterator[Metric]:
        load = self.load()
        if not load:
            return
        total = load.get("num_total_blocks", 0)
        usage = (total - load.get("num_free_blocks", 0)) / total if total else 0.0
        cpu = load.get("num_cpu_blocks", 0)
        cpu_usage = (cpu - load.get("num_free_cpu_blocks", 0)) / cpu if cpu else 0.0
        for name, help_text, value in (
            ("num_requests_running", "Requests in the running batch", load.get("num_running", 0)),
            ("num_requests_waiting", "Requests waiting to run", load.get("num_waiting", 0)),
            ("kv_cache_usage_perc", "KV-cache blocks in use, 0-1", usage),
            ("cpu_cache_usage_perc", "CPU swap-space blocks in use, 0-1", cpu_usage),
            (
                "num_requests_swapped",
                "Requests whose KV is in the CPU swap space",
                load.get("num_swapped", 0),
            ),
        ):
            yield self._gauge(name, help_text, value)

    def _gauge(self, name: str, help_text: str, value: float) -> Metric:
        gauge = GaugeMetricFamily(PREFIX + name, help_text, labels=["model_name"])
        gauge.add_metric([self.model_name], value)
        return gauge

    def _counters(self) -> Iterator[Metric]:
        values, model = self.counters(), [self.model_name]
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

    def _histograms(self) -> Iterator[Metric]:
        snaps = self.histograms()
        for name in _ROLE_HISTOGRAMS.get(self.role, ()):
            if name in snaps:
                family = HistogramMetricFamily(PREFIX + name, HISTOGRAMS[name][1], labels=["model_name"])
                _add_histogram(family, [self.model_name], snaps[name])
                yield family
        for name, (label, help_text) in _LABELLED_HISTOGRAMS.items():
            family = HistogramMetricFamily(PREFIX + name, help_text, labels=["model_name", label])
            for key, snap in snaps.items():
                if key.startswith(name + "/"):
                    _add_histogram(family, [self.model_name, key.split("/", 1)[1]], snap)
            if family.samples:
                yield family

    def _legacy(self, prefix: str, families: list[Metric]) -> Iterator[Metric]:
        """The names older vLLM guides use, under the compat prefix only."""
        for f in families:
            if f.name == PREFIX + "kv_cache_usage_perc":
                value = f.samples[0].value
                yield renamed(
                    self._gauge("gpu_cache_usage_perc", "KV-cache usage, 0-1 (old name)", value), prefix
                )
        throughput = self._gauge(
            "avg_generation_throughput", f"Tokens generated per second over the last {THROUGHPUT_WINDOW_S:g} s",
            generation_rate(self.history()),
        )  # fmt: skip
        yield renamed(throughput, prefix)
        values = self.counters()
        if "spec_decode_num_draft_tokens" in values:
            drafted = values["spec_decode_num_draft_tokens"]
            rate = values.get("spec_decode_num_accepted_tokens", 0) / drafted if drafted else 0.0
            yield renamed(
                self._gauge("speculative_accept_rate", "Draft tokens accepted over drafted", rate), prefix
            )


def _add_histogram(family: HistogramMetricFamily, labels: list[str], snap: Any) -> None:
    buckets, counts, total, _ = snap
    h = Histogram(tuple(buckets), list(counts))
    family.add_metric(labels, [(_bound(b), float(n)) for b, n in h.cumulative()], total)


def _bound(b: float) -> str:
    return "+Inf" if b == float("inf") else repr(float(b))


def generation_rate(history: Sequence[tuple[float, dict[str, float]]]) -> float:
    """Tokens per second between the oldest and the newest report of the window."""
    if len(history) < 2:
        return 0.0
    (t0, c0), (t1, c1) = history[0], history[-1]
    dt = t1 - t0
    return (c1.get("generation_tokens", 0) - c0.get("generation_tokens", 0)) / dt if dt > 0 else 0.0


def serve_metrics(port: int, metrics: EngineMetrics) -> None:
    """Serve /metrics on `port` from a background thread of prometheus_client's own."""
    registry = CollectorRegistry()
    registry.register(metrics)
    start_http_server(port, addr="0.0.0.0", registry=registry)
