"""`LLM.get_metrics()`: the engine's series as plain objects, shaped like vLLM's vllm/v1/metrics/reader.py
(Counter, Gauge, Vector, Histogram), under the names and labels the workers' /metrics use
(serving/worker_metrics.py) and no Prometheus involved."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.stats import Histogram as _Buckets

if TYPE_CHECKING:
    from engine.engine_core import EngineCore

PREFIX = "pdserve:"
_LABELS = {"request_success": "finished_reason", "num_preemptions_by_mode": "mode"}  # counters by a label


@dataclass
class Metric:
    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: float


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Vector(Metric):
    """A counter with one value per position (spec_decode_num_accepted_tokens_per_pos)."""

    values: list[int]


@dataclass
class Histogram(Metric):
    count: int
    sum: float
    buckets: dict[str, int] = field(default_factory=dict)  # upper bound ("+Inf" last) -> cumulative count


def get_metrics(engine: EngineCore) -> list[Metric]:
    labels = {"model_name": engine.model_id}
    s, bm = engine.scheduler, engine.block_manager
    swap = s.preemption.swap
    out: list[Metric] = [
        Gauge(PREFIX + "num_requests_running", dict(labels), len(s.running)),
        Gauge(PREFIX + "num_requests_waiting", dict(labels), len(s.waiting) + len(s.deferred)),
        Gauge(PREFIX + "kv_cache_usage_perc", dict(labels), 1 - bm.num_free_blocks / bm.num_blocks),
        Gauge(PREFIX + "cpu_cache_usage_perc", dict(labels), swap.usage if swap is not None else 0.0),
        Gauge(PREFIX + "num_requests_swapped", dict(labels), swap.num_swapped if swap is not None else 0),
    ]
    per_pos: list[int] = []
    for key, value in engine.counters().items():
        name, _, label = key.partition("/")
        if name == "spec_decode_num_accepted_tokens_per_pos":
            per_pos.append(int(value))
        elif name in _LABELS:
            out.append(Counter(PREFIX + name, {**labels, _LABELS[name]: label}, value))
        else:
            out.append(Counter(PREFIX + name, dict(labels), value))
    if s.proposer is not None:
        out.append(Vector(PREFIX + "spec_decode_num_accepted_tokens_per_pos", dict(labels), per_pos))
    for name, (buckets, counts, total, count) in engine.histograms().items():
        cumulative = _Buckets(buckets, list(counts)).cumulative()
        bounds = {("+Inf" if b == float("inf") else repr(float(b))): n for b, n in cumulative}
        out.append(Histogram(PREFIX + name, dict(labels), count, total, bounds))
    return out
