"""Router.Embed on real processes (`pdserve up`, the bundled model on CPU): the prefill worker that holds the
prompt's prefix computes it (its blocks then cached there), a decode worker in aggregated serving; vectors equal
transformers' last-token states; bad requests get INVALID_ARGUMENT with a message, and nothing leaks."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from engine.tokenizer import Tokenizer
from gateway.errors import is_plain
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc
from tests.cluster import Cluster, health, start_cluster, wait_until
from tests.hf_reference import hf_embedding

pytestmark = pytest.mark.slow

TEXTS = [
    "The capital of France is Paris, the capital of Italy is Rome, and the capital of Spain is Madrid; all three "
    "are old cities on rivers with bridges, markets and churches.",  # two full blocks of 16 tokens and more
    "hello",
]
ATOL = 2e-5


@pytest.fixture(scope="module", params=[(1, 1), (0, 1)], ids=["disaggregated", "aggregated"])
def cluster(request) -> Iterator[Cluster]:
    prefill, decode = request.param
    c = start_cluster(prefill, decode, "tcp")
    try:
        yield c
    finally:
        c.stop()


def embed(cluster: Cluster, **fields) -> pb.EmbedResponse:
    with grpc.insecure_channel(cluster.router) as channel:
        return pb_grpc.RouterStub(channel).Embed(pb.EmbedRequest(**fields), timeout=120)


def test_embeddings_equal_transformers_and_reuse_the_prefix_cache(
    cluster: Cluster, bundled_model_dir: Path
) -> None:
    tok = Tokenizer.from_dir(bundled_model_dir)
    for text in TEXTS:
        got = embed(cluster, text=text)
        ids = tok.encode(text)
        assert got.prompt_tokens == len(ids) and got.request_id
        torch.testing.assert_close(
            torch.tensor(got.embedding), hf_embedding(bundled_model_dir, ids), rtol=0, atol=ATOL
        )
    again = embed(cluster, token_ids=pb.TokenIds(ids=tok.encode(TEXTS[0])))
    assert (
        len(tok.encode(TEXTS[0])) > 32 and again.cached_tokens == 32
    )  # its full blocks, cached by the first
    raw = embed(cluster, text=TEXTS[1], pooling=pb.PoolingParams(normalize=False))
    want = hf_embedding(bundled_model_dir, tok.encode(TEXTS[1]), normalize=False)
    torch.testing.assert_close(torch.tensor(raw.embedding), want, rtol=0, atol=1e-4)
    cut = embed(cluster, text=TEXTS[0], truncate_prompt_tokens=4)
    want = hf_embedding(bundled_model_dir, tok.encode(TEXTS[0])[-4:])
    assert cut.prompt_tokens == 4
    torch.testing.assert_close(torch.tensor(cut.embedding), want, rtol=0, atol=ATOL)
    cluster.wait_all_blocks_free()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"text": ""}, "empty"),
        ({"token_ids": pb.TokenIds(ids=[1, 2, 10**6])}, "out of the vocabulary"),
        ({"text": "hi", "pooling": pb.PoolingParams(dimensions=8)}, "does not support Matryoshka"),
        ({"text": "hi", "pooling": pb.PoolingParams(dimensions=0)}, "dimensions must be at least 1"),
        ({"text": "hi", "model": "nope"}, "nope"),
        ({"token_ids": pb.TokenIds(ids=[5] * 1024)}, "max_model_len is 1024"),
    ],
)
def test_bad_requests_are_refused_with_their_reason(cluster: Cluster, fields: dict, message: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        embed(cluster, **fields)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert message in info.value.details()


def test_a_cancelled_call_frees_what_it_held(cluster: Cluster) -> None:
    with grpc.insecure_channel(cluster.router) as channel:
        stub = pb_grpc.RouterStub(channel)
        futures = [
            stub.Embed.future(pb.EmbedRequest(token_ids=pb.TokenIds(ids=[7 + i] * 300))) for i in range(4)
        ]
        for f in futures:  # wherever each is by now: the router, the worker's queue or its forward pass
            f.cancel()
    assert all(f.cancelled() or f.done() for f in futures)
    cluster.wait_all_blocks_free(timeout=60)
    assert embed(cluster, text="hello").embedding  # and the workers serve on


def test_a_worker_killed_under_an_embedding_fails_it_plainly_and_comes_back(cluster: Cluster) -> None:
    """The worker that embeds (the prefill worker, or the decode worker in aggregated serving) is killed with an
    embedding in flight: the call ends UNAVAILABLE with a sentence, `up` restarts the worker on its address, and
    embeddings are served again."""
    roles = {w["role"]: w for w in cluster.workers}
    victim = roles.get("prefill") or roles["decode"]
    with grpc.insecure_channel(cluster.router) as channel:
        call = pb_grpc.RouterStub(channel).Embed.future(pb.EmbedRequest(token_ids=pb.TokenIds(ids=[9] * 600)))
        os.kill(victim["pid"], signal.SIGKILL)
        with pytest.raises(grpc.RpcError) as info:
            call.result(timeout=120)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
    assert is_plain(info.value.details()) and "retry" in info.value.details(), info.value.details()
    restarted = json.loads(cluster.wait_line("pdserve restarted: ", timeout=60))
    assert restarted["address"] == victim["address"]
    wait_until(lambda: health(victim["address"]) == "SERVING", 180, "the restarted worker serving")
    victim["pid"] = restarted["pid"]

    def served() -> bool:
        try:
            return len(embed(cluster, text="hello").embedding) == 576
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc.details()  # until the router sees it up
            return False

    wait_until(served, 60, "an embedding served again", every=0.2)
