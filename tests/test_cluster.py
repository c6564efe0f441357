"""Disaggregated serving with real processes over gRPC on CPU: router, prefill and decode workers,
KV over tcp and gloo. Greedy output equals transformers'; no leaks; clean errors; a dead worker ends
its streams with UNAVAILABLE and the cluster keeps serving."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc
from tests.cluster import collect, greedy_request, start_cluster
from tests.hf_reference import hf_greedy

pytestmark = pytest.mark.slow

TEXTS = [
    "The capital of France is",
    "def add(a, b):",
    "Once upon a time",
    "List three fruits:",
    "Water boils at",
    "The quick brown fox jumps over",
]
MAX_TOKENS = [10, 8, 12, 6, 9, 7, 11, 5]


@pytest.fixture(scope="module")
def prompts(bundled_model_dir):
    from engine.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(bundled_model_dir)
    ids = [tok.encode("Hi")[:1]] + [tok.encode(t) for t in TEXTS]
    ids.append(
        tok.encode("Paging keeps memory tidy: blocks of sixteen tokens, hashed and shared. " * 40)[:300]
    )
    return ids


@pytest.fixture(scope="module")
def expected(bundled_model_dir, prompts):
    return hf_greedy(bundled_model_dir, prompts, MAX_TOKENS[: len(prompts)])


def run_batch(cluster, prompts) -> list[list[int]]:
    stub = cluster.stub()
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(
            pool.map(
                lambda a: collect(stub.Generate(greedy_request(*a))), zip(prompts, MAX_TOKENS[: len(prompts)])
            )
        )
    return [r[0][0] for r in results]


@pytest.fixture(scope="module")
def tcp_1x1():
    cluster = start_cluster(1, 1, "tcp")
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def gloo_2x2():
    cluster = start_cluster(2, 2, "nccl")  # the nccl transport runs over gloo on CPU
    yield cluster
    cluster.stop()


def test_tcp_1x1_matches_transformers(tcp_1x1, prompts, expected):
    assert run_batch(tcp_1x1, prompts) == expected
    tcp_1x1.wait_all_blocks_free()


def test_usage_and_text(tcp_1x1, bundled_model_dir):
    req = pb.GenerateRequest(
        chat=pb.ChatMessages(
            messages=[pb.ChatMessage(role="user", content="What is the capital of France?")],
            add_generation_prompt=True,
        ),
        sampling=pb.SamplingParams(temperature=0, max_tokens=30),
    )
    tokens, texts, usage = collect(tcp_1x1.stub().Generate(req))
    assert "Paris" in texts[0]
    assert usage is not None and usage.completion_tokens == len(tokens[0]) and usage.prompt_tokens > 20


def test_stop_string_and_n(tcp_1x1, prompts):
    req = greedy_request(prompts[1], 30, stop=["\n"])
    tokens, texts, _ = collect(tcp_1x1.stub().Generate(req))
    assert "\n" not in texts[0]
    req = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompts[-1]),
        sampling=pb.SamplingParams(temperature=1.0, n=3, seed=11, max_tokens=6),
    )
    tokens, _, usage = collect(tcp_1x1.stub().Generate(req))
    assert sorted(tokens) == [0, 1, 2] and usage.completion_tokens == 18
    assert usage.cached_tokens >= 0
    tcp_1x1.wait_all_blocks_free()


def test_prompt_logprobs_come_once_on_completion_0s_first_chunk(tcp_1x1, prompts):
    """From the prefill worker through the decode worker and the router: one per prompt token after the first,
    on completion 0's first chunk only (n = 2 computes them once)."""
    prompt = prompts[1]
    req = greedy_request(prompt, 3, n=2, prompt_logprobs=1)
    replies = list(tcp_1x1.stub().Generate(req))
    first = next(r for r in replies if r.index == 0 and r.token_ids)
    assert [r for r in replies if r.prompt_logprobs] == [first]
    assert [lp.token_id for lp in first.prompt_logprobs] == prompt[1:]
    assert all(1 <= len(lp.top) <= 2 and lp.logprob <= 0 for lp in first.prompt_logprobs)
    tcp_1x1.wait_all_blocks_free()


def test_repeated_prompt_hits_the_prefill_cache(tcp_1x1, prompts):
    stub = tcp_1x1.stub()
    collect(stub.Generate(greedy_request(prompts[-1], 2)))
    _, _, usage = collect(stub.Generate(greedy_request(prompts[-1], 2)))
    assert usage.cached_tokens == (len(prompts[-1]) - 1) // 16 * 16


