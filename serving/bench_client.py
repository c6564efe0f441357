"""`pdserve bench`: a serving benchmark client for any OpenAI-compatible endpoint, with vLLM `bench serve`'s
flags, definitions and result fields.

Per request: TTFT is the time to the first streamed chunk that carries a choice, ITL the gap between such
chunks (pooled over all requests), E2EL the time to the last one, TPOT = (E2EL - TTFT) / (output tokens - 1),
with the output tokens taken from the server's `usage` (stream_options.include_usage).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from serving.bench_datasets import SampleRequest

METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestOutput:
    prompt_len: int
    success: bool = False
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0  # E2EL
    start_time: float = 0.0  # time.perf_counter() when sent
    output_tokens: int | None = None  # the server's usage.completion_tokens
    generated_text: str = ""
    error: str = ""


def request_body(backend: str, model: str, req: SampleRequest, ignore_eos: bool, temperature: float) -> dict:
    body: dict[str, Any] = {
        "model": model,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if backend == "openai-chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
        body["max_completion_tokens"] = req.expected_output_len
    else:
        body["prompt"] = req.prompt
        body["max_tokens"] = req.expected_output_len
    if ignore_eos:
        body["ignore_eos"] = True  # vLLM's extra; sent only when asked for, as OpenAI itself refuses it
    return body


def _chunk_text(choice: dict) -> str:
    if "delta" in choice:
        return choice["delta"].get("content") or ""
    return choice.get("text") or ""


async def send_request(
    client: httpx.AsyncClient, url: str, body: dict, headers: dict, prompt_len: int
) -> RequestOutput:
    """One streamed request, timed at each server-sent event as it arrives."""
    out = RequestOutput(prompt_len)
    st = last = time.perf_counter()
    out.start_time = st
    text: list[str] = []
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                out.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')}"
                return out
            async for line in resp.aiter_lines():
                now = time.perf_counter()
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    continue
                data = json.loads(payload)
                if "error" in data:
                    out.error = json.dumps(data["error"])
                    return out
                if choices := data.get("choices"):
                    if not text:
                        out.ttft = now - st
                    else:
                        out.itl.append(now - last)
                    last = now
                    text.append(_chunk_text(choices[0]))
                elif usage := data.get("usage"):
                    out.output_tokens = usage.get("completion_tokens")
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
        return out
    out.generated_text = "".join(text)
    out.latency = last - st
    out.success = bool(text)
    if not text:
        out.error = "the stream ended before its first chunk"
    return out


def arrival_delays(n: int, request_rate: float, burstiness: float, rng: np.random.Generator) -> list[float]:
    """Each request's send time after the first, in seconds: all at once at an infinite rate, otherwise
    gamma-distributed gaps (shape `burstiness`, mean 1/rate; 1 is a Poisson process), scaled so the last
    falls at n / rate as vLLM does."""
    if burstiness <= 0:
        raise ValueError("--burstiness must be positive")
    if request_rate == float("inf"):
        return [0.0] * n
    if burstiness == float("inf"):
        gaps = np.full(n, 1.0 / request_rate)
    else:
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)
    delays = np.cumsum(gaps)
    if delays[-1] > 0:
        delays *= (n / request_rate) / delays[-1]
    return [float(x) for x in delays]


# ---- metrics, as vLLM's calculate_metrics ----------------------------------------------------------------


def percentile_fields(name: str, values_s: list[float], percentiles: list[float]) -> dict[str, float]:
    """mean/median/std/pN of `values_s` (seconds) in ms, under vLLM's keys (`p99_ttft_ms`, `p99.9_...`)."""
    v = values_s or [0.0]
    out = {
        f"mean_{name}_ms": float(np.mean(v)) * 1000,
        f"median_{name}_ms": float(np.median(v)) * 1000,
        f"std_{name}_ms": float(np.std(v)) * 1000,
    }
    for p in percentiles:
        word = str(int(p)) if int(p) == p else str(p)
        out[f"p{word}_{name}_ms"] = float(np.percentile(v, p)) * 1000
    return out


def tpot_of(o: RequestOutput, output_len: int) -> float:
    return (o.latency - o.ttft) / (output_len - 1) if output_len > 1 else 0.0


def is_good(o: RequestOutput, output_len: int, slo_ms: dict[str, float]) -> bool:
    measured = {"ttft": o.ttft, "tpot": tpot_of(o, output_len), "e2el": o.latency}
    return all(measured[k] <= ms / 1000 for k, ms in slo_ms.items())


def peak_output_rate(outputs: list[RequestOutput]) -> float:
    """Most output chunks in any one-second bucket from the first send (vLLM's max_output_tokens_per_s)."""
    if not outputs:
        return 0.0
    t0 = min(o.start_time for o in outputs)
    times = [np.cumsum([o.start_time + o.ttft - t0, *o.itl]) for o in outputs]
    counts = np.bincount(np.concatenate(times).astype(int))
    return float(counts.max())


