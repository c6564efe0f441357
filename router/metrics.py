"""The router's Prometheus metrics, in a registry of their own (served on `--metrics-port`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server


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
        self.index_state.set(1)

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        """Serve /metrics on a background thread of prometheus_client's own."""
        start_http_server(port, addr=host, registry=self.registry)
