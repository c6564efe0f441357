from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from engine.tokenizer import Tokenizer
from tests.chaos.tools import RedisServer, Stack, one_thread_per_engine
from tests.cluster import start_cluster, start_gateway


@pytest.fixture(scope="package")
def stack(bundled_model_dir) -> Iterator[Stack]:
    """redis-server, `pdserve up` with two prefill workers and one decode worker sharing the index through
    it, and the gateway: one stack for every chaos case that leaves it standing."""
    server = RedisServer()
    server.start()
    try:
        with one_thread_per_engine():
            cluster = start_cluster(2, 1, "tcp", "--redis-url", server.url, "--policy", "prefix_aware")
        try:
            proc, url = start_gateway(cluster.router)
            try:
                model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
                yield Stack(server, cluster, url, model, Tokenizer.from_dir(bundled_model_dir))
            finally:
                proc.terminate()
                proc.wait(timeout=30)
        finally:
            cluster.stop()
    finally:
        server.stop()