def peak_concurrency(outputs: list[RequestOutput]) -> int:
    events = sorted([(o.start_time, 1) for o in outputs] + [(o.start_time + o.latency, -1) for o in outputs])
    now = peak = 0
    for _, delta in events:
        now += delta
        peak = max(peak, now)
    return peak


def calculate_metrics(
    outputs: list[RequestOutput],
    duration_s: float,
    selected: list[str],
    percentiles: list[float],
    slo_ms: dict[str, float],
) -> dict[str, Any]:
    ok = [o for o in outputs if o.success]
    output_lens = [(o.output_tokens or 1) if o.success else 0 for o in outputs]
    ok_lens = [n for o, n in zip(outputs, output_lens) if o.success]
    total_in = sum(o.prompt_len for o in ok)
    total_out = sum(output_lens)
    values = {
        "ttft": [o.ttft for o in ok],
        "tpot": [tpot_of(o, n) for o, n in zip(ok, ok_lens) if n > 1],
        "itl": [x for o in ok for x in o.itl],
        "e2el": [o.latency for o in ok],
    }
    good = sum(is_good(o, n, slo_ms) for o, n in zip(ok, ok_lens))
    result: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(outputs) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration_s,
        "request_goodput": good / duration_s if slo_ms else None,
        "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
        "input_lens": [o.prompt_len for o in outputs],
        "output_lens": output_lens,
        "ttfts": [o.ttft for o in outputs],
        "itls": [o.itl for o in outputs],
        "latencies": [o.latency for o in outputs],
        "start_times": [o.start_time for o in outputs],
        "generated_texts": [o.generated_text for o in outputs],
        "errors": [o.error for o in outputs],
        "max_output_tokens_per_s": peak_output_rate(ok),
        "max_concurrent_requests": peak_concurrency(ok),
    }
    for name in METRICS:
        if name in selected:
            result.update(percentile_fields(name, values[name], percentiles))
    return result


# ---- the run ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadConfig:
    url: str
    backend: str
    model: str
    headers: dict[str, str]
    request_rate: float = float("inf")
    burstiness: float = 1.0
    max_concurrency: int | None = None
    ignore_eos: bool = False
    temperature: float = 0.0
    seed: int = 0
    show_progress: bool = True


class _Progress:
    """tqdm's bar where tqdm is installed, a plain line per tenth of the requests otherwise."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.bar = total, 0, None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total)
            except ImportError:
                pass
        self.plain = enabled and self.bar is None

    def update(self) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)
        elif self.plain and (self.done == self.total or self.done % max(1, self.total // 10) == 0):
            print(f"pdserve bench: {self.done}/{self.total} requests done", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


async def run_load(cfg: LoadConfig, requests: list[SampleRequest]) -> tuple[list[RequestOutput], float]:
    """Send every request on its arrival schedule, at most `max_concurrency` at once; the outputs in the
    requests' order and the wall time from the first send to the last answer."""
    delays = arrival_delays(len(requests), cfg.request_rate, cfg.burstiness, np.random.default_rng(cfg.seed))
    gate: Any = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else contextlib.nullcontext()
    progress = _Progress(len(requests), cfg.show_progress)
    limits = httpx.Limits(
        max_connections=cfg.max_concurrency or len(requests), max_keepalive_connections=None
    )
    timeout = httpx.Timeout(6 * 3600.0, connect=60.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:

        async def one(req: SampleRequest) -> RequestOutput:
            body = request_body(cfg.backend, cfg.model, req, cfg.ignore_eos, cfg.temperature)
            async with gate:
                out = await send_request(client, cfg.url, body, cfg.headers, req.prompt_len)
            progress.update()
            return out

        start = time.perf_counter()
        tasks = []
        for req, delay in zip(requests, delays):
            if (wait := start + delay - time.perf_counter()) > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(one(req)))
        outputs = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    progress.close()
    return list(outputs), duration


def first_model(base_url: str, headers: dict[str, str]) -> str:
    r = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    r.raise_for_status()
    data = r.json().get("data") or []
    if not data:
        raise ValueError(f"{base_url}/v1/models lists no model")
    return str(data[0]["id"])


def parse_goodput(pairs: list[str] | None) -> dict[str, float]:
    """`ttft:500 tpot:50` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    out: dict[str, float] = {}
    for pair in pairs or []:
        name, sep, value = pair.partition(":")
        if not sep or name not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"--goodput {pair!r}: expected ttft:MS, tpot:MS or e2el:MS")
        try:
            out[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {pair!r}: {value!r} is not a number of milliseconds") from None
        if out[name] < 0:
            raise ValueError(f"--goodput {pair!r}: the objective must be non-negative")
    return out
