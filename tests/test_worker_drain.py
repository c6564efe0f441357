"""Workers and `pdserve up` drain on SIGTERM, with real processes on CPU: streams in flight finish (or, past
the drain timeout, end with UNAVAILABLE "... shutting down"), every process exits 0 and nothing prints a
traceback. A decode worker told to stop by someone else drains (NOT_SERVING, `draining` in GetLoad) and
`pdserve up`, still running, starts it again on the same address."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import grpc
import pytest

from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc
from tests.cluster import (
    Cluster,
    Stream,
    greedy_request,
    health,
    process_state,
    start_cluster,
    wait_until,
    worker_load,
)

pytestmark = pytest.mark.slow

# The CPU machines that run these are shared and can be slow (under a token a second per stream when
# loaded), so streams that must finish are short-ish and their drain gets a long timeout; the default
# (30 s) is what production uses.
LONG_DRAIN = ("--drain-timeout-s", "240")
SAMPLING = pb.SamplingParams(temperature=0, max_tokens=4)
FINISHING = 64  # tokens per stream that must finish while its worker drains
NOISE = ("Traceback", "Task was destroyed", "Exception not handled", "Exception ignored")


def _prompt(i: int) -> list[int]:
    return [1, 422 + i, 3458, 314, 253, 2176, 282, 9 + i]


def _streams(cluster: Cluster, n: int, max_tokens: int) -> list[Stream]:
    """`n` long greedy streams, returned once each has its first tokens (so each is inside a worker)."""
    stub = cluster.stub()
    streams = [Stream(stub, greedy_request(_prompt(i), max_tokens, ignore_eos=True)) for i in range(n)]
    wait_until(lambda: all(len(s.tokens) >= 2 or s.error for s in streams), 180, "every stream streaming")
    assert all(s.error is None and not s.finish_reason for s in streams), [s.error for s in streams]
    return streams


def _exit_code(proc: subprocess.Popen, timeout: float) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"pdserve up did not exit within {timeout:g} s") from None


def _assert_quiet(cluster: Cluster) -> None:
    out = cluster.output()
    for noise in NOISE:
        assert noise not in out, f"{noise!r} in the cluster's output:\n{out[-6000:]}"


@pytest.mark.timeout(600)
def test_sigterm_to_up_lets_every_stream_finish_and_exits_0():
    """Embeddings in flight (Router.Embed, queued on the prefill worker) finish too; the drain does not wait out its
    timeout (240 s) for them."""
    cluster = start_cluster(1, 1, "tcp", *LONG_DRAIN)
    try:
        streams = _streams(cluster, 3, FINISHING)
        embed = pb_grpc.RouterStub(grpc.insecure_channel(cluster.router)).Embed
        embeds = [embed.future(pb.EmbedRequest(token_ids=pb.TokenIds(ids=[7 + i] * 1000))) for i in range(4)]
        prefill = next(w for w in cluster.workers if w["role"] == "prefill")

        def embedding_admitted() -> bool:
            load = worker_load(prefill)
            return load is not None and load.num_running + load.num_waiting > 0

        wait_until(embedding_admitted, 60, "the embeddings on the prefill worker")
        cluster.proc.send_signal(signal.SIGTERM)
        for s in streams:
            s.join(timeout=300)
        assert [(s.error, s.finish_reason, len(s.tokens)) for s in streams] == [
            (None, "length", FINISHING)
        ] * 3
        # one that reached the router after the SIGTERM is refused at once, as a new request is
        dims, refused = [], (grpc.StatusCode.UNAVAILABLE, "server shutting down")
        for e in embeds:
            try:
                dims.append(len(e.result(timeout=300).embedding))
            except grpc.RpcError as err:
                assert (err.code(), err.details()) == refused
        # the admitted ones finished, and in time (the exit below)
        assert dims and dims == [576] * len(dims), dims
        assert _exit_code(cluster.proc, 120) == 0
        _assert_quiet(cluster)
    finally:
        cluster.stop()


@pytest.mark.timeout(600)
def test_drain_timeout_ends_streams_with_unavailable_and_exits_0():
    cluster = start_cluster(1, 1, "tcp", "--drain-timeout-s", "1")
    try:
        streams = _streams(cluster, 3, 300)
        cluster.proc.send_signal(signal.SIGTERM)
        for s in streams:
            s.join(timeout=120)
        for s in streams:
            assert s.error is not None and len(s.tokens) < 300, (s.finish_reason, len(s.tokens))
            assert s.error.code() == grpc.StatusCode.UNAVAILABLE
            details = s.error.details()
            assert "shutting down" in details  # the worker's "server shutting down" or the router's words
            assert not any(w in details for w in ("Traceback", "StatusCode", "<", "Error:")), details
        assert _exit_code(cluster.proc, 60) == 0
        _assert_quiet(cluster)
    finally:
        cluster.stop()


@pytest.mark.timeout(600)
def test_a_decode_worker_sigtermed_alone_drains_exits_0_and_up_starts_it_again():
    """A worker that exits while `up` runs, even cleanly, is restarted: nobody asked `up` to stop."""
    cluster = start_cluster(1, 2, "tcp", "--policy", "round_robin", *LONG_DRAIN)
    try:
        streams = _streams(cluster, 4, FINISHING)
        decode = [w for w in cluster.workers if w["role"] == "decode"]
        busy = next(w for w in decode if (load := worker_load(w)) is not None and load.num_running > 0)
        os.kill(busy["pid"], signal.SIGTERM)
        load = wait_until(lambda: (x := worker_load(busy)) is not None and x.draining and x, 10, "draining")
        assert load.num_running > 0  # it reports draining while it still holds its streams
        assert health(busy["address"]) == "NOT_SERVING"
        with grpc.insecure_channel(busy["address"]) as ch, pytest.raises(grpc.RpcError) as refused:
            request = pb.DecodeRequest(request_id="late", prompt_token_ids=_prompt(9), sampling=SAMPLING)
            list(pb_grpc.DecodeStub(ch).Generate(request, timeout=30))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert refused.value.details() == "server shutting down"
        for s in streams:
            s.join(timeout=300)
        assert [(s.error, s.finish_reason, len(s.tokens)) for s in streams] == [
            (None, "length", FINISHING)
        ] * 4
        restarted = json.loads(cluster.wait_line("pdserve restarted: ", timeout=120))
        assert (restarted["role"], restarted["address"]) == ("decode", busy["address"])
        assert restarted["pid"] != busy["pid"]
        died = f"decode {busy['address']} (pid {busy['pid']}) died: exit code 0"
        assert died in cluster.output()
        assert process_state(busy["pid"]) is None  # reaped, not a zombie
        wait_until(lambda: health(busy["address"]) == "SERVING", 180, "the restarted worker serving")
        cluster.proc.send_signal(signal.SIGTERM)
        assert _exit_code(cluster.proc, 120) == 0
        _assert_quiet(cluster)
    finally:
        cluster.stop()
