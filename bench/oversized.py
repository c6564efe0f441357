"""Oversized request bodies beside steady traffic, on the CPU: the chaos stack (redis-server, `pdserve up`
with two prefill workers and one decode worker, the gateway; the bundled model), one client sending short
greedy completions back to back, and bursts of one 20 MB body and ten 2 MB bodies sent at once.

    python3 -m bench.oversized --out-dir DIR        # 10 bursts

Records `gateway_oversized_burst_p99_ratio`: over the bursts, the worst p99 latency of the steady requests
that overlapped a burst, against the p99 of 20 steady requests before any burst (tests/chaos/test_oversized.py
holds it to 2x), with the slowest refusal beside it (the test's bound: 1 s).
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.record import record

COMMAND = "python3 -m bench.oversized"


def main() -> None:

    from engine.bundled import bundled_model_dir
    from tests.chaos.test_oversized import MB, huge_body, post_raw
    from tests.chaos.tools import SteadyLoad, chaos_stack, p99

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out-dir", type=Path, default=None)
    p.add_argument("--bursts", type=int, default=10)
    args = p.parse_args()
    with chaos_stack(bundled_model_dir()) as stack:
        bodies = [huge_body(stack.model, 20 * MB)] + [huge_body(stack.model, 2 * MB) for _ in range(10)]
        ratios, refusals = [], []
        with SteadyLoad(stack.url, stack.model, workers=1) as load:
            load.wait_for(20, timeout=60)
            baseline = p99(load.outcomes)
            for i in range(args.bursts):
                start = time.monotonic()
                with ThreadPoolExecutor(len(bodies)) as pool:
                    refused = list(pool.map(lambda b: post_raw(stack.url, b), bodies))
                end = time.monotonic()
                load.wait_for(4)
                during = [
                    o
                    for o in load.outcomes
                    if start <= o.start <= end or o.start <= start < o.start + o.seconds
                ]
                ratios.append(p99(during) / baseline)
                refusals.append(max(seconds for _, seconds, _ in refused))
                print(
                    f"burst {i}: p99 ratio {ratios[-1]:.2f}, slowest refusal {refusals[-1]:.2f} s", flush=True
                )
    record(
        "gateway_oversized_burst_p99_ratio", max(ratios), "x", baseline=baseline,
        baseline_name="p99 of 20 steady requests before any burst (s)", ratio=max(ratios), goal="<= 2",
        out_dir=args.out_dir, command=COMMAND,
        extra={"ratios": [round(r, 3) for r in ratios], "slowest_refusal_s": round(max(refusals), 3),
               "refusals_s": [round(r, 3) for r in refusals]},
    )  # fmt: skip


if __name__ == "__main__":
    main()
