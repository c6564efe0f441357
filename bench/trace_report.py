"""Summarise PDSERVE_TRACE files: for each group of requests, the median time from the request's first
stage to each later stage, in the order the stages happen.

    python -m bench.trace_report DIR [--group-by-prefix N]

Request ids are grouped by their text before the last '-' (e.g. 'disagg-4096-3' -> 'disagg-4096'), so a
benchmark names its requests '<case>-<i>'. A stage seen more than once in a request counts at its first time.
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from pathlib import Path


def load(trace_dir: Path) -> dict[str, dict[str, float]]:
    """request id -> stage -> first time (seconds, CLOCK_MONOTONIC)."""
    out: dict[str, dict[str, float]] = defaultdict(dict)
    for path in sorted(trace_dir.glob("trace-*.txt")):
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) < 4:
                continue
            t, rid, stage = float(parts[0]), parts[2], parts[3]
            if stage not in out[rid] or t < out[rid][stage]:
                out[rid][stage] = t
    return out


def summarise(requests: dict[str, dict[str, float]]) -> dict[str, list[tuple[str, float, int]]]:
    """group -> [(stage, median ms since the request's first stage, how many requests had it)]."""
    groups: dict[str, list[dict[str, float]]] = defaultdict(list)
    for rid, stages in requests.items():
        if "-" in rid and stages:
            groups[rid.rsplit("-", 1)[0]].append(stages)
    out = {}
    for group, reqs in sorted(groups.items()):
        offsets: dict[str, list[float]] = defaultdict(list)
        for stages in reqs:
            t0 = min(stages.values())
            for stage, t in stages.items():
                offsets[stage].append((t - t0) * 1e3)
        rows = [(s, statistics.median(v), len(v)) for s, v in offsets.items()]
        out[group] = sorted(rows, key=lambda r: r[1])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace_dir", type=Path)
    args = ap.parse_args()
    for group, rows in summarise(load(args.trace_dir)).items():
        print(f"\n{group}: median ms since the request's first stage (n = requests with that stage)")
        prev = 0.0
        for stage, ms, n in rows:
            print(f"  {ms:9.3f}  (+{ms - prev:8.3f})  {stage:<28} n={n}")
            prev = ms


if __name__ == "__main__":
    main()
