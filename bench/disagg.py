"""TTFT of the disaggregated cluster (router + prefill + decode over cuda_ipc, two processes on one GPU)
against the single-process engine, side by side, on the same GPU and the same dummy weights.

    python3 -m bench.disagg --out-dir $OUT                  # on the GPU machine: max_tokens=1, the goal's setting
    python3 -m bench.disagg --out-dir $OUT --max-tokens 16  # TTFT of requests that go on generating
    python3 -m bench.disagg --trace $OUT/trace               # + per-stage timestamps (bench.trace_report)

Cadence: every path is timed at the same request gaps (`--gap-ms`, default 0 and 50): each request is sent
that long after the previous one ended, the GPU idle meanwhile. Gap 0 is back to back. It matters: a 4096-token
forward pass runs ~3 ms faster after 20 ms of GPU idle than back to back on the H200, and a
served path idles the GPU for its own stack time (~8 ms) between back-to-back requests while the single engine
does not. So the goal's ratio compares the paths at the largest gap given, where both enter the forward pass
from idle; the back-to-back ratio is recorded beside it.

With --trace, every process (this one, the router, the workers and their engine processes) writes
stage timestamps (engine/trace.py) for requests named '<case>_gap<ms>-<tokens>-<i>'.
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
    model: str, lengths: list[int], runs: int, util: float, gaps_ms: Sequence[float], max_tokens: int = 1
) -> dict[float, dict[int, list[float]]]:
    """{gap ms: {prompt length: TTFT seconds}} of the single-process engine."""
    from engine import SamplingParams, trace

    llm = dummy_llm(model, util)
    engine, vocab = llm.engine, llm.engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    out: dict[float, dict[int, list[float]]] = {}
    for gap in gaps_ms:
        out[gap] = {}
        for n in lengths:
            times = []
            for i in range(runs + 1):  # the first is a warm-up
                torch.cuda.synchronize()
                if gap:
                    time.sleep(gap / 1e3)
                rid = f"single_gap{gap:g}-{n}-{i}"
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
            out[gap][n] = times[1:]
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
    gaps_ms: Sequence[float],
    *extra: str,
    max_tokens: int = 1,
    case: str = "disagg",
) -> dict[float, dict[int, list[float]]]:
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
        out: dict[float, dict[int, list[float]]] = {}
        for gap in gaps_ms:
            out[gap] = {}
            for n in lengths:
                times = []
                for i in range(runs + 1):
                    if gap:
                        time.sleep(gap / 1e3)
                    req = greedy_request(random_prompt(n, vocab, 7000 * n + i), max_tokens, ignore_eos=True)
                    req.request_id = f"{case}_gap{gap:g}-{n}-{i}"
                    trace.mark(req.request_id, "client.send")
                    t0 = time.perf_counter()
                    stream = stub.Generate(req)
                    next(iter(stream))
                    times.append(time.perf_counter() - t0)
                    trace.mark(req.request_id, "client.first")
                    for _ in stream:
                        pass
                out[gap][n] = times[1:]
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
        "--gap-ms",
        type=float,
        nargs="+",
        default=[0.0, 50.0],
        help="time every path with each request sent this long after the previous one ended (0: back to back)",
    )
    args = ap.parse_args()
    if args.trace is not None:  # before anything imports engine.trace; the cluster's processes inherit it
        os.environ["PDSERVE_TRACE"] = str(args.trace.resolve())
    from engine.model_config import dummy_config

    vocab = dummy_config(args.model).vocab_size
    gaps = sorted(set(args.gap_ms))
    single = single_process_ttft(args.model, args.lengths, args.runs, 0.4, gaps, args.max_tokens)
    disagg = cluster_ttft(args.model, args.lengths, args.runs, 0.3, vocab, gaps, max_tokens=args.max_tokens)
    # the same stack with the decode worker prefilling locally: the serving overhead without the prefill hop
    local = cluster_ttft(
        args.model,
        args.lengths,
        args.runs,
        0.3,
        vocab,
        gaps,
        "--local-prefill-threshold",
        "100000",
        max_tokens=args.max_tokens,
        case="local",
    )
    tag = "" if args.max_tokens == 1 else f"_max{args.max_tokens}"  # the goal's setting keeps the names
    med = {
        path: {g: {n: statistics.median(t) * 1e3 for n, t in by_n.items()} for g, by_n in runs.items()}
        for path, runs in (("single", single), ("disagg", disagg), ("local", local))
    }
    print(
        f"{'gap ms':>7} {'prompt':>7} {'single ms':>10} {'disagg ms':>10} {'ratio':>7} {'local ms':>9} {'ratio':>7}"
    )
    for g in gaps:
        for n in args.lengths:
            s, d, lp = med["single"][g][n], med["disagg"][g][n], med["local"][g][n]
            print(f"{g:>7g} {n:>7} {s:>10.2f} {d:>10.2f} {d / s:>7.3f} {lp:>9.2f} {lp / s:>7.3f}")
    headline = gaps[-1]  # the goal's comparison: every path enters the forward pass from an idle GPU

    def by_gap(path: str, n: int) -> dict[str, float]:
        return {f"{g:g}": med[path][g][n] for g in gaps}

    for n in args.lengths:
        s, d, lp = (med[p][headline][n] for p in ("single", "disagg", "local"))
        common = {
            "gap_ms": headline,
            "cadence": "each request sent gap_ms after the previous one ended, every path alike",
            "median_ms_by_gap": {p: by_gap(p, n) for p in ("single", "disagg", "local")},
            "ratio_by_gap": {f"{g:g}": med["disagg"][g][n] / med["single"][g][n] for g in gaps},
        }
        record(
            f"served_local_prefill_ttft_{args.model}_{n}{tag}",
            lp,
            "ms",
            baseline=s,
            baseline_name=f"single-process engine TTFT, same cadence (gap {headline:g} ms)",
            ratio=lp / s,
            out_dir=args.out_dir,
            command=COMMAND,
            extra={"ms": [x * 1e3 for x in local[headline][n]], "what": "router + decode worker prefilling locally",
                   **common},
        )  # fmt: skip
        record(
            f"disagg_ttft_{args.model}_{n}{tag}",
            d,
            "ms",
            baseline=s,
            baseline_name=f"single-process engine TTFT, same cadence (gap {headline:g} ms)",
            ratio=d / s,
            goal="<= 1.05 at 4096 tokens" if n == 4096 else None,
            out_dir=args.out_dir,
            command=COMMAND,
            extra={
                "single_ms": [x * 1e3 for x in single[headline][n]],
                "disagg_ms": [x * 1e3 for x in disagg[headline][n]],
                "transport": "cuda_ipc",
                "dtype": "bfloat16",
                "weights": "dummy",
                "max_tokens": args.max_tokens,
                **common,
            },
        )


if __name__ == "__main__":
    main()
