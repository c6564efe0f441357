"""End to end on CPU with 3 prefill workers and the real model: requests that share a long prefix land
on the prefill worker holding it (the router learns that from the workers' own KV events: speculation is
off) and report prefix-cache hits in their usage."""

from __future__ import annotations

import re
import time

import httpx
import pytest

from tests.cluster import collect, greedy_request, start_cluster

pytestmark = pytest.mark.slow

SYSTEMS = [
    "You are a meticulous travel agent. Always list flights, hotels and trains with prices, and ask about "
    "budget, dates and seat preferences before booking anything. ",
    "You are a patient math tutor for high-school students. Explain each step, check the arithmetic twice "
    "and end with a short exercise for the student to try on their own. ",
    "You are a code reviewer for a Python team. Point out bugs first, then style, then tests; quote the line "
    "you mean and suggest the smallest fix that works. ",
]


@pytest.fixture(scope="module")
def cluster():
    c = start_cluster(3, 1, "tcp", "--policy", "prefix_aware", "--speculate-ttl-s", "0", "--metrics")
    yield c
    c.stop()


@pytest.fixture(scope="module")
def prefixes(bundled_model_dir):
    from engine.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(bundled_model_dir)
    out = [tok.encode(s * 8)[:160] for s in SYSTEMS]  # 10 full blocks each
    assert all(len(p) == 160 for p in out)
    return tok, out


def test_shared_prefixes_hit_the_worker_that_holds_them(cluster, prefixes):
    tok, systems = prefixes
    stub = cluster.stub()
    for i, p in enumerate(systems):  # first sight: computed somewhere, nothing cached yet
        _, _, usage = collect(stub.Generate(greedy_request(p + tok.encode(f" Question {i}?"), 2)))
        assert usage.cached_tokens == 0
    # the workers' events reach the router's index with its polls: every prefix's 10 blocks are in
    wait_for_index_entries(cluster.router_metrics_port, 3 * 10)
    for round_ in range(3):
        for i, p in enumerate(systems):
            suffix = tok.encode(f" Follow-up {round_} on topic {i}: tell me more.")
            _, _, usage = collect(stub.Generate(greedy_request(p + suffix, 2)))
            assert usage.cached_tokens >= 160, (round_, i, usage)
    prefill = [x for x in cluster.loads() if x.role == "prefill"]
    assert len(prefill) == 3
    cluster.wait_all_blocks_free()


def wait_for_index_entries(port: int, least: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    entries = 0.0
    while time.monotonic() < deadline:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        found = re.search(r"^pdserve:router_index_entries (\S+)$", text, re.M)
        entries = float(found.group(1)) if found else 0.0
        if entries >= least:
            return
        time.sleep(0.1)
    raise AssertionError(f"the router's index holds {entries} entries after {timeout} s, not {least}")
