"""`pdserve bench`: the metric definitions on hand-made timings, the datasets, the figure, and one run against
the real CPU stack whose token counts must equal the gateway's."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import numpy as np
import pytest

from serving.bench_client import (
    RequestOutput,
    arrival_delays,
    calculate_metrics,
    parse_goodput,
    percentile_fields,
)
from serving.bench_plot import (
    CDF_XLABEL,
    CDF_YLABEL,
    CONCURRENCY_YLABEL,
    RATE_YLABEL,
    TIME_XLABEL,
    build_figure,
)


def _out(start: float, ttft: float, itl: list[float], tokens: int, prompt_len: int = 10) -> RequestOutput:
    return RequestOutput(
        prompt_len,
        success=True,
        ttft=ttft,
        itl=itl,
        latency=ttft + sum(itl),
        start_time=start,
        output_tokens=tokens,
        generated_text="x",
    )


# request A: TTFT 0.1, 4 chunks after it 0.05 apart -> E2EL 0.3, 5 tokens -> TPOT 0.2 / 4 = 0.05
# request B: TTFT 0.4, 1 chunk of 3 tokens after 0.2 -> E2EL 0.6, TPOT 0.2 / 2 = 0.1 (ITL 0.2: one chunk)
# request C: failed
A = _out(100.0, 0.1, [0.05] * 4, 5, prompt_len=7)
B = _out(100.5, 0.4, [0.2], 3, prompt_len=9)
C = RequestOutput(11, error="HTTP 500: boom")


def test_metrics_follow_vllms_definitions():
    r = calculate_metrics([A, B, C], 2.0, ["ttft", "tpot", "itl", "e2el"], [50, 90, 99], {})
    assert (r["completed"], r["failed"]) == (2, 1)
    assert r["total_input_tokens"] == 16  # failed requests count nothing
    assert r["total_output_tokens"] == 8
    assert r["output_lens"] == [5, 3, 0]
    assert r["request_throughput"] == pytest.approx(1.0)
    assert r["output_throughput"] == pytest.approx(4.0)
    assert r["total_token_throughput"] == pytest.approx(12.0)
    assert r["request_goodput"] is None
    assert r["mean_ttft_ms"] == pytest.approx(250.0)
    assert r["mean_tpot_ms"] == pytest.approx(75.0)
    assert r["median_tpot_ms"] == pytest.approx(75.0)
    # ITL pooled over chunks: four of 50 ms and one of 200 ms
    assert r["mean_itl_ms"] == pytest.approx(80.0)
    assert r["median_itl_ms"] == pytest.approx(50.0)
    assert r["p90_itl_ms"] == pytest.approx(np.percentile([50, 50, 50, 50, 200], 90))
    assert r["mean_e2el_ms"] == pytest.approx(450.0)
    assert r["p50_e2el_ms"] == pytest.approx(450.0)
    assert r["p50_e2el_ms"] <= r["p90_e2el_ms"] <= r["p99_e2el_ms"] <= 600.0
    assert r["max_concurrent_requests"] == 1  # A ends at 100.3, before B starts
    # chunks at 100.1 .. 100.3 (A: 5) and 100.9, 101.1 (B): 6 in second 0, 1 in second 1
    assert r["max_output_tokens_per_s"] == 6.0


def test_goodput_counts_requests_meeting_every_objective():
    slo = parse_goodput(["ttft:200", "tpot:80"])
    assert slo == {"ttft": 200.0, "tpot": 80.0}
    r = calculate_metrics([A, B, C], 2.0, ["ttft"], [99], slo)
    assert r["request_goodput"] == pytest.approx(0.5)  # A only: B's TTFT and TPOT both miss
    loose = calculate_metrics([A, B, C], 2.0, ["ttft"], [99], parse_goodput(["e2el:601"]))
    assert loose["request_goodput"] == pytest.approx(1.0)
    assert "mean_tpot_ms" not in r  # only the selected metrics
    with pytest.raises(ValueError):
        parse_goodput(["itl:5"])
    with pytest.raises(ValueError):
        parse_goodput(["ttft=5"])


def test_percentile_keys_and_single_token_requests():
    keys = percentile_fields("ttft", [0.001, 0.002], [99, 99.9])
    assert set(keys) == {"mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p99_ttft_ms", "p99.9_ttft_ms"}
    one = _out(0.0, 0.1, [], 1)
    r = calculate_metrics([one], 1.0, ["tpot"], [99], parse_goodput(["tpot:0"]))
    assert r["mean_tpot_ms"] == 0.0  # no TPOT sample for a one-token output
    assert r["request_goodput"] == 1.0  # its TPOT counts as 0 against the objective, as vLLM


def test_arrival_delays():
    rng = np.random.default_rng(0)
    assert arrival_delays(5, float("inf"), 1.0, rng) == [0.0] * 5
    even = arrival_delays(4, 2.0, float("inf"), rng)
    assert even == pytest.approx([0.5, 1.0, 1.5, 2.0])
    for burstiness in (0.5, 1.0, 4.0):
        d = arrival_delays(200, 10.0, burstiness, np.random.default_rng(1))
        assert d[-1] == pytest.approx(20.0) and all(b >= a for a, b in zip(d, d[1:]))
    gaps_bursty = np.diff(arrival_delays(2000, 10.0, 0.25, np.random.default_rng(2)))
    gaps_even = np.diff(arrival_delays(2000, 10.0, 4.0, np.random.default_rng(2)))
    assert gaps_bursty.std() > 2 * gaps_even.std()


def test_datasets_have_the_asked_lengths(bundled_model_dir):
    from engine.tokenizer import Tokenizer
    from serving.bench_datasets import prefix_repetition_dataset, random_dataset

    tok = Tokenizer.from_dir(bundled_model_dir)
    reqs = random_dataset(tok, 8, 32, 8, 0.0, 4, seed=0)
    assert [r.expected_output_len for r in reqs] == [8] * 8
    assert all(abs(r.prompt_len - 36) <= 2 for r in reqs)
    assert all(len(tok.encode(r.prompt, add_special_tokens=False)) == r.prompt_len for r in reqs)
    assert random_dataset(tok, 8, 32, 8, 0.0, 4, seed=0) == reqs  # seeded
    varied = random_dataset(tok, 50, 40, 20, 0.5, 0, seed=1)
    assert all(10 <= r.expected_output_len <= 30 for r in varied)
    assert len({r.expected_output_len for r in varied}) > 5

    rep = prefix_repetition_dataset(tok, 6, 16, 8, 2, 5, seed=0)
    assert len(rep) == 6 and len({r.prompt[:20] for r in rep}) == 2

    with pytest.raises(ValueError):
        prefix_repetition_dataset(tok, 5, 16, 8, 2, 5, seed=0)


def test_sharegpt_file(tmp_path, bundled_model_dir):
    from engine.tokenizer import Tokenizer
    from serving.bench_datasets import sharegpt_dataset

    tok = Tokenizer.from_dir(bundled_model_dir)
    convs = [
        {
            "conversations": [
                {"from": "human", "value": f"Tell me about the number {i} please."},
                {"from": "gpt", "value": f"The number {i} is a fine number indeed."},
            ]
        }
        for i in range(5)
    ] + [{"conversations": [{"from": "human", "value": "hi"}]}]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(convs))
    reqs = sharegpt_dataset(tok, str(path), 3, None, seed=0)
    assert len(reqs) == 3
    for r in reqs:
        assert r.prompt.startswith("Tell me") and r.prompt_len == len(
            tok.encode(r.prompt, add_special_tokens=False)
        )
    assert [r.expected_output_len for r in sharegpt_dataset(tok, str(path), 2, 7, seed=0)] == [7, 7]


def test_figure_axes():
    r = calculate_metrics([A, B, C], 2.0, ["ttft"], [99], {})
    fig = build_figure(r)
    cdf, rate, conc = fig.axes
    assert (cdf.get_xlabel(), cdf.get_ylabel()) == (CDF_XLABEL, CDF_YLABEL)
    assert [t.get_text() for t in cdf.get_legend().get_texts()] == ["TTFT", "TPOT", "ITL", "E2EL"]
    assert (rate.get_xlabel(), rate.get_ylabel()) == (TIME_XLABEL, RATE_YLABEL)
    assert (conc.get_xlabel(), conc.get_ylabel()) == (TIME_XLABEL, CONCURRENCY_YLABEL)
    assert max(conc.get_lines()[0].get_ydata()) == 1


# ---- against the real stack ------------------------------------------------------------------------------


def _counter(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not on {url}/metrics")


@pytest.fixture(scope="module")
def served(bundled_model_dir):
    """The CPU stack: router, one prefill and one decode worker, the gateway; its URL."""
    from tests.cluster import start_cluster, start_gateway

    cluster = start_cluster(1, 1, "tcp")
    try:
        proc, url = start_gateway(cluster.router, "--api-key", KEY)
        try:
            yield url
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    finally:
        cluster.stop()


KEY = "sk-bench"


def _bench(url: str, tmp_path, *flags: str) -> tuple[dict, str, float, float]:
    """`pdserve bench` as a subprocess: its result JSON, its stdout, and the gateway's generated and prompt
    token counters' rise over the run."""
    names = ("pdserve:generation_tokens_total", "pdserve:prompt_tokens_total")
    before = [_counter(url, n) for n in names]
    cmd = [sys.executable, "-m", "serving.cli", "bench", "--base-url", url, "--api-key", KEY]
    cmd += ["--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json", *flags]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    generated, prompt = (_counter(url, n) - b for n, b in zip(names, before))
    return json.loads((tmp_path / "r.json").read_text()), run.stdout, generated, prompt


