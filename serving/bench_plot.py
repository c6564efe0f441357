"""`pdserve bench --plot`: one figure from a result dict (or a saved result JSON): the latency CDFs, output
tokens/s over time and requests in flight over time."""

from __future__ import annotations

from typing import Any

import numpy as np

CDF_XLABEL = "latency (ms)"
CDF_YLABEL = "fraction of samples"
TIME_XLABEL = "time since the first request (s)"
RATE_YLABEL = "output tokens/s"
CONCURRENCY_YLABEL = "requests in flight"


def _series(result: dict[str, Any]) -> dict[str, list[float]]:
    ok = [i for i, e in enumerate(result["errors"]) if not e]
    ttft = [result["ttfts"][i] for i in ok]
    e2el = [result["latencies"][i] for i in ok]
    tpot = [
        (e - t) / (result["output_lens"][i] - 1)
        for i, t, e in zip(ok, ttft, e2el)
        if result["output_lens"][i] > 1
    ]
    itl = [x for i in ok for x in result["itls"][i]]
    return {"TTFT": ttft, "TPOT": tpot, "ITL": itl, "E2EL": e2el}


def _token_times(result: dict[str, Any], t0: float) -> np.ndarray:
    times = []
    for i, err in enumerate(result["errors"]):
        if not err:
            first = result["start_times"][i] + result["ttfts"][i] - t0
            times.append(np.cumsum([first, *result["itls"][i]]))
    return np.concatenate(times) if times else np.zeros(0)


def build_figure(result: dict[str, Any]) -> Any:
    """The matplotlib Figure: axes[0] latency CDFs, axes[1] output tokens/s, axes[2] requests in flight."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(15, 4.5), layout="constrained")
    cdf, rate, conc = fig.subplots(1, 3)
    for name, values in _series(result).items():
        if values:
            xs = np.sort(np.asarray(values) * 1000)
            cdf.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post", label=name)
    if cdf.has_data():
        cdf.set_xscale("log")
        cdf.legend()
    cdf.set(xlabel=CDF_XLABEL, ylabel=CDF_YLABEL, title="latency CDFs")
    cdf.grid(True, alpha=0.3)

    ok = [i for i, e in enumerate(result["errors"]) if not e]
    t0 = min((result["start_times"][i] for i in ok), default=0.0)
    ends = [result["start_times"][i] + result["latencies"][i] - t0 for i in ok]
    span = max(ends, default=1.0) or 1.0
    width = max(span / 40, 0.05)  # seconds per bucket: about 40 buckets over the run
    edges = np.arange(0.0, span + width, width)
    counts, _ = np.histogram(_token_times(result, t0), bins=edges)
    rate.stairs(counts / width, edges, fill=True, alpha=0.7)
    rate.set(xlabel=TIME_XLABEL, ylabel=RATE_YLABEL, title="output throughput")
    rate.grid(True, alpha=0.3)

    events = sorted([(result["start_times"][i] - t0, 1) for i in ok] + [(e, -1) for e in ends])
    times, in_flight, now = [0.0], [0], 0
    for t, delta in events:
        now += delta
        times.append(t)
        in_flight.append(now)
    conc.step(times, in_flight, where="post")
    conc.yaxis.set_major_locator(MaxNLocator(integer=True))
    conc.set(xlabel=TIME_XLABEL, ylabel=CONCURRENCY_YLABEL, title="concurrency")
    conc.grid(True, alpha=0.3)
    return fig


def save_plot(result: dict[str, Any], path: str) -> None:
    build_figure(result).savefig(path, dpi=100)
