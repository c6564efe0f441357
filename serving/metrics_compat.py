"""`--metrics-compat vllm`: every `pdserve:` series served a second time under the `vllm:` prefix, same labels
and values, so dashboards and alerts written for vLLM read a pdserve stack as they are."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

PREFIX = "pdserve:"


def prefixes(compat: str | None) -> tuple[str, ...]:
    """The prefixes a service exports its series under (`compat`: serving/roles.py METRICS_COMPAT)."""
    return (PREFIX, f"{compat}:") if compat else (PREFIX,)


def renamed(family: Metric, prefix: str) -> Metric:
    """The family with its `pdserve:` prefix (and its samples') replaced by `prefix`."""
    if prefix == PREFIX or not family.name.startswith(PREFIX):
        return family
    out = Metric(prefix + family.name[len(PREFIX) :], family.documentation, family.type, family.unit)
    out.samples = [s._replace(name=prefix + s.name[len(PREFIX) :]) for s in family.samples]
    return out


class Mirror(Collector):
    """The source registry's `pdserve:` families again under another prefix (register beside the source)."""

    def __init__(self, source: CollectorRegistry, prefix: str) -> None:
        self.source, self.prefix = source, prefix

    def collect(self) -> Iterator[Metric]:
        for family in self.source.collect():
            if family.name.startswith(PREFIX):
                yield renamed(family, self.prefix)


def add_compat(registry: CollectorRegistry, compat: str | None) -> CollectorRegistry:
    """A registry serving `registry`'s series under every prefix `compat` asks for (itself when none)."""
    extra = prefixes(compat)[1:]
    if not extra:
        return registry
    served = CollectorRegistry()
    served.register(Mirror(registry, PREFIX))
    for prefix in extra:
        served.register(Mirror(registry, prefix))
    return served