@pytest.mark.slow
def test_bench_random_completions_against_the_cpu_stack(served, tmp_path):
    from PIL import Image

    png = tmp_path / "bench.png"
    flags = ["--dataset-name", "random", "--num-prompts", "8", "--random-input-len", "32"]
    flags += [
        "--random-output-len",
        "8",
        "--max-concurrency",
        "4",
        "--plot",
        str(png),
        "--goodput",
        "ttft:60000",
    ]
    r, stdout, gateway_tokens, gateway_prompt = _bench(served, tmp_path, *flags)

    assert r["completed"] == 8 and r["failed"] == 0 and r["num_prompts"] == 8
    assert r["total_output_tokens"] == 8 * 8 == gateway_tokens
    assert r["output_lens"] == [8] * 8
    assert r["total_input_tokens"] == gateway_prompt
    assert r["request_goodput"] == pytest.approx(r["request_throughput"])
    assert 0 < r["max_concurrent_requests"] <= 4 and r["max_concurrency"] == 4
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert r[f"mean_{name}_ms"] > 0
        assert r[f"median_{name}_ms"] <= r[f"p90_{name}_ms"] <= r[f"p99_{name}_ms"]
    assert r["mean_ttft_ms"] < r["mean_e2el_ms"]
    assert all(t > 0 for t in r["ttfts"]) and all(len(x) >= 1 for x in r["itls"])
    for key in (
        "duration",
        "request_throughput",
        "output_throughput",
        "total_token_throughput",
        "input_lens",
        "generated_texts",
        "errors",
        "max_output_tokens_per_s",
        "model_id",
        "date",
    ):
        assert key in r
    assert "Serving Benchmark Result" in stdout

    img = np.asarray(Image.open(png).convert("L"))
    assert img.shape == (450, 1500)
    assert img.std() > 10 and (img < 128).mean() > 0.01  # not blank: axes, text and curves drawn


@pytest.mark.slow
def test_bench_chat_with_shared_prefixes_at_a_request_rate(served, tmp_path):
    flags = ["--backend", "openai-chat", "--dataset-name", "prefix-repetition", "--num-prompts", "4"]
    flags += ["--prefix-repetition-prefix-len", "16", "--prefix-repetition-suffix-len", "8"]
    flags += ["--prefix-repetition-num-prefixes", "2", "--prefix-repetition-output-len", "6"]
    flags += ["--request-rate", "20", "--burstiness", "0.5", "--percentile-metrics", "ttft,e2el"]
    r, _stdout, gateway_tokens, _prompt = _bench(served, tmp_path, *flags)
    assert r["completed"] == 4 and r["endpoint_type"] == "openai-chat"
    assert r["total_output_tokens"] == 4 * 6 == gateway_tokens
    assert r["request_rate"] == 20.0 and r["burstiness"] == 0.5
    assert "mean_tpot_ms" not in r and r["p99_ttft_ms"] >= r["median_ttft_ms"] > 0
    assert all(text for text in r["generated_texts"])  # chat deltas' content collected
