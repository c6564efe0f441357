"""The router's Prometheus metrics, in a registry of their own (served on `--metrics-port`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from serving.metrics_compat import add_compat


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.index_errors = Counter(
            "pdserve:router_index_errors",
            "Prefix index calls that failed or timed out (each answered by the load-only fallback)",
            registry=self.registry,
        )
        self.index_state = Gauge(
            "pdserve:router_index_state",
            "1 while the prefix index answers, 0 while it is down",
            registry=self.registry,
        )
        self.index_entries = Gauge(
            "pdserve:router_index_entries",
            "(worker, block) pairs in the prefix index, speculative ones not counted (set each poll)",
            registry=self.registry,
        )
        self.worker_up = Gauge(
            "pdserve:router_worker_up",
            "1 while the worker answers the router's polls and takes requests, 0 otherwise",
            ["address", "role"],
            registry=self.registry,
        )
        self.worker_state_changes = Counter(
            "pdserve:router_worker_state_changes",
            "Worker state changes the router saw, by the state entered (up, down, draining)",
            ["role", "state"],
            registry=self.registry,
        )
        self.index_events = Counter(
            "pdserve:router_index_events",
            "Prefix-cache event batches and snapshots from the prefill workers, by what the index did with "
            "them (applied, stale, resync_needed, snapshot)",
            ["result"],
            registry=self.registry,
        )
        self.redis_errors = Counter(
            "pdserve:router_redis_errors",
            "Redis calls that failed, by operation (index: a routing or event call, answered by the "
            "fallback; follow: the mirror's stream reader; speculate: publishing held prefixes)",
            ["operation"],
            registry=self.registry,
        )
        self.routing_decisions = Counter(
            "pdserve:router_routing_decisions",
            "Requests routed, by reason: prefix_hit (the prefill worker holds some of the prompt's "
            "blocks), load (no block held: the least loaded), fallback (the prefix index is down: load only)",
            ["reason"],
            registry=self.registry,
        )
        self.prefix_blocks_matched = Histogram(
            "pdserve:router_prefix_blocks_matched",
            "Leading prompt blocks the chosen prefill worker holds, per routed request",
            buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
            registry=self.registry,
        )
        self.index_state.set(1)

    def routed(self, reason: str, matched_blocks: int) -> None:
        self.routing_decisions.labels(reason).inc()
        self.prefix_blocks_matched.observe(matched_blocks)

    def serve(self, port: int, host: str = "0.0.0.0", compat: str | None = None) -> None:
        """Serve /metrics on a background thread of prometheus_client's own (`compat`: under that prefix
        too, serving/metrics_compat.py)."""
        start_http_server(port, addr=host, registry=add_compat(self.registry, compat))
