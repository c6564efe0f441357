"""The sampler's cost per step: greedy against sampling parameters, on whatever device is there.

    python3 -m bench.sampler [--rows 64] [--vocab 128256] [--device cuda] [--iters 50]

Each figure is the median wall time of one whole `Sampler(...)` call (upload of the knobs, device work,
the copy of the tokens back, the host's read), as a decode step pays it; the rows' histories are 600
tokens, so "penalties" includes counting them.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine.sampler import Sampler
from engine.sampling_params import SamplingParams

CASES = {
    "greedy": SamplingParams(temperature=0),
    "temperature": SamplingParams(temperature=0.8),
    "top_p": SamplingParams(temperature=0.8, top_p=0.95),
    "top_k_top_p_min_p": SamplingParams(temperature=0.8, top_k=50, top_p=0.95, min_p=0.05),
    "penalties": SamplingParams(temperature=0.8, top_p=0.95, repetition_penalty=1.1, frequency_penalty=0.3),
    "logprobs_5": SamplingParams(temperature=0.8, top_p=0.95, logprobs=5),
}


def time_case(sampler: Sampler, logits: torch.Tensor, params: SamplingParams, iters: int) -> float:
    rows = logits.shape[0]
    histories = [(list(range(500)), [7] * (100 + i)) for i in range(rows)]
    times = []
    for i in range(iters + 3):
        start = time.perf_counter()
        sampler(logits, [params] * rows, [None] * rows, histories)
        if i >= 3:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    logits = torch.randn(args.rows, args.vocab, device=args.device) * 3
    sampler = Sampler()
    base = None
    for name, params in CASES.items():
        t = time_case(sampler, logits, params, args.iters)
        base = base or t
        print(f"{name:>20}: {t * 1e3:8.3f} ms  ({t / base:.2f}x greedy)")


if __name__ == "__main__":
    main()