@pytest.mark.parametrize(
    "request_kwargs, words",
    [
        ({"token_ids": pb.TokenIds(ids=[5] * 2000)}, "2000 tokens long, but max_model_len is 1024"),
        ({"token_ids": pb.TokenIds(ids=[])}, "the prompt is empty"),
        ({}, "has no prompt"),
        ({"text": "hi", "sampling": pb.SamplingParams(temperature=-1)}, "temperature"),
        ({"text": "hi", "sampling": pb.SamplingParams(top_p=2)}, "top_p"),
        ({"text": "hi", "sampling": pb.SamplingParams(max_tokens=-1)}, "max_tokens"),
        (
            {"text": "hi", "sampling": pb.SamplingParams(prompt_logprobs=-1)},
            "prompt_logprobs must be non-negative",
        ),
        (
            {"text": "hi", "sampling": pb.SamplingParams(prompt_logprobs=10**6)},
            "prompt_logprobs must be at most the vocabulary size",
        ),
        ({"text": "hi", "sampling": pb.SamplingParams(logprobs=10**6)}, "logprobs must be at most"),
        (
            {"token_ids": pb.TokenIds(ids=[5] * 1000), "sampling": pb.SamplingParams(max_tokens=25)},
            "maximum context length is 1024 tokens, but 1025 were requested",
        ),
        ({"text": "hi", "model": "no-such-model"}, "unknown model"),
    ],
)
def test_bad_requests_get_invalid_argument(tcp_1x1, request_kwargs, words):
    with pytest.raises(grpc.RpcError) as err:
        list(tcp_1x1.stub().Generate(pb.GenerateRequest(**request_kwargs)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in err.value.details()


def test_max_tokens_zero_runs_up_to_the_context(tcp_1x1):
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[5] * 1000), sampling=pb.SamplingParams(max_tokens=0, ignore_eos=True)
    )
    chunks = list(tcp_1x1.stub().Generate(request))
    assert sum(len(c.token_ids) for c in chunks) == 24  # max_model_len 1024 - the prompt
    assert [c.finish_reason for c in chunks if c.finish_reason] == ["length"]
    assert chunks[-1].usage.prompt_tokens == 1000 and chunks[-1].usage.completion_tokens == 24


def test_cancelled_stream_frees_blocks_everywhere(tcp_1x1, prompts):
    call = tcp_1x1.stub().Generate(greedy_request(prompts[-1], 400, ignore_eos=True))
    got = 0
    for _ in call:
        got += 1
        if got == 3:
            call.cancel()
            break
    assert got == 3
    tcp_1x1.wait_all_blocks_free(timeout=10)


class _FailingPrefill(pb_grpc.PrefillServicer):
    """A prefill worker whose KV transfer fails after it has sent the first token."""

    def __init__(self) -> None:
        self.requests: list[pb.PrefillRequest] = []

    def PrefillMany(self, frames, context):
        """The decode worker's shared stream (serving/mux.py): one call on it, failed after its first token."""
        first = next(frames)
        self.requests.append(first.request)
        yield pb.PrefillReply(stream=first.stream, response=pb.PrefillResponse(first_token_id=42))
        if not first.request.dst_block_ids:  # the grant follows when the prompt came without blocks
            self.requests.append(next(f for f in frames if f.more).request)
        error = pb.CallStatus(code="UNAVAILABLE", details="injected: the KV transfer failed")
        yield pb.PrefillReply(stream=first.stream, error=error)
        for _ in frames:  # the stream stays open until the decode worker closes it
            pass


