"""TTFT of the disaggregated cluster (router + prefill + decode over cuda_ipc, two processes on one GPU)
against the single-process engine, side by side, on the same GPU and the same dummy weights.

    python3 -m bench.disagg --out-dir $OUT                  # on the GPU machine: max_tokens=1, the goal's setting
    python3 -m bench.disagg --out-dir $OUT --max-tokens 16  # TTFT of requests that go on generating
    python3 -m bench.disagg --trace $OUT/trace               # + per-stage timestamps (bench.trace_report)

With --trace, every process (this one, the router, the workers and their engine processes) writes
stage timestamps (engine/trace.py) for requests named '<case>-<tokens>-<i>'; `--idle-ms` also times the
single-process engine with the GPU left idle that long before each request, as the served paths leave it
between requests.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from bench.record import record

if TYPE_CHECKING:
    from engine import LLM

COMMAND = "python3 -m bench.disagg"


def random_prompt(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(10, vocab - 10, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def dummy_llm(model: str, util: float) -> LLM:
    """The single-process engine the TTFT comparisons run: dummy weights, bf16, prefix caching off."""
    from engine import LLM

    return LLM(
        model,
        load_format="dummy",
        dtype="bfloat16",
        device="cuda",
        max_model_len=8192,
        gpu_memory_utilization=util,
        enable_prefix_caching=False,
    )


def single_process_ttft(
    model: str, lengths: list[int], runs: int, util: float, max_tokens: int = 1, idle_ms: Sequence[float] = ()
) -> dict[str, dict[int, list[float]]]:
    """{"single": times by prompt length, "single_idle<ms>": the same after <ms> of GPU idle, ...}."""
    from engine import SamplingParams, trace

    llm = dummy_llm(model, util)
    engine, vocab = llm.engine, llm.engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    out: dict[str, dict[int, list[float]]] = {}
    for idle in (0.0, *idle_ms):
        case = "single" if idle == 0 else f"single_idle{idle:g}"
        out[case] = {}
        for n in lengths:
            times = []
            for i in range(runs + 1):  # the first is a warm-up
                if idle:
                    torch.cuda.synchronize()
                    time.sleep(idle / 1e3)
                rid = f"{case}-{n}-{i}"
                prompt = random_prompt(n, vocab, 1000 * n + i)
                trace.mark(rid, "client.send")
                t0 = time.perf_counter()  # from submission, as the served paths' client sees it
                engine.add_request(prompt, params, request_id=rid)
                while not any(o.outputs[0].token_ids for o in engine.step()):
                    pass
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
                trace.mark(rid, "client.first")
                while engine.has_unfinished_requests():
                    engine.step()
            out[case][n] = times[1:]
    del llm, engine
    gc.collect()
    torch.cuda.empty_cache()
    return out


def cluster_ttft(
    model: str,
    lengths: list[int],
    runs: int,
    util: float,
    vocab: int,
    *extra: str,
    max_tokens: int = 1,
    case: str = "disagg",
) -> dict[int, list[float]]:
    from engine import trace
    from tests.cluster import greedy_request, start_cluster

    cluster = start_cluster(
        1,
        1,
        "cuda_ipc",
        "--model",
        model,
        "--load-format",
        "dummy",
        "--dtype",
        "bfloat16",
        "--device",
        "cuda",
        "--gpu-memory-utilization",
        str(util),
        "--max-model-len",
        "8192",
        "--no-enable-prefix-caching",
        *extra,
        timeout=600,
    )
    try:
        stub = cluster.stub()
        out: dict[int, list[float]] = {}
        for n in lengths:
            times = []
            for i in range(runs + 1):
                req = greedy_request(random_prompt(n, vocab, 7000 * n + i), max_tokens, ignore_eos=True)
                req.request_id = f"{case}-{n}-{i}"
                trace.mark(req.request_id, "client.send")
                t0 = time.perf_counter()
                stream = stub.Generate(req)
                next(iter(stream))
                times.append(time.perf_counter() - t0)
                trace.mark(req.request_id, "client.first")
                for _ in stream:
                    pass
            out[n] = times[1:]
        return out
    finally:
        cluster.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="Llama-3-8B")
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 4096])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--out-dir", type=Path, default=None)
    ap.add_argument(
        "--max-tokens", type=int, default=1, help="tokens per request (TTFT is still the first one's time)"
    )
    ap.add_argument(
        "--trace", type=Path, default=None, help="write stage timestamps here (bench.trace_report)"
    )
    ap.add_argument(
        "--idle-ms",
        type=float,
        nargs="*",
        default=[],
        help="also time the single engine after this much GPU idle",
    )
    args = ap.parse_args()
    if args.trace is not None:  # before anything imports engine.trace; the cluster's processes inherit it
        os.environ["PDSERVE_TRACE"] = str(args.trace.resolve())
    from engine.model_config import dummy_config

    vocab = dummy_config(args.model).vocab_size
    singles = single_process_ttft(
        args.model, args.lengths, args.runs, util=0.4, max_tokens=args.max_tokens, idle_ms=args.idle_ms
    )
    single = singles["single"]
    disagg = cluster_ttft(args.model, args.lengths, args.runs, 0.3, vocab, max_tokens=args.max_tokens)
    # the same stack with the decode worker prefilling locally: the serving overhead without the prefill hop
    local = cluster_ttft(
        args.model,
        args.lengths,
        args.runs,
        0.3,
        vocab,
        "--local-prefill-threshold",
        "100000",
        max_tokens=args.max_tokens,
        case="local",
    )
    tag = (
        "" if args.max_tokens == 1 else f"_max{args.max_tokens}"
    )  # records of the goal's setting keep their names
    for case, by_len in singles.items():
        if case != "single":
            print(case, {n: round(statistics.median(t) * 1e3, 2) for n, t in by_len.items()}, "ms")
    print(f"{'prompt':>8} {'single ms':>10} {'disagg ms':>10} {'ratio':>7} {'local-prefill ms':>17}")
    for n in args.lengths:
        s, d = statistics.median(single[n]) * 1e3, statistics.median(disagg[n]) * 1e3
        lp = statistics.median(local[n]) * 1e3
        print(f"{n:>8} {s:>10.2f} {d:>10.2f} {d / s:>7.3f} {lp:>17.2f}")
        record(
            f"served_local_prefill_ttft_{args.model}_{n}{tag}",
            lp,
            "ms",
            baseline=s,
            baseline_name="single-process engine TTFT",
            ratio=lp / s,
            out_dir=args.out_dir,
            command=COMMAND,
            extra={"ms": [x * 1e3 for x in local[n]], "what": "router + decode worker prefilling locally"},
        )
        record(
            f"disagg_ttft_{args.model}_{n}{tag}",
            d,
            "ms",
            baseline=s,
            baseline_name="single-process engine TTFT",
            ratio=d / s,
            goal="<= 1.05 at 4096 tokens" if n == 4096 else None,
            out_dir=args.out_dir,
            command=COMMAND,
            extra={
                "single_ms": [x * 1e3 for x in single[n]],
                "disagg_ms": [x * 1e3 for x in disagg[n]],
                "transport": "cuda_ipc",
                "dtype": "bfloat16",
                "weights": "dummy",
                "max_tokens": args.max_tokens,
                **{f"{c}_ms": [x * 1e3 for x in t[n]] for c, t in singles.items() if c != "single"},
            },
        )


if __name__ == "__main__":
    main()
