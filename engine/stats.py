"""Per-request latencies and per-step sizes as plain histograms, under vLLM V1's metric names and buckets
(vllm/v1/metrics/loggers.py). The engine observes; the workers export them to Prometheus
(serving/worker_metrics.py) and `LLM.get_metrics()` lists them, so nothing here imports prometheus.

A request's timestamps (time.monotonic(), on its Sequence): arrival (the engine got it), scheduled (first
admitted to the running batch; a decode worker's prompt prefilled elsewhere: when it joins the batch), first
token, last token. At its end: queue = scheduled - arrival, prefill = first token - scheduled, decode =
finish - first token, e2e = finish - arrival, time per output token = decode / (output tokens - 1)."""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
KV_TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

HistogramSnapshot = tuple[tuple[float, ...], list[int], float, int]  # buckets, per-bucket counts, sum, count

# name -> (buckets, help)
HISTOGRAMS: dict[str, tuple[tuple[float, ...], str]] = {
    "time_to_first_token_seconds": (TTFT_BUCKETS, "Time from the request's arrival to its first token"),
    "inter_token_latency_seconds": (ITL_BUCKETS, "Time between a request's successive steps' tokens"),
    "request_time_per_output_token_seconds": (
        ITL_BUCKETS,
        "Decode time over the output tokens after the first",
    ),
    "e2e_request_latency_seconds": (REQUEST_LATENCY_BUCKETS, "Time from the request's arrival to its end"),
    "request_queue_time_seconds": (REQUEST_LATENCY_BUCKETS, "Time from arrival to first being scheduled"),
    "request_prefill_time_seconds": (REQUEST_LATENCY_BUCKETS, "Time from first scheduled to the first token"),
    "request_decode_time_seconds": (
        REQUEST_LATENCY_BUCKETS,
        "Time from the first token to the request's end",
    ),
    "iteration_tokens_total": (ITERATION_TOKENS_BUCKETS, "Tokens scheduled in one engine step"),
}


@dataclass
class Histogram:
    """Prometheus' shape: per-bucket counts (not cumulative; the last bucket is +Inf), their sum, a count."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = self.counts or [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def snapshot(self) -> HistogramSnapshot:
        """Picklable, for the worker's /metrics (the engine runs in a process of its own)."""
        return (self.buckets, list(self.counts), self.sum, self.count)

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations at or below it) for every bucket, +Inf last."""
        out, total = [], 0
        for bound, n in zip((*self.buckets, float("inf")), self.counts):
            total += n
            out.append((bound, total))
        return out


@dataclass
class RequestTimes:
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None


class EngineStats:
    """The engine's histograms, observed by the scheduler (requests) and the engine core (steps)."""

    def __init__(self) -> None:
        self.histograms = {name: Histogram(buckets) for name, (buckets, _) in HISTOGRAMS.items()}

    def observe(self, name: str, value: float) -> None:
        self.histograms[name].observe(value)

    def scheduled(self, times: RequestTimes, arrival: float) -> None:
        if times.scheduled is None:
            times.scheduled = time.monotonic()
            self.observe("request_queue_time_seconds", times.scheduled - arrival)

    def tokens(self, times: RequestTimes, arrival: float) -> None:
        """A step appended tokens to the request (several after a verified draft: one latency)."""
        now = time.monotonic()
        if times.first_token is None:
            times.first_token = now
            self.observe("time_to_first_token_seconds", now - arrival)
        elif times.last_token is not None:
            self.observe("inter_token_latency_seconds", now - times.last_token)
        times.last_token = now

    def finished(self, times: RequestTimes, arrival: float, num_output_tokens: int) -> None:
        if times.first_token is None or times.scheduled is None:
            return  # ended before its first token (aborted): no latency to speak of
        now = time.monotonic()
        decode = now - times.first_token
        self.observe("e2e_request_latency_seconds", now - arrival)
        self.observe("request_prefill_time_seconds", times.first_token - times.scheduled)
        self.observe("request_decode_time_seconds", decode)
        if num_output_tokens > 1:
            self.observe("request_time_per_output_token_seconds", decode / (num_output_tokens - 1))

    def snapshot(self) -> dict[str, HistogramSnapshot]:
        return {name: h.snapshot() for name, h in self.histograms.items()}
