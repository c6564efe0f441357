"""`pdserve bench`'s flags (vLLM `bench serve`'s names), its summary table and its result file."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from datetime import datetime
from pathlib import Path
from typing import Any

from serving.bench_client import METRICS, LoadConfig, calculate_metrics, first_model, parse_goodput, run_load
from serving.bench_datasets import SampleRequest, prefix_repetition_dataset, random_dataset, sharegpt_dataset


def add_bench_args(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--backend", default="openai", choices=("openai", "openai-chat"), help="completions or chat requests")
    a("--base-url", default="http://127.0.0.1:8000", help="the server's address, without /v1")
    a("--endpoint", default=None, help="default: /v1/completions (openai) or /v1/chat/completions")
    a("--model", default=None, help="the model name to send (default: the first of the server's /v1/models)")
    a("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token (default: $OPENAI_API_KEY)")
    a(
        "--tokenizer",
        default=None,
        help="a model directory whose tokenizer builds and counts the prompts (default: the bundled model's)",
    )
    a(
        "--dataset-name",
        default=None,
        choices=("random", "prefix-repetition", "sharegpt"),
        help="default: sharegpt with --dataset-path, otherwise random",
    )
    a("--dataset-path", default=None, help="a ShareGPT-format JSON file")
    a(
        "--sharegpt-output-len",
        type=int,
        default=None,
        help="output tokens per request instead of the reply's",
    )
    a("--num-prompts", type=int, default=1000, help="requests to send")
    a("--random-input-len", type=int, default=1024, help="prompt tokens after the prefix")
    a("--random-output-len", type=int, default=128, help="output tokens per request")
    a(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths drawn uniformly from [len * (1 - r), len * (1 + r)]",
    )
    a("--random-prefix-len", type=int, default=0, help="tokens of a prefix every prompt shares")
    a("--prefix-repetition-prefix-len", type=int, default=256, help="tokens per shared prefix")
    a("--prefix-repetition-suffix-len", type=int, default=256, help="tokens per prompt after its prefix")
    a("--prefix-repetition-num-prefixes", type=int, default=10, help="distinct prefixes")
    a("--prefix-repetition-output-len", type=int, default=128, help="output tokens per request")
    a("--request-rate", type=float, default=float("inf"), help="requests/s (default inf: all at once)")
    a(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the arrival gaps: 1 is Poisson, < 1 burstier, > 1 more even",
    )
    a("--max-concurrency", type=int, default=None, help="requests in flight at most")
    a("--seed", type=int, default=0, help="for the dataset and the arrival times")
    a(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="send ignore_eos so every request makes its full output length (default: on for random and "
        "prefix-repetition, off for sharegpt)",
    )
    a("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    a("--percentile-metrics", default=",".join(METRICS), help="comma-separated, of ttft,tpot,itl,e2el")
    a("--metric-percentiles", default="90,99", help="comma-separated percentiles to report")
    a(
        "--goodput",
        nargs="+",
        default=None,
        metavar="KEY:MS",
        help="service level objectives, e.g. ttft:500 tpot:50; goodput counts the requests that meet all",
    )
    a("--disable-tqdm", action="store_true", help="no progress bar")
    a("--label", default=None, help="the result file's prefix (default: the backend)")
    a("--save-result", action="store_true", help="write the result JSON")
    a("--result-dir", default=None, help="folder for the result JSON")
    a(
        "--result-filename",
        default=None,
        help="default: LABEL-RATEqps[-concurrencyN]-MODEL-YYYYmmdd-HHMMSS.json",
    )
    a("--plot", default=None, metavar="PNG", help="write latency CDFs and throughput/concurrency over time")


def load_tokenizer(path: str | None) -> Any:
    from engine.tokenizer import Tokenizer

    if path is None:
        from engine.bundled import bundled_model_dir

        return Tokenizer.from_dir(bundled_model_dir())
    return Tokenizer.from_dir(path)


def build_dataset(args: argparse.Namespace, tokenizer: Any) -> list[SampleRequest]:
    if args.dataset_name == "sharegpt":
        if not args.dataset_path:
            raise ValueError("--dataset-name sharegpt needs --dataset-path")
        return sharegpt_dataset(
            tokenizer, args.dataset_path, args.num_prompts, args.sharegpt_output_len, args.seed
        )
    if args.dataset_name == "prefix-repetition":
        return prefix_repetition_dataset(
            tokenizer,
            args.num_prompts,
            args.prefix_repetition_prefix_len,
            args.prefix_repetition_suffix_len,
            args.prefix_repetition_num_prefixes,
            args.prefix_repetition_output_len,
            args.seed,
        )
    return random_dataset(
        tokenizer,
        args.num_prompts,
        args.random_input_len,
        args.random_output_len,
        args.random_range_ratio,
        args.random_prefix_len,
        args.seed,
    )


_NAMES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2EL"}


def print_summary(r: dict[str, Any]) -> None:
    rows = [
        ("Successful requests:", r["completed"]),
        ("Failed requests:", r["failed"]),
        ("Benchmark duration (s):", f"{r['duration']:.2f}"),
        ("Total input tokens:", r["total_input_tokens"]),
        ("Total generated tokens:", r["total_output_tokens"]),
        ("Request throughput (req/s):", f"{r['request_throughput']:.2f}"),
    ]
    if r["request_goodput"] is not None:
        rows.append(("Request goodput (req/s):", f"{r['request_goodput']:.2f}"))
    rows += [
        ("Output token throughput (tok/s):", f"{r['output_throughput']:.2f}"),
        ("Peak output token throughput (tok/s):", f"{r['max_output_tokens_per_s']:.2f}"),
        ("Peak concurrent requests:", r["max_concurrent_requests"]),
        ("Total token throughput (tok/s):", f"{r['total_token_throughput']:.2f}"),
    ]
    print("{:=^50}".format(" Serving Benchmark Result "))
    for k, v in rows:
        print(f"{k:<40} {v!s:<10}")
    for name, label in _NAMES.items():
        if f"mean_{name}_ms" not in r:
            continue
        print("{:-^50}".format(f" {label} "))
        keys = [("Mean", f"mean_{name}_ms"), ("Median", f"median_{name}_ms")]
        keys += [(f"P{k[1:].split('_')[0]}", k) for k in r if k.startswith("p") and k.endswith(f"_{name}_ms")]
        for word, key in keys:
            print(f"{word + ' ' + label + ' (ms):':<40} {r[key]:<10.2f}")
    print("=" * 50)


def result_path(args: argparse.Namespace, model: str, now: str) -> Path:
    label = args.label or args.backend
    conc = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
    name = args.result_filename or f"{label}-{args.request_rate}qps{conc}-{model.split('/')[-1]}-{now}.json"
    return Path(args.result_dir or ".") / name


def cmd_bench(args: argparse.Namespace) -> int:
    args.dataset_name = args.dataset_name or ("sharegpt" if args.dataset_path else "random")
    ignore_eos = args.dataset_name != "sharegpt" if args.ignore_eos is None else args.ignore_eos
    selected = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    if unknown := set(selected) - set(METRICS):
        raise ValueError(f"--percentile-metrics: unknown {sorted(unknown)}; choose from {list(METRICS)}")
    percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    slo_ms = parse_goodput(args.goodput)
    endpoint = args.endpoint or (
        "/v1/chat/completions" if args.backend == "openai-chat" else "/v1/completions"
    )
    backend = "openai-chat" if endpoint.endswith("chat/completions") else args.backend
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    base = args.base_url.rstrip("/")
    model = args.model or first_model(base, headers)
    requests = build_dataset(args, load_tokenizer(args.tokenizer))
    cfg = LoadConfig(
        base + endpoint,
        backend,
        model,
        headers,
        args.request_rate,
        args.burstiness,
        args.max_concurrency,
        ignore_eos,
        args.temperature,
        args.seed,
        not args.disable_tqdm,
    )
    print(
        f"Traffic request rate: {args.request_rate}; burstiness {args.burstiness}; "
        f"maximum request concurrency: {args.max_concurrency}"
    )
    outputs, duration = asyncio.run(run_load(cfg, requests))
    result = calculate_metrics(outputs, duration, selected, percentiles, slo_ms)
    print_summary(result)
    for err in [o.error for o in outputs if o.error][:10]:
        print(f"pdserve bench: a request failed: {err[:500]}")
    now = datetime.now().strftime("%Y%m%d-%H%M%S")
    result = {
        "date": now,
        "endpoint_type": backend,
        "backend": backend,
        "label": args.label,
        "model_id": model,
        "tokenizer_id": args.tokenizer or "bundled",
        "num_prompts": args.num_prompts,
        "request_rate": args.request_rate if args.request_rate < float("inf") else "inf",
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        **result,
    }
    if args.save_result or args.result_filename:
        path = result_path(args, model, now)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2))
        print(f"pdserve bench: result written to {path}")
    if args.plot:
        from serving.bench_plot import save_plot

        save_plot(result, args.plot)
        print(f"pdserve bench: plot written to {args.plot}")
    return 0 if result["completed"] else 1
