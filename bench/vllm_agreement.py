"""`pdserve bench`'s figures against vLLM's own benchmark client, on the same traffic.

    python -m bench.vllm_agreement --vllm-benchmarks DIR [--url URL] [--num-prompts 24]
                                   [--max-concurrency 4] [--rounds 4] [--out-dir DIR]

DIR is the directory of vLLM's request functions: `vllm/benchmarks/lib/` (`endpoint_request_func.py`, what
`vllm bench serve` uses) or, in older vLLM, `benchmarks/` (`backend_request_func.py`); either needs aiohttp.
Nothing of it is copied here: its `async_request_openai_completions` is loaded from DIR at run time. Without --url, `pdserve serve` starts on the bundled model (CPU, aggregated) on a free port.

Both clients send the same random prompts (serving/bench_datasets.py), greedy, at the same concurrency, in
ABBA rounds (vLLM's, ours, ours, vLLM's, ...) after one untimed round of every prompt; the server this starts
has no prefix cache, so every round computes every prompt. vLLM's request function times the chunks; its figures are
derived as vLLM's `bench serve` does: TTFT, ITL pooled over every chunk after the first, E2EL, and
TPOT = (E2EL - TTFT) / (output tokens - 1), the output tokens from the server's usage where the function
reads it (else by tokenizing the generated text, as older vLLM did). Ours
come from serving/bench_client.py (output tokens from the server's usage). The record gives, for the mean
and median of each, the relative difference of ours from vLLM's (each client's rounds averaged) beside its
run-to-run noise (twice the standard error of that difference, from the rounds' spread), and whether both
clients saw the same texts (greedy: they must).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

COMMAND = "python -m bench.vllm_agreement --vllm-benchmarks DIR"
STATS = ("mean", "median")


def load_vllm_request_func(directory: Path) -> Any:
    path = next(
        (
            p
            for p in (directory / "endpoint_request_func.py", directory / "backend_request_func.py")
            if p.is_file()
        ),
        None,
    )
    if path is None:
        raise SystemExit(f"{directory} holds neither endpoint_request_func.py nor backend_request_func.py")
    spec = importlib.util.spec_from_file_location("vllm_backend_request_func", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def vllm_round(module: Any, url: str, model: str, requests: list, concurrency: int) -> list[Any]:
    """One round through vLLM's request function: current vLLM shares one aiohttp session (and its
    connections) and takes the temperature in extra_body; older vLLM opens a session per request and
    sends temperature 0 itself."""
    import inspect

    import aiohttp

    gate = asyncio.Semaphore(concurrency)
    func = module.async_request_openai_completions
    shared = "session" in inspect.signature(func).parameters
    fields = getattr(module.RequestFuncInput, "__dataclass_fields__", {})

    async def one(req: Any, session: Any) -> Any:
        kw = {"extra_body": {"temperature": 0.0}} if "extra_body" in fields else {}
        inp = module.RequestFuncInput(
            prompt=req.prompt, api_url=url, prompt_len=req.prompt_len, output_len=req.expected_output_len,
            model=model, **kw,
        )  # fmt: skip
        async with gate:
            return await (func(inp, session) if shared else func(inp))

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=module.AIOHTTP_TIMEOUT) as session:
        return list(await asyncio.gather(*(one(r, session) for r in requests)))


def vllm_figures(outputs: list[Any], tokenizer: Any) -> tuple[dict[str, float], list[str]]:
    """vLLM benchmark_serving's definitions over its request function's outputs."""
    from serving.bench_client import percentile_fields

    ok = [o for o in outputs if o.success]
    lens = [
        getattr(o, "output_tokens", 0) or len(tokenizer.encode(o.generated_text, add_special_tokens=False))
        for o in ok
    ]
    values = {
        "ttft": [o.ttft for o in ok],
        "tpot": [(o.latency - o.ttft) / (n - 1) for o, n in zip(ok, lens) if n > 1],
        "itl": [x for o in ok for x in o.itl],
        "e2el": [o.latency for o in ok],
    }
    out: dict[str, float] = {"completed": float(len(ok)), "output_tokens": float(sum(lens))}
    for name, v in values.items():
        out.update(percentile_fields(name, v, []))
    return out, [o.generated_text for o in outputs]


def ours_round(url: str, model: str, requests: list, concurrency: int) -> tuple[dict[str, float], list[str]]:
    from serving.bench_client import METRICS, LoadConfig, calculate_metrics, run_load

    cfg = LoadConfig(url, "openai", model, {}, max_concurrency=concurrency, show_progress=False)
    outputs, duration = asyncio.run(run_load(cfg, requests))
    m = calculate_metrics(outputs, duration, list(METRICS), [], {})
    figures = {k: float(v) for k, v in m.items() if k.endswith("_ms")}
    figures.update(completed=float(m["completed"]), output_tokens=float(m["total_output_tokens"]))
    return figures, [o.generated_text for o in outputs]


def start_server(port: int) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "serving.cli", "serve", "--prefill", "0", "--decode", "1", "--port", str(port),
        "--device", "cpu", "--dtype", "float32", "--max-model-len", "1024",
        "--no-enable-prefix-caching",  # every round computes its prompts, whichever client sends them
    ]  # fmt: skip
    return subprocess.Popen(cmd, start_new_session=True)


def wait_ready(base: str, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"pdserve serve exited with {proc.returncode}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit("pdserve serve did not become healthy")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vllm-benchmarks", type=Path, required=True, help="vLLM's benchmarks/ directory")
    p.add_argument("--url", default=None, help="an OpenAI-compatible server's base URL (default: start one)")
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--max-concurrency", type=int, default=4)
    p.add_argument("--rounds", type=int, default=4, help="rounds per client, in ABBA order")
    p.add_argument("--out-dir", type=Path, default=None)
    args = p.parse_args()
    module = load_vllm_request_func(args.vllm_benchmarks)
    args.vllm_source = Path(module.__file__).name

    from engine.bundled import bundled_model_dir
    from engine.tokenizer import Tokenizer
    from serving.bench_client import first_model
    from serving.bench_datasets import random_dataset
    from serving.roles import free_port

    proc = None
    base = args.url
    if base is None:
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        proc = start_server(port)
    try:
        if proc is not None:
            wait_ready(base, proc)
        model = first_model(base, {})
        tokenizer = Tokenizer.from_dir(bundled_model_dir())
        requests = random_dataset(tokenizer, args.num_prompts, args.input_len, args.output_len, 0.0, 0, 0)
        url = base.rstrip("/") + "/v1/completions"
        # One untimed round of every prompt: each timed round then finds the server in the same state (and
        # a server with a prefix cache holds every prompt already: no client's round pays the misses).
        ours_round(url, model, requests, args.max_concurrency)
        rounds: dict[str, list[dict[str, float]]] = {"vllm": [], "ours": []}
        texts: dict[str, list[list[str]]] = {"vllm": [], "ours": []}

        def run(client: str) -> tuple[dict[str, float], list[str]]:
            if client == "ours":
                return ours_round(url, model, requests, args.max_concurrency)
            outputs = asyncio.run(vllm_round(module, url, model, requests, args.max_concurrency))
            return vllm_figures(outputs, tokenizer)

        for i in range(args.rounds):  # ABBA: vLLM's, ours, ours, vLLM's, ... so drift falls on both alike
            for client in ("vllm", "ours") if i % 2 == 0 else ("ours", "vllm"):
                fig, txt = run(client)
                rounds[client].append(fig)
                texts[client].append(txt)
    finally:
        if proc is not None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=120)
    report(args, rounds, texts)


def report(args: argparse.Namespace, rounds: dict, texts: dict) -> None:
    from bench.record import record

    def avg(client: str, key: str) -> float:
        return statistics.fmean(r[key] for r in rounds[client])

    def sem2(client: str, key: str) -> float:  # the squared standard error of a client's mean over its rounds
        values = [r[key] for r in rounds[client]]
        return statistics.variance(values) / len(values) if len(values) > 1 else 0.0

    diffs = {}
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in STATS:
            key = f"{stat}_{name}_ms"
            v, o = avg("vllm", key), avg("ours", key)
            # run-to-run noise: twice the standard error of the difference of the two means, relative to vLLM's
            noise = 2 * math.sqrt(sem2("vllm", key) + sem2("ours", key)) / v
            diffs[key] = {"vllm": v, "ours": o, "relative_difference": o / v - 1, "noise_2se": noise}
    worst = max(abs(d["relative_difference"]) for d in diffs.values())
    within_noise = all(abs(d["relative_difference"]) <= d["noise_2se"] for d in diffs.values())
    same_texts = all(t == texts["vllm"][0] for client in texts for t in texts[client])
    tokens = {c: avg(c, "output_tokens") for c in rounds}
    for key, d in diffs.items():
        print(
            f"{key:>18}: vLLM {d['vllm']:8.2f}  ours {d['ours']:8.2f}  {d['relative_difference']:+.3f}"
            f"  (noise +-{d['noise_2se']:.3f})"
        )
    print(f"every difference within its run-to-run noise: {within_noise}")
    print(
        f"same texts from both clients: {same_texts}; output tokens vLLM {tokens['vllm']:.0f}, ours {tokens['ours']:.0f}"
    )
    record(
        "bench_client_agreement_vllm", worst, "fraction (largest |ours / vLLM - 1| over mean and median TTFT, TPOT, ITL, E2EL)",
        baseline=0.0, baseline_name=f"vLLM's benchmark client ({args.vllm_source}), same prompts, same server, ABBA rounds",
        ratio=worst, goal="agree within run-to-run noise (2 standard errors of the difference)",
        out_dir=args.out_dir, command=COMMAND,
        extra={"figures": diffs, "within_noise": within_noise, "same_texts": same_texts, "output_tokens": tokens, "rounds": rounds,
               "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
               "max_concurrency": args.max_concurrency},
    )  # fmt: skip


if __name__ == "__main__":
    main()