def test_transfer_failure_after_the_first_token_ends_the_stream_and_frees_blocks(tcp_1x1, prompts):
    """The first token is streamed as soon as the prefill worker samples it, before the KV transfer; a
    transfer that then fails ends the stream with UNAVAILABLE (one correct token, then the error) and
    the decode worker frees the prompt's blocks."""
    fake = _FailingPrefill()
    server = grpc.server(ThreadPoolExecutor(2))
    pb_grpc.add_PrefillServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        decode = next(w for w in tcp_1x1.workers if w["role"] == "decode")
        with grpc.insecure_channel(decode["address"]) as ch:
            call = pb_grpc.DecodeStub(ch).Generate(
                pb.DecodeRequest(
                    request_id="fails-after-first",
                    prompt_token_ids=prompts[-1],
                    sampling=pb.SamplingParams(temperature=0, max_tokens=20),
                    prefill_address=f"127.0.0.1:{port}",
                ),
                timeout=30,
            )
            chunks = []
            with pytest.raises(grpc.RpcError) as err:
                for chunk in call:
                    chunks.append(chunk)
        assert [list(c.token_ids) for c in chunks] == [[42]]
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "injected" in err.value.details()
        need = -(-len(prompts[-1]) // 16)
        blocks = [list(r.dst_block_ids) for r in fake.requests if r.dst_block_ids]
        assert len(blocks) == 1 and len(blocks[0]) == need  # reserved blocks, granted once
        tcp_1x1.wait_all_blocks_free(timeout=10)
    finally:
        server.stop(0)


def test_gloo_2x2_matches_transformers(gloo_2x2, prompts, expected):
    assert run_batch(gloo_2x2, prompts) == expected
    gloo_2x2.wait_all_blocks_free()


def test_32_concurrent_streams(gloo_2x2, prompts):
    stub = gloo_2x2.stub()
    reqs = [greedy_request(prompts[i % len(prompts)], 6, ignore_eos=True) for i in range(32)]
    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(lambda r: collect(stub.Generate(r)), reqs))
    assert all(len(tokens[0]) == 6 for tokens, _, _ in results)
    loads = gloo_2x2.wait_all_blocks_free()
    assert sum(1 for x in loads if x.role == "decode") == 2


def test_killed_decode_worker_ends_stream_unavailable_and_cluster_serves_on(gloo_2x2, prompts, expected):
    stub = gloo_2x2.stub()
    call = stub.Generate(greedy_request(prompts[-1], 500, ignore_eos=True))
    first = next(iter(call))
    assert first.token_ids
    # the first token is streamed as soon as the prefill worker samples it, which can be before the decode
    # worker's next load report (every 0.1 s) counts the request: wait for that report
    deadline = time.monotonic() + 5.0
    while True:
        busy = [
            w
            for w, load in zip([w for w in gloo_2x2.workers], gloo_2x2.loads())
            if load.role == "decode" and load.num_running > 0
        ]
        if busy or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert len(busy) == 1
    os.kill(busy[0]["pid"], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        for _ in call:
            pass
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert time.monotonic() - t0 < 5.0
    gloo_2x2.workers.remove(busy[0])
    done = threading.Event()
    outs = run_batch(gloo_2x2, prompts[:4])
    done.set()
    assert outs == expected[:4]


@pytest.mark.parametrize("transport, n_prefill, n_decode", [("tcp", 2, 2), ("nccl", 1, 1)])
def test_other_shapes_match_transformers(transport, n_prefill, n_decode, prompts, expected):
    cluster = start_cluster(n_prefill, n_decode, transport)
    try:
        assert run_batch(cluster, prompts) == expected
        cluster.wait_all_blocks_free()
    finally:
        cluster.stop()


def test_every_server_answers_health_and_reflection(tcp_1x1):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    addresses = {tcp_1x1.router: "pdserve.v1.Router"}
    addresses.update({w["address"]: f"pdserve.v1.{w['role'].capitalize()}" for w in tcp_1x1.workers})
    for address, service in addresses.items():
        with grpc.insecure_channel(address) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=5
            )
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            stream = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
            )
            names = {s.name for s in next(stream).list_services_response.service}
            assert service in names and "grpc.health.v1.Health" in names


def test_router_health_follows_its_workers():
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    cluster = start_cluster(1, 1, "tcp")
    try:

        def status() -> int:
            with grpc.insecure_channel(cluster.router) as ch:
                return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status

        assert status() == health_pb2.HealthCheckResponse.SERVING
        decode = next(w for w in cluster.workers if w["role"] == "decode")
        os.kill(decode["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while status() == health_pb2.HealthCheckResponse.SERVING:
            assert time.monotonic() < deadline, "the router still says SERVING with no decode worker"
            time.sleep(0.25)
        with pytest.raises(grpc.RpcError) as err:
            list(cluster.stub().Generate(pb.GenerateRequest(text="hi")))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        cluster.stop()


def test_pdserve_health_answers_for_live_workers_and_fails_for_a_dead_port(tcp_1x1) -> None:
    """`pdserve health` (compose.yaml's health checks) asks the gRPC health service of each address."""
    from serving.cli import main
    from serving.roles import free_port

    live = [tcp_1x1.router, *(w["address"] for w in tcp_1x1.workers)]
    assert main(["health", *live]) == 0
    assert main(["health", live[0], f"127.0.0.1:{free_port()}", "--timeout", "0.5"]) == 1
